"""Bad input against a real proxy: every refusal is a 4xx with an OpenAI-shaped body, nothing is a
5xx, unknown fields reach the upstream untouched, and the proxy keeps serving afterwards."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.faults.fault_proxy import FaultProxy
from tests.fixtures.servers import metric_value, proxy_config, scrape, sim_config, start_proxy, start_simulator

pytestmark = pytest.mark.timeout(180)
ROUTE = "support-bot"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    sim = start_simulator(tmp, sim_config())
    fault = FaultProxy("127.0.0.1", sim.port, capture_bytes=64 * 1024 * 1024).start()
    cfg = proxy_config(fault.url)
    cfg["providers"]["claude"] = {"base_url": fault.url + "/v1", "api": "anthropic"}  # the simulator speaks Messages
    cfg["models"]["claude-m"] = {"provider": "claude", "name": "good-model"}
    cfg["routes"]["claude-r"] = {"stable": "claude-m"}
    proxy = start_proxy(tmp, cfg)
    try:
        yield proxy, fault
    finally:
        proxy.stop()
        fault.stop()
        sim.stop()


def request(proxy, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 30) -> tuple[int, bytes, float]:
    req = urllib.request.Request(proxy.url + path, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read(), time.monotonic() - t0


def openai_error(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and "code" in err and "param" in err, err
    return err


def chat(body: dict | bytes, **kw) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


MSG = [{"role": "user", "content": "hi"}]


REFUSED = [
    (b'{"model": "support-bot", "messages": [', 400, None, "not valid JSON"),
    (b"", 400, None, "empty"),
    (b"[1, 2]", 400, None, "JSON object"),
    (b'"just a string"', 400, None, "JSON object"),
    (b"[" * 200_000, 400, None, None),                                        # nested past the recursion limit
    (b'{"model": "support-bot", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None, "UTF-8"),
    (b'\xef\xbb\xbf{"model": "support-bot"}', 400, "messages", None),          # a UTF-8 BOM is tolerated
    (b'{"model": 5, "messages": []}', 400, "model", None),
    (b'{"model": null, "messages": []}', 400, "model", None),
    (b'{"messages": []}', 400, "model", None),
    (b'{"model": "support-bot", "messages": "hi"}', 400, "messages", None),
    (b'{"model": "support-bot"}', 400, "messages", None),
    (b'{"model": "support-bot", "messages": [], "stream": "yes"}', 400, "stream", None),
    (b'{"model": "no-such-route", "messages": []}', 404, "model", "does not exist"),
    (b'{"model": "' + b"x" * 100_000 + b'", "messages": []}', 404, "model", None),
]


@pytest.mark.parametrize(("raw", "status", "param", "needle"), REFUSED, ids=["truncated", "empty", "array", "string", "deep", "bad-utf8", "bom", "model-int", "model-null",
        "model-missing", "messages-string", "messages-missing", "stream-string", "unknown-route", "huge-model-name"])
def test_refused_with_openai_shaped_4xx(stack, raw, status, param, needle):
    proxy, _ = stack
    got, body, elapsed = request(proxy, "POST", "/v1/chat/completions", raw)
    assert got == status, body[:300]
    err = openai_error(body)
    assert err["param"] == param, err
    if needle:
        assert needle in err["message"], err
    assert len(err["message"]) < 1000  # a huge value is not echoed back whole
    assert elapsed < 2


UNSENDABLE = {  # parses as JSON here, but what the upstream would get is not JSON, or not text
    "lone surrogate": (b'"content": "bad \\ud800 text"', "lone UTF-16 surrogate"),
    "NaN": (b'"content": "hi", "temperature": NaN', "NaN or Infinity"),
    "too large": (b'"content": "hi", "temperature": 1e400', "NaN or Infinity"),
}
ENDPOINTS = {  # path -> (body around the field, the error's shape)
    "chat": ("/v1/chat/completions", b'{"model": "support-bot", "messages": [{"role": "user", %s}]}', "openai"),
    "chat via ASGI": ("/v1/chat/completions?x=1", b'{"model": "support-bot", "messages": [{"role": "user", %s}]}',
                      "openai"),
    "responses": ("/v1/responses", b'{"model": "support-bot", "input": [{"role": "user", %s}]}', "openai"),
    "messages": ("/v1/messages", b'{"model": "claude-r", "max_tokens": 5, "messages": [{"role": "user", %s}]}',
                 "anthropic"),
    "pass-through": ("/v1/embeddings", b'{"model": "support-bot", "input": [{%s}]}', "openai"),
}


@pytest.mark.parametrize("what", list(UNSENDABLE))
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_what_json_cannot_carry_upstream_is_a_400_in_the_endpoints_shape(stack, endpoint, what):
    proxy, _ = stack
    path, template, shape = ENDPOINTS[endpoint]
    field, needle = UNSENDABLE[what]
    status, raw, _ = request(proxy, "POST", path, template % field)
    assert status == 400, raw[:300]
    body = json.loads(raw)
    message = body["error"]["message"]
    assert needle in message, body
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body


def test_chat_completions_on_a_route_of_another_api_is_refused_naming_it(stack):
    proxy, _ = stack
    status, raw, _ = request(proxy, "POST", "/v1/chat/completions", chat({"model": "claude-r", "messages": MSG}))
    assert status == 400, raw[:300]
    err = openai_error(raw)
    assert err["param"] == "model" and "api: anthropic" in err["message"] and "/v1/messages" in err["message"]


def test_feedback_with_a_lone_surrogate_is_refused_naming_the_field(stack):
    """Its reason would reach the events and /admin/traffic, which hold text."""
    proxy, _ = stack
    status, raw, _ = request(proxy, "POST", "/v1/feedback",
                             b'{"request_id": "r1", "success": false, "reason": "bad \\ud800"}')
    assert status == 400, raw
    assert openai_error(raw)["param"] == "reason"


WRONG_TYPES = [
    {"model": ROUTE, "messages": [1, 2, 3]},
    {"model": ROUTE, "messages": [{"role": 7, "content": {"a": 1}}]},
    {"model": ROUTE, "messages": MSG, "temperature": "hot", "max_tokens": -5},
    {"model": ROUTE, "messages": MSG, "tools": "not a list", "response_format": 3},
    {"model": ROUTE, "messages": MSG, "user": {"nested": True}, "n": 10**30},
]


def test_wrong_types_inside_messages_never_5xx(stack):
    proxy, _ = stack
    for body in WRONG_TYPES:
        status, raw, _ = request(proxy, "POST", "/v1/chat/completions", chat(body))
        assert status < 500, (body, raw[:300])
        if status >= 400:
            openai_error(raw)


def test_unknown_fields_pass_through_to_the_upstream(stack):
    proxy, fault = stack
    fault.reset_counts()
    body = {"model": ROUTE, "messages": MSG, "x_vendor_extension": {"nested": [1, "two", None]},
            "metadata": {"ticket": "T-1"}, "seed": 7, "logit_bias": {"50256": -100}}
    status, raw, _ = request(proxy, "POST", "/v1/chat/completions", chat(body))
    assert status == 200, raw
    sent = bytes(fault.captured)
    upstream_body = json.loads(sent[sent.index(b"\r\n\r\n") + 4:])
    assert upstream_body["x_vendor_extension"] == {"nested": [1, "two", None]}
    assert upstream_body["metadata"] == {"ticket": "T-1"} and upstream_body["seed"] == 7
    assert upstream_body["logit_bias"] == {"50256": -100}
    assert upstream_body["model"] == "good-model"  # only the model is rewritten to the upstream's name


def test_body_over_the_limit_is_413_and_under_it_is_served(stack):
    proxy, _ = stack
    limit = 10 * 1024 * 1024
    content = "a" * (limit + 1024)
    big = json.dumps({"model": ROUTE, "messages": [{"role": "user", "content": content}]}).encode()
    status, raw, elapsed = request(proxy, "POST", "/v1/chat/completions", big)
    assert status == 413 and openai_error(raw)["code"] == "request_too_large", raw
    # without a content-length (chunked upload) the limit holds too
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    try:
        for i in range(0, len(big), 1 << 20):
            piece = big[i:i + (1 << 20)]
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        s.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the proxy answered and closed before the whole upload
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and b"}}" in data:
                break
    except OSError:
        pass
    s.close()
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    # 9.5 MB is under the limit: the proxy forwards it (the simulator refuses it as too long: a client 400)
    ok = json.dumps({"model": ROUTE, "messages": [{"role": "user", "content": "b" * (limit - 512 * 1024)}]}).encode()
    status, raw, _ = request(proxy, "POST", "/v1/chat/completions", ok)
    assert status in (200, 400), raw[:300]
    if status == 400:
        assert openai_error(raw)["code"] == "context_length_exceeded"


def test_a_body_that_stops_coming_is_let_go_with_a_408(stack):
    """Slow-loris on the body: the head came, then part of the body, then nothing. The connection (and
    the part read) is let go after HEAD_TIMEOUT_S without a byte, on the chat route (below ASGI) and
    on the others; other clients are served meanwhile."""
    from service.proxy.server import HEAD_TIMEOUT_S

    proxy, _ = stack
    stalled = []
    for path in ("/v1/chat/completions", "/v1/responses"):
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=3 * HEAD_TIMEOUT_S + 10)
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                  b'{"model": "support-bot", "messages": [' % path.encode())
        stalled.append(s)
    body = json.dumps({"model": ROUTE, "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, elapsed = request(proxy, "POST", "/v1/chat/completions", body)
    assert status == 200 and elapsed < HEAD_TIMEOUT_S
    for s in stalled:
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        s.close()
        head, _, raw = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data[:200]
        assert openai_error(raw)["code"] == "request_timeout"


def test_a_schema_nested_deeper_than_the_checker_goes_is_not_a_proxy_error(stack):
    """A client's `json_schema` (or tool `parameters`) nested 200 levels: unusable for the check, so
    not held against the model, and never the proxy's 500 after the upstream was paid."""
    proxy, _ = stack
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "array", "items": schema}
    before = metric_value(scrape(proxy.url), "modelcanary_failures_total", cause="proxy_error")
    for stream in (False, True):
        body = {"model": ROUTE, "messages": [{"role": "user", "content": "a list"}], "stream": stream,
                "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
        status, raw, _ = request(proxy, "POST", "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200 and b"proxy_error" not in raw, raw[-300:]
    status, raw, _ = request(proxy, "POST", "/v1/chat/completions", json.dumps({
        "model": ROUTE, "messages": [{"role": "user", "content": "call it"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": schema}}}}]}).encode())
    assert status == 200 and b"proxy_error" not in raw, raw[-300:]
    assert metric_value(scrape(proxy.url), "modelcanary_failures_total", cause="proxy_error") == before


def test_messages_list_of_100k_items(stack):
    proxy, _ = stack
    body = json.dumps({"model": ROUTE, "messages": [{"role": "user", "content": f"m{i}"} for i in range(100_000)]})
    status, raw, elapsed = request(proxy, "POST", "/v1/chat/completions", body.encode())
    assert status in (200, 400), raw[:300]
    if status == 400:
        assert openai_error(raw)["code"] == "context_length_exceeded"
    assert elapsed < 10, elapsed
    # and a normal request right after is as quick as ever
    status, _, elapsed = request(proxy, "POST", "/v1/chat/completions", chat({"model": ROUTE, "messages": MSG}))
    assert status == 200 and elapsed < 1


def test_unknown_routes_methods_and_malformed_http(stack):
    proxy, _ = stack
    for method, path, body, want in (("GET", "/nope", None, 404), ("POST", "/admin/nothing", b"{}", 404),
                                     ("GET", "/v1/chat/completions?model=support-bot", None, 405),
                                     ("DELETE", "/healthz", None, 405),
                                     ("POST", "/v1/feedback", b'{"success": "yes"}', 400),
                                     ("POST", "/v1/feedback", b'{"success": true, "request_id": "x"}', 404),
                                     ("POST", "/v1/feedback", b"\xff", 400)):
        status, raw, _ = request(proxy, method, path, body)
        assert status == want, (method, path, raw[:200])
        openai_error(raw)
    # bytes that are not HTTP at all get an OpenAI-shaped 400 too
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage-tls-hello\r\n\r\n")
    data = s.recv(65536)
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), data[:200]
    openai_error(body)


def test_a_405_says_which_methods_are_allowed_and_health_answers_head(stack):
    proxy, _ = stack
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        conn.request("DELETE", "/healthz")
        response = conn.getresponse()
        openai_error(response.read())
        assert response.status == 405 and "GET" in response.headers["allow"]
        for path in ("/healthz", "/readyz"):  # HEAD, as some load balancers probe
            conn.request("HEAD", path)
            response = conn.getresponse()
            assert response.status == 200 and response.read() == b""
    finally:
        conn.close()


def test_proxy_is_healthy_after_all_of_it(stack):
    """Run alone too: the bad input goes in again here, then a good request is served and counted."""
    proxy, _ = stack
    for raw, *_ in REFUSED:
        assert request(proxy, "POST", "/v1/chat/completions", raw)[0] < 500
    for body in WRONG_TYPES:
        assert request(proxy, "POST", "/v1/chat/completions", chat(body))[0] < 500
    served = metric_value(scrape(proxy.url), "modelcanary_requests_total", route=ROUTE, outcome="completed")
    status, raw, _ = request(proxy, "POST", "/v1/chat/completions", chat({"model": ROUTE, "messages": MSG}))
    assert status == 200, raw[:300]
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_requests_total", route=ROUTE, outcome="completed") == served + 1
    assert metric_value(text, "modelcanary_failures_total", cause="proxy_error") == 0


def test_recent_traffic_keeps_an_answer_that_holds_a_lone_surrogate():
    """An upstream's answer may escape a lone surrogate (its JSON is valid): the memory capture reads
    from keeps it, as that escape, and keeps recording what comes after."""
    from service.admin.traffic import RecentTraffic
    from service.records import OutcomeEvent, PrimaryResult, TrafficEvent

    recent = RecentTraffic()
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "odd \ud800 text"}}]}
    for i in range(2):
        recent.add(TrafficEvent(request_id=f"r{i}", ts=float(i), route=ROUTE, segment="chat",
                                request={"model": ROUTE, "messages": MSG}, config_version="v",
                                primary=PrimaryResult(model="m", status=200, body=answer, latency_s=0.1,
                                                      outcome="completed")))
    recent.add(OutcomeEvent(request_id="r0", ts=2.0, kind="feedback", success=False, reason="odd \ud800"))
    lines = recent.lines()
    assert len(lines) == 3
    assert json.loads(lines[0])["primary"]["body"] == answer and b"\\ud800" in lines[0]
