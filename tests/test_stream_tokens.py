"""What a stream that did not end as planned records: a client that left mid-answer still costs the
tokens it was sent (on each API), and a stream longer than the proxy captures is judged on whole
events, not on an event cut in half."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from collections.abc import Iterator

import aiohttp
import pytest

from service.proxy.streaming import STREAM_CAPTURE_LIMIT
from tests.fixtures.servers import (
    SIM_MODEL,
    QuietHandler,
    canned_upstream,
    http_server,
    metric_value,
    proxy_config,
    scrape,
    sim_config,
)

SLOW = {**copy.deepcopy(SIM_MODEL), "latency_s": {"median": 4.0, "p95": 4.5}, "ttft_s": {"median": 0.05, "p95": 0.1},
        "output_tokens": {"median": 300, "p95": 400}}

CASES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me a long story"}]},
             b'"content":"'),
    "responses": ("/v1/responses", {"input": "tell me a long story"}, b'"delta":"'),
    "messages": ("/v1/messages", {"max_tokens": 1000, "messages": [{"role": "user", "content": "tell me a long story"}]},
                 b'"text_delta"'),
}


async def leave_after(url: str, body: dict, marker: bytes) -> bytes:
    """Stream, read until `marker` came (the answer's text has begun, an error event), then hang up."""
    got = b""
    async with aiohttp.ClientSession() as session:
        response = await session.post(url, json=body)
        assert response.status == 200, await response.text()
        while marker not in got:
            chunk = await asyncio.wait_for(response.content.readany(), 10)
            assert chunk, f"the stream ended before {marker!r}: {got[-500:]!r}"
            got += chunk
        response.close()
    return got


@pytest.mark.parametrize("api", list(CASES))
def test_a_client_that_leaves_mid_answer_still_costs_its_tokens(servers, api):
    sim = servers.simulator(sim_config({"good-model": SLOW, "new-model": SLOW}, time_scale=1.0))
    cfg = proxy_config(sim.url)
    model = "stable-m"
    if api == "messages":  # the simulator speaks Anthropic's Messages too, as a provider of that API
        cfg["providers"]["claude"] = {"base_url": sim.url + "/v1", "api": "anthropic", "timeout_s": 10}
        cfg["models"]["claude-m"] = {"provider": "claude", "name": "good-model",
                                     "price": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}}
        cfg["routes"]["claude-r"] = {"stable": "claude-m"}
        model = "claude-m"
    proxy = servers.proxy(cfg)
    path, body, marker = CASES[api]
    route = "claude-r" if api == "messages" else "support-bot"
    started = time.monotonic()
    asyncio.run(leave_after(proxy.url + path, {"model": route, "stream": True, **body}, marker))
    assert time.monotonic() - started < 3, "the answer was meant to be still going when the client left"

    deadline = time.monotonic() + 10
    while True:
        text = scrape(proxy.url)
        cancelled = metric_value(text, "modelcanary_failures_total", model=model, cause="client_cancelled")
        if cancelled == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert cancelled == 1
    assert metric_value(text, "modelcanary_tokens_total", model=model, type="input") >= 1
    assert metric_value(text, "modelcanary_tokens_total", model=model, type="output") >= 1
    assert metric_value(text, "modelcanary_cost_usd_total", model=model) > 0
    assert "Traceback" not in proxy.output()


def chat_stream(min_bytes: int) -> bytes:
    """A whole chat stream longer than `min_bytes`, of ~1 kB events (a size that TCP reads cut inside)."""
    piece = "word " * 190
    event = b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                    "choices": [{"index": 0, "delta": {"content": piece}}]}).encode() + b"\n\n"
    events = [event] * (min_bytes // len(event) + 1)
    last = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    return b"".join(events) + b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"


def test_a_stream_longer_than_its_capture_is_judged_on_whole_events(servers):
    stream = chat_stream(STREAM_CAPTURE_LIMIT + 2 * 1024 * 1024)
    with canned_upstream(stream, "text/event-stream") as (url, _):
        proxy = servers.proxy(proxy_config(url))

        async def read_all() -> bytes:
            async with aiohttp.ClientSession() as session, session.post(
                    proxy.url + "/v1/chat/completions",
                    json={"model": "support-bot", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200
                return await r.read()

        got = asyncio.run(read_all())
    assert got == stream  # every event, and no error event after [DONE]
    deadline = time.monotonic() + 10
    while True:
        text = scrape(proxy.url)
        done = metric_value(text, "modelcanary_requests_total", model="stable-m", outcome="completed")
        if done == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert done == 1 and metric_value(text, "modelcanary_failures_total", model="stable-m") == 0


def wait_recorded(url: str, model: str, metric: str = "modelcanary_requests_total") -> str:
    """The metrics once one request of `model` is counted in `metric` (at most 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        text = scrape(url)
        if metric_value(text, metric, model=model) >= 1 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


async def stream_through(url: str, body: dict) -> bytes:
    async with aiohttp.ClientSession() as session, session.post(url, json={"stream": True, **body}) as r:
        assert r.status == 200
        return await r.read()


def test_a_long_stream_that_never_ends_is_the_providers_failure(servers):
    """Past the capture the proxy can't see a finish_reason, so a clipped stream is whole only once its
    end event (`data: [DONE]`) was forwarded; one the upstream closes before it is `bad_response`."""
    whole = chat_stream(STREAM_CAPTURE_LIMIT + 2 * 1024 * 1024)
    cut = whole[:whole.rindex(b"data: {")]  # no last chunk, no finish_reason, no [DONE]
    with canned_upstream(cut, "text/event-stream") as (url, _):
        proxy = servers.proxy(proxy_config(url))
        got = asyncio.run(stream_through(proxy.url + "/v1/chat/completions", {
            "model": "support-bot", "messages": [{"role": "user", "content": "hi"}]}))
    assert got.startswith(cut) and b'"code": "bad_response"' in got[len(cut):].replace(b'":"', b'": "')
    text = wait_recorded(proxy.url, "stable-m")
    assert metric_value(text, "modelcanary_failures_total", model="stable-m", cause="bad_response") == 1


def _event(kind: str, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def test_an_error_early_in_a_long_stream_is_not_lost_past_the_capture(servers):
    started = _event("response.created", response={"id": "r1", "status": "in_progress", "output": []})
    stream = started + _event("error", code="server_error", message="boom") + \
        b": keep-alive\n\n" * (STREAM_CAPTURE_LIMIT // 14 + 1000)
    with canned_upstream(stream, "text/event-stream") as (url, _):
        proxy = servers.proxy(proxy_config(url))
        asyncio.run(stream_through(proxy.url + "/v1/responses", {"model": "support-bot", "input": "hi"}))
    text = wait_recorded(proxy.url, "stable-m")
    assert metric_value(text, "modelcanary_failures_total", model="stable-m", cause="provider_5xx") == 1


def test_a_stream_the_upstream_cuts_short_still_costs_its_tokens(servers):
    """A Messages stream told its input at the start and sent text, then ended before message_stop:
    the provider failed it, and both the input it counted and the output sent are recorded."""
    stream = _event("message_start", message={"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                              "model": "c", "usage": {"input_tokens": 1000, "output_tokens": 1}}) + \
        _event("content_block_start", index=0, content_block={"type": "text", "text": ""}) + \
        _event("content_block_delta", index=0, delta={"type": "text_delta", "text": "word " * 400})
    with canned_upstream(stream, "text/event-stream") as (url, _):
        cfg = proxy_config(url)
        cfg["providers"]["claude"] = {"base_url": url + "/v1", "api": "anthropic", "timeout_s": 10}
        cfg["models"]["claude-m"] = {"provider": "claude", "name": "c"}
        cfg["routes"]["claude-r"] = {"stable": "claude-m"}
        proxy = servers.proxy(cfg)
        asyncio.run(stream_through(proxy.url + "/v1/messages", {
            "model": "claude-r", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]}))
    text = wait_recorded(proxy.url, "claude-m")
    assert metric_value(text, "modelcanary_failures_total", model="claude-m", cause="bad_response") == 1
    assert metric_value(text, "modelcanary_tokens_total", model="claude-m", type="input") == 1000
    assert metric_value(text, "modelcanary_tokens_total", model="claude-m", type="output") == 500  # 2,000 chars



@contextlib.contextmanager
def events_then_silence(events: bytes, hold_s: float) -> Iterator[str]:
    """An upstream that answers any POST with an event stream: `events` at once, then nothing for
    `hold_s` (the connection kept open), then the body's end."""
    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            if events:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(events), events))
            self.wfile.flush()
            time.sleep(hold_s)
            self.wfile.write(b"0\r\n\r\n")


    with http_server(Handler) as url:
        yield url


def start_proxy(servers, url: str, api: str):
    """A proxy on `url` for `api`: (proxy, model key, route)."""
    cfg = proxy_config(url)
    if api != "messages":
        return servers.proxy(cfg), "stable-m", "support-bot"
    cfg["providers"]["claude"] = {"base_url": url + "/v1", "api": "anthropic", "timeout_s": 10}
    cfg["models"]["claude-m"] = {"provider": "claude", "name": "good-model",
                                 "price": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}}
    cfg["routes"]["claude-r"] = {"stable": "claude-m"}
    return servers.proxy(cfg), "claude-m", "claude-r"


def wait_failed(url: str, model: str) -> str:
    """The metrics once a failure of `model` is recorded."""
    return wait_recorded(url, model, "modelcanary_failures_total")


async def leave_at_the_head(url: str, body: dict) -> None:
    """Stream, and hang up once the answer's head has come, before its first event."""
    async with aiohttp.ClientSession() as session:
        response = await session.post(url, json=body)
        assert response.status == 200, await response.text()
        response.close()


@pytest.mark.parametrize("api", list(CASES))
def test_a_stream_left_before_its_first_event_costs_its_input(servers, api):
    """The upstream began the answer (its 200 came), so the prompt is billed: estimated from what the
    model was asked, on every API; no output came, so none is billed."""
    with events_then_silence(b"", 3.0) as url:
        proxy, model, route = start_proxy(servers, url, api)
        path, body, _ = CASES[api]
        asyncio.run(leave_at_the_head(proxy.url + path, {"model": route, "stream": True, **body}))
        text = wait_failed(proxy.url, model)
    assert metric_value(text, "modelcanary_failures_total", model=model, cause="client_cancelled") == 1
    assert metric_value(text, "modelcanary_tokens_total", model=model, type="input") >= 3
    assert metric_value(text, "modelcanary_tokens_total", model=model, type="output") == 0
    assert "Traceback" not in proxy.output()


def sse(*events: dict, named: bool = False) -> bytes:
    return b"".join((b"event: %s\n" % e["type"].encode() if named else b"") + b"data: " + json.dumps(e).encode()
                    + b"\n\n" for e in events)


PARTIAL_THEN_ERROR = {
    "chat": (sse({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                  "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Partial answer, then"}}]},
                 {"error": {"message": "slow down", "type": "requests", "code": "rate_limit_exceeded"}}),
             "rate_limited", 0),
    "responses": (sse({"type": "response.created", "response": {"id": "r1", "object": "response", "status": "in_progress",
                                                                 "output": []}},
                      {"type": "response.output_item.added", "output_index": 0,
                       "item": {"type": "message", "role": "assistant", "content": []}},
                      {"type": "response.output_text.delta", "output_index": 0, "delta": "Partial answer, then"},
                      {"type": "error", "code": "server_error", "message": "the model failed"}, named=True),
                  "provider_5xx", 0),
    "messages": (sse({"type": "message_start", "message": {"id": "m1", "type": "message", "role": "assistant",
                                                           "content": [], "usage": {"input_tokens": 25, "output_tokens": 1}}},
                     {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                     {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                                                                            "text": "Partial answer, then"}},
                     {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, named=True),
                 "provider_5xx", 25),
}


@pytest.mark.parametrize("api", list(PARTIAL_THEN_ERROR))
def test_an_error_event_the_client_was_sent_is_the_providers_failure_even_if_the_client_then_left(servers, api):
    """The upstream sends part of an answer, then an error event, and holds the connection open; the
    client reads the error and hangs up. The call failed as the provider said (not client_cancelled),
    and the tokens it sent count (Messages: the input it told at the start)."""
    events, cause, told_input = PARTIAL_THEN_ERROR[api]
    with events_then_silence(events, 5.0) as url:
        proxy, model, route = start_proxy(servers, url, api)
        path, body, _ = CASES[api]
        got = asyncio.run(leave_after(proxy.url + path, {"model": route, "stream": True, **body}, b"error"))
        text = wait_failed(proxy.url, model)
    assert b"Partial answer, then" in got
    assert metric_value(text, "modelcanary_failures_total", model=model, cause=cause, blame="provider") == 1, text
    assert metric_value(text, "modelcanary_failures_total", model=model, cause="client_cancelled") == 0
    assert metric_value(text, "modelcanary_tokens_total", model=model, type="output") >= 3
    if told_input:
        assert metric_value(text, "modelcanary_tokens_total", model=model, type="input") == told_input
    assert "Traceback" not in proxy.output()


def test_a_malformed_event_the_client_was_sent_is_a_bad_response_even_if_the_client_then_left(servers):
    events = sse({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                  "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Partial"}}]}) + b"data: {oops\n\n"
    with events_then_silence(events, 5.0) as url:
        proxy, model, route = start_proxy(servers, url, "chat")
        path, body, _ = CASES["chat"]
        asyncio.run(leave_after(proxy.url + path, {"model": route, "stream": True, **body}, b"{oops"))
        text = wait_failed(proxy.url, model)
    assert metric_value(text, "modelcanary_failures_total", model=model, cause="bad_response", blame="provider") == 1


def test_a_chunk_with_a_null_error_is_no_error():
    """As the openai SDKs read a chunk: `"error": null` beside the choices is no error."""
    from service.proxy.sse import reassemble

    result = reassemble(sse({"id": "c1", "object": "chat.completion.chunk", "model": "m", "error": None,
                             "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]})
                        + b"data: [DONE]\n\n")
    assert result.problem is None and result.ended and result.response is not None
    assert result.response["choices"][0]["message"]["content"] == "ok"


def test_a_stream_cut_inside_an_event_sends_no_half_event_and_says_why(servers):
    """The upstream ends its body inside an event: the client gets the whole events before it, then
    the error event, each one readable on its own (never the cut event glued to the error)."""
    whole = sse({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]})
    cut = b'data: {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "lo'
    with events_then_silence(whole + cut, 0.0) as url:
        proxy, model, route = start_proxy(servers, url, "chat")
        path, body, _ = CASES["chat"]
        got = asyncio.run(stream_through(proxy.url + path, {"model": route, **body}))
        text = wait_failed(proxy.url, model)
    events = [e for e in got.split(b"\n\n") if e.strip()]
    assert events[0] + b"\n\n" == whole
    assert len(events) == 2 and events[1].startswith(b"data: "), got
    assert json.loads(events[1][6:])["error"]["code"] == "bad_response"
    assert metric_value(text, "modelcanary_failures_total", model=model, cause="bad_response") == 1


TEXT = "word " * 40  # 200 characters: 50 tokens at 4 characters a token
TEXT_DONE = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": TEXT}]}


def _messages_stream(start_usage: dict | None) -> bytes:
    message = {"id": "m1", "type": "message", "role": "assistant", "content": [], "model": "c"}
    return sse({"type": "message_start", "message": {**message, **({"usage": start_usage} if start_usage else {})}},
               {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
               {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": TEXT}},
               {"type": "content_block_stop", "index": 0},
               {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}},
               {"type": "message_stop"}, named=True)


UNTOLD_OUTPUT = {  # a whole stream whose upstream never told its output tokens: (events, input it told)
    "responses": (sse({"type": "response.created", "response": {"id": "r1", "status": "in_progress", "output": []}},
                      {"type": "response.output_item.added", "output_index": 0,
                       "item": {"type": "message", "role": "assistant", "content": []}},
                      {"type": "response.output_text.delta", "output_index": 0, "delta": TEXT},
                      {"type": "response.output_item.done", "output_index": 0, "item": TEXT_DONE},
                      {"type": "response.completed", "response": {"id": "r1", "object": "response", "status": "completed",
                                                                  "output": [TEXT_DONE], "usage": None}}, named=True),
                  0),
    "messages": (_messages_stream(None), 0),
    # input told at the start with the placeholder output count, and no final count in message_delta
    "messages-input-told": (_messages_stream({"input_tokens": 25, "output_tokens": 1}), 25),
}


@pytest.mark.parametrize("case", list(UNTOLD_OUTPUT))
def test_a_whole_stream_that_never_tells_its_output_tokens_counts_its_text(servers, case):
    events, told_input = UNTOLD_OUTPUT[case]
    api = case.split("-")[0]
    with canned_upstream(events, "text/event-stream") as (url, _):
        proxy, model, route = start_proxy(servers, url, api)
        path, body, _ = CASES[api]
        got = asyncio.run(stream_through(proxy.url + path, {"model": route, **body}))
        text = wait_recorded(proxy.url, model)
    assert got == events
    assert metric_value(text, "modelcanary_requests_total", model=model, outcome="completed") == 1, text
    assert metric_value(text, "modelcanary_tokens_total", model=model, type="output") == 50
    assert metric_value(text, "modelcanary_tokens_total", model=model, type="input") == (told_input or 12)  # "tell me a long story": 5 tokens, 4 of template, 3 more
