"""Tools the provider runs itself against the client's own servers (a Responses `mcp` tool, by
`server_url` or `connector_id`; the Messages API's `mcp_servers`) act outside the model: a shadow
call would make the provider call the client's MCP server again, once per shadow call. Such
requests are served as usual and never shadowed (`shadow_dropped_total{reason="stateful"}`).

The upstream here stands in for such a provider: before answering, it calls every MCP server the
request names, as OpenAI and Anthropic do."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

import anthropic
import openai
import pytest

from tests.fixtures.servers import QuietHandler, http_server, metric_value, scrape, shadowed_route, start_proxy

ROUTES_OPENAI = ("mcp-url", "mcp-connector", "function-tool")
ROUTES_ANTHROPIC = ("claude-mcp",)
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 0, "status": "completed",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "Ticket 7 created.", "annotations": []}]}],
            "usage": {"input_tokens": 12, "output_tokens": 4, "total_tokens": 16}}
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "stop_reason": "end_turn", "stop_sequence": None,
           "content": [{"type": "text", "text": "Ticket 7 created."}], "usage": {"input_tokens": 12, "output_tokens": 4}}


@dataclass
class Provider:
    """The emulated provider's URL, the model of each request it got, and how often the client's MCP
    server was called."""

    url: str
    models: list[str] = field(default_factory=list)
    mcp_hits: list[str] = field(default_factory=list)


def _mcp_urls(body: dict) -> list[str]:
    urls = [t.get("server_url") for t in body.get("tools") or () if isinstance(t, dict) and t.get("type") == "mcp"]
    urls += [s.get("url") for s in body.get("mcp_servers") or () if isinstance(s, dict)]
    return [u for u in urls if isinstance(u, str)]


def _handler(respond: Callable[[BaseHTTPRequestHandler, bytes], None]) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            respond(self, self.rfile.read(int(self.headers.get("content-length") or 0)))

    return Handler


def _send(handler: BaseHTTPRequestHandler, payload: dict) -> None:
    data = json.dumps(payload).encode()
    handler.send_response(200)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@contextmanager
def _provider() -> Iterator[tuple[Provider, str]]:
    """The provider, and the client's MCP server's URL."""
    provider = Provider("")

    def mcp(handler: BaseHTTPRequestHandler, body: bytes) -> None:
        provider.mcp_hits.append(json.loads(body)["model"])
        _send(handler, {"jsonrpc": "2.0", "id": 1, "result": {}})

    def upstream(handler: BaseHTTPRequestHandler, raw: bytes) -> None:
        body = json.loads(raw)
        provider.models.append(body["model"])
        for url in _mcp_urls(body):  # the provider runs the client's remote tools itself
            call = urllib.request.Request(url, data=json.dumps({"model": body["model"]}).encode(),
                                          headers={"content-type": "application/json"})
            urllib.request.urlopen(call, timeout=5).read()
        _send(handler, {**(MESSAGE if handler.path.endswith("/messages") else RESPONSE), "model": body["model"]})

    with http_server(_handler(mcp)) as mcp_url, http_server(_handler(upstream)) as url:
        provider.url = url
        yield provider, mcp_url + "/mcp"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote-tools")
    with _provider() as (provider, mcp_url):
        cfg = {"providers": {"emu": {"base_url": provider.url + "/v1", "timeout_s": 5, "max_retries": 0},
                             "emu-claude": {"base_url": provider.url + "/v1", "api": "anthropic", "timeout_s": 5,
                                            "max_retries": 0}},
               "models": {"stable-m": {"provider": "emu", "name": "good-model"},
                          "candidate-m": {"provider": "emu", "name": "new-model"},
                          "stable-a": {"provider": "emu-claude", "name": "good-claude"},
                          "candidate-a": {"provider": "emu-claude", "name": "new-claude"}},
               "routes": {**{r: shadowed_route("stable-m", "candidate-m") for r in ROUTES_OPENAI},
                          **{r: shadowed_route("stable-a", "candidate-a") for r in ROUTES_ANTHROPIC}}}
        proxy = start_proxy(tmp, cfg)
        yield proxy, provider, mcp_url
        proxy.stop()


def _metric(proxy, name: str, **labels) -> float:
    return metric_value(scrape(proxy.url), name, **labels)


def _shadow_settled(proxy, route: str, candidate: str, dropped_before: float) -> float:
    """Waits until the sampled request was dropped as stateful or shadowed to the candidate; the
    number dropped as stateful on the route."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = scrape(proxy.url)
        dropped = metric_value(text, "modelcanary_shadow_dropped_total", route=route, reason="stateful")
        if dropped > dropped_before or metric_value(text, "modelcanary_shadow_requests_total", route=route,
                                                    model=candidate) > 0:
            return dropped
        time.sleep(0.05)
    raise AssertionError(f"route {route}: the sampled request was neither shadowed nor dropped")


def _wait_for(pred: Callable[[], bool], timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pred()


def _openai(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)


@pytest.mark.parametrize("route", ["mcp-url", "mcp-connector"])
def test_a_responses_request_with_a_remote_mcp_tool_is_never_shadowed(stack, route):
    proxy, provider, mcp_url = stack
    where = {"server_url": mcp_url} if route == "mcp-url" else {"connector_id": "connector_gmail",
                                                                 "authorization": "client-oauth-token"}
    tool = {"type": "mcp", "server_label": "tickets", "require_approval": "never", **where}
    provider.models.clear()
    provider.mcp_hits.clear()
    before = _metric(proxy, "modelcanary_shadow_dropped_total", route=route, reason="stateful")
    raw = _openai(proxy).responses.with_raw_response.create(model=route, input="Open a ticket for order 42",
                                                            tools=[tool])
    assert raw.headers["x-modelcanary-role"] == "stable" and raw.parse().output_text == "Ticket 7 created."
    assert _shadow_settled(proxy, route, "candidate-m", before) == before + 1
    assert provider.models == ["good-model"], "a shadow call reached the provider"
    assert provider.mcp_hits == (["good-model"] if route == "mcp-url" else [])


def test_a_messages_request_with_mcp_servers_is_never_shadowed(stack):
    proxy, provider, mcp_url = stack
    provider.models.clear()
    provider.mcp_hits.clear()
    before = _metric(proxy, "modelcanary_shadow_dropped_total", route="claude-mcp", reason="stateful")
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-client", max_retries=0, timeout=10)
    raw = client.messages.with_raw_response.create(
        model="claude-mcp", max_tokens=100, messages=[{"role": "user", "content": "Open a ticket"}],
        extra_body={"mcp_servers": [{"type": "url", "url": mcp_url, "name": "tickets"}]},
        extra_headers={"anthropic-beta": "mcp-client-2025-04-04"})
    assert raw.headers["x-modelcanary-role"] == "stable" and raw.parse().content[0].text == "Ticket 7 created."
    assert _shadow_settled(proxy, "claude-mcp", "candidate-a", before) == before + 1
    assert provider.models == ["good-claude"], "a shadow call reached the provider"
    assert provider.mcp_hits == ["good-claude"]


def test_a_request_with_only_function_tools_is_still_shadowed(stack):
    """The client runs function tools itself: shadowing them calls nothing of the client's."""
    proxy, provider, _ = stack
    provider.models.clear()
    tool = {"type": "function", "name": "open_ticket", "parameters": {"type": "object", "properties": {}}}
    _openai(proxy).responses.create(model="function-tool", input="Open a ticket for order 42", tools=[tool])
    assert _shadow_settled(proxy, "function-tool", "candidate-m", 0) == 0
    assert _wait_for(lambda: sorted(provider.models) == ["good-model", "good-model", "new-model"]), provider.models
