"""Upstream faults on the real stack: simulator ─ fault proxy ─ `modelcanary serve` ─ clients.

Each test asserts what the client sees (status, OpenAI-shaped error body or SSE error event, latency
bound) and what the metrics record (cause and blame, DESIGN §6). Upstream calls are counted at the
fault proxy, not from the proxy's own numbers."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import socket
import threading
import time

import aiohttp
import openai
import pytest

from service.proxy.server import HEAD_TIMEOUT_S, MAX_HEAD_BYTES
from service.upstream.retry import RetryBudget
from tests.faults.fault_proxy import FaultProxy
from tests.fixtures.servers import SIM_MODEL, metric_value, scrape, start_proxy, start_simulator

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 2.0
ROUTE = "support-bot"


def sim_model(**overrides) -> dict:
    m = copy.deepcopy(SIM_MODEL)
    m["latency_s"] = {"median": 0.005, "p95": 0.01}
    m["ttft_s"] = {"median": 0.002, "p95": 0.004}
    m["output_tokens"] = {"median": 60, "p95": 80}
    m.update(overrides)
    return m


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One simulator, a fault proxy in front of it, one modelcanary proxy with a direct and a faulty provider."""
    tmp = tmp_path_factory.mktemp("upstream-faults")
    sim = start_simulator(tmp, {"seed": 11, "time_scale": 1.0, "models": {
        "good-model": sim_model(), "new-model": sim_model(),
        "hang-model": sim_model(failures={"timeout": 1.0}),
        "storm-model": sim_model(failures={"provider_5xx": 1.0}),
        "bad-model": sim_model(failures={"bad_response": 1.0}),
        "slow-model": sim_model(latency_s={"median": 3.0, "p95": 3.2}, ttft_s={"median": 0.05, "p95": 0.06},
                                output_tokens={"median": 60, "p95": 70}),
    }})
    fault = FaultProxy("127.0.0.1", sim.port).start()
    provider = {"timeout_s": TIMEOUT_S, "connect_timeout_s": 1, "max_retries": 2}
    cfg = {
        "providers": {"sim": {"base_url": sim.url + "/v1", **provider},
                      "faulty": {"base_url": fault.url + "/v1", **provider, "max_retries": 3}},
        "models": {
            "stable-m": {"provider": "sim", "name": "good-model"},
            "candidate-m": {"provider": "sim", "name": "new-model"},
            "hang-m": {"provider": "sim", "name": "hang-model"},
            "bad-m": {"provider": "sim", "name": "bad-model"},
            "storm-m": {"provider": "faulty", "name": "storm-model"},
            "via-fault-m": {"provider": "faulty", "name": "good-model"},
            "slow-via-fault-m": {"provider": "faulty", "name": "slow-model"},
        },
        "routes": {ROUTE: {"stable": "stable-m", "candidate": "candidate-m", "shadow": {"sample_rate": 0.0}}},
    }
    proxy = start_proxy(tmp, cfg)
    try:
        yield proxy, fault
    finally:
        proxy.stop()
        fault.stop()
        sim.stop()


@pytest.fixture
def faults(stack):
    proxy, fault = stack
    fault.set_mode("pass")
    fault.reset_counts()
    yield proxy, fault
    fault.set_mode("pass")


def chat(model: str, content: str = "hello", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def post(url: str, body: dict | bytes, timeout_s: float = 30.0) -> tuple[int, bytes, float]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async with s.post(url + "/v1/chat/completions", data=data,
                          headers={"Content-Type": "application/json"}) as r:
            raw = await r.read()
            return r.status, raw, time.monotonic() - t0


def sse_events(raw: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            try:
                out.append(json.loads(payload))
            except ValueError:
                out.append(payload)  # [DONE], or garbage the upstream sent
    return out


def assert_openai_error(raw: bytes, code: str | None = None) -> dict:
    body = json.loads(raw)
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err, body
    if code is not None:
        assert err["code"] == code, body
    return err


def failures(proxy, model: str, cause: str, expect: float | None = None) -> float:
    """The provider-blamed failure count; with `expect`, wait briefly for it (metrics are recorded
    once the response is sent, so a fast client can scrape before they land)."""
    deadline = time.monotonic() + 3
    while True:
        value = metric_value(scrape(proxy.url), "modelcanary_failures_total", model=model, cause=cause,
                             blame="provider")
        if expect is None or value >= expect or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


# ---- hangs and timeouts ------------------------------------------------------------------------------


def test_upstream_hang_is_a_timeout_within_bound(faults):
    proxy, fault = faults
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=30)
    for stream in (False, True):
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            r = client.chat.completions.create(model="hang-m", messages=[{"role": "user", "content": "hi"}],
                                               stream=stream)
            list(r) if stream else None
        elapsed = time.monotonic() - t0
        assert e.value.status_code == 504 and e.value.code == "timeout", e.value
        assert TIMEOUT_S - 0.2 <= elapsed <= TIMEOUT_S + 1.0, elapsed

    # a blackholed upstream (TCP accepted, never a byte back) is the same fault one layer down
    fault.set_mode("blackhole")
    status, raw, elapsed = asyncio.run(post(proxy.url, chat("via-fault-m")))
    assert status == 504 and elapsed <= TIMEOUT_S + 1.0, (status, raw, elapsed)
    assert_openai_error(raw, "timeout")
    assert fault.requests == 0  # the request never reached the simulator, and it was not retried
    assert failures(proxy, "hang-m", "timeout", 2) == 2
    assert failures(proxy, "via-fault-m", "timeout", 1) == 1


def test_stream_that_stalls_mid_way_ends_with_an_error_event(faults):
    proxy, fault = faults

    async def run() -> tuple[bytes, float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.post(proxy.url + "/v1/chat/completions",
                              json=chat("slow-via-fault-m", "tell me a long story", stream=True)) as r:
                assert r.status == 200
                first = await r.content.readany()  # the stream is under way ...
                fault.set_mode("blackhole")        # ... then the upstream goes silent
                stalled = time.monotonic()
                rest = await r.content.read()
                return first + rest, time.monotonic() - stalled

    raw, after_stall = asyncio.run(run())
    events = sse_events(raw)
    assert isinstance(events[0], dict) and "choices" in events[0]
    assert isinstance(events[-1], dict) and events[-1]["error"]["code"] == "timeout", events[-1]
    assert after_stall <= TIMEOUT_S + 1.0
    assert failures(proxy, "slow-via-fault-m", "timeout", 1) == 1


def test_slow_upstream_under_the_timeout_completes(faults):
    proxy, fault = faults
    fault.set_mode("delay", delay_s=0.3)
    status, raw, elapsed = asyncio.run(post(proxy.url, chat("via-fault-m")))
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"]
    assert 0.6 <= elapsed < TIMEOUT_S  # delayed both ways, still inside timeout_s


# ---- connection faults -------------------------------------------------------------------------------


def test_connection_reset_mid_stream_is_an_sse_error_event(faults):
    proxy, fault = faults
    before = failures(proxy, "via-fault-m", "connection_error")
    fault.set_mode("reset", after_bytes=700)  # response head and a few chunks, then a TCP RST
    status, raw, _ = asyncio.run(post(proxy.url, chat("via-fault-m", "a long story please", stream=True)))
    assert status == 200
    events = sse_events(raw)
    assert any(isinstance(e, dict) and "choices" in e for e in events)  # it was mid-stream
    assert "[DONE]" not in events
    last = events[-1]
    assert isinstance(last, dict) and last["error"]["code"] == "connection_error", last
    assert last["error"]["message"]
    assert fault.requests == 1  # a stream is never retried after its first byte
    assert failures(proxy, "via-fault-m", "connection_error", before + 1) == before + 1

    # the openai SDK raises its usual APIError on that event
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=30)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model="via-fault-m", stream=True,
                                                messages=[{"role": "user", "content": "again a story"}]):
            pass


def test_connection_refused_reset_and_dropped_are_connection_errors(faults):
    proxy, fault = faults
    for mode in ("reset", "drop"):
        fault.reset_counts()
        fault.set_mode(mode)
        before = failures(proxy, "via-fault-m", "connection_error")
        status, raw, _ = asyncio.run(post(proxy.url, chat("via-fault-m")))
        assert status == 502, (mode, raw)
        assert_openai_error(raw, "connection_error")
        assert 2 <= fault.connections <= 4, (mode, fault.connections)  # retried, at most max_retries (3) times
        assert failures(proxy, "via-fault-m", "connection_error", before + 1) == before + 1
    fault.set_mode("pass")
    status, _, _ = asyncio.run(post(proxy.url, chat("via-fault-m")))
    assert status == 200  # and it recovers at once


# ---- a 5xx storm and the retry budget ------------------------------------------------------------------


def test_5xx_storm_retry_budget_holds(faults):
    proxy, fault = faults
    n = 1000

    async def storm() -> tuple[dict[int, int], float]:
        statuses: dict[int, int] = {}
        sem = asyncio.Semaphore(32)
        conn = aiohttp.TCPConnector(limit=64)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def one(i: int) -> None:
                async with sem, s.post(proxy.url + "/v1/chat/completions", json=chat("storm-m", f"q{i}")) as r:
                    body = await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1
                    if r.status >= 500:
                        assert_openai_error(body)
            t0 = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(n)))
            return statuses, time.monotonic() - t0

    statuses, elapsed = asyncio.run(storm())
    assert sum(statuses.values()) == n
    assert set(statuses) <= {500, 503}, statuses  # the upstream's own 5xx, passed on as they came
    budget = RetryBudget()
    windows = math.ceil(elapsed / budget.window_s) + 1  # the reserve is per sliding window
    upstream = fault.requests
    assert n <= upstream <= (1 + budget.ratio) * n + budget.reserve * windows, (upstream, elapsed)
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_upstream_retries_total", model="storm-m") == upstream - n
    assert metric_value(text, "modelcanary_failures_total", model="storm-m", cause="provider_5xx") == n


# ---- malformed and truncated answers -------------------------------------------------------------------

def http_reply(status: str, content_type: str, body: bytes, length: int | None = None) -> bytes:
    return (b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status.encode(), content_type.encode(), len(body) if length is None else length, body))


HTML_200 = http_reply("200 OK", "text/html", b"<html>gateway says hi</html>")
ARRAY_200 = http_reply("200 OK", "application/json", b"[1, 2]")
NO_CHOICES_200 = http_reply("200 OK", "application/json", b'{"choices": []}')
ERROR_200 = http_reply("200 OK", "application/json",  # an error object in a 200: its code says what failed
                       b'{"error": {"message": "Rate limit reached for requests", "type": "requests", '
                       b'"code": "rate_limit_exceeded"}}')
HTML_500 = http_reply("500 Internal Server Error", "text/html", b"<h1>upstream 500</h1>")
SHORT_BODY = http_reply("200 OK", "application/json", b'{"id": "chatcmpl-1", "choices": [', length=5000)
GARBAGE = b"SSH-2.0-OpenSSH_9.6\r\n\r\n"
SSE_NO_END = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
              b"data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,"
              b"\"delta\":{\"role\":\"assistant\",\"content\":\"Hel\"},\"finish_reason\":null}]}\n\n")
SSE_GARBAGE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
               b"data: {not json at all\n\ndata: [DONE]\n\n")
SSE_DONE_UNFINISHED = SSE_NO_END + b"data: [DONE]\n\n"  # llama.cpp's server when it interrupts a stream


@pytest.mark.parametrize(("reply", "stream", "status", "cause"), [
    (HTML_200, False, 502, "bad_response"),
    (ARRAY_200, False, 502, "bad_response"),
    (NO_CHOICES_200, False, 502, "bad_response"),
    (ERROR_200, False, 502, "rate_limited"),
    (HTML_500, False, 500, "provider_5xx"),
    (SHORT_BODY, False, 502, "connection_error"),   # the body ends before its content-length: a transport fault
    (GARBAGE, False, 502, "connection_error"),      # not HTTP at all
    (SSE_NO_END, True, 200, "bad_response"),        # stream ends cleanly without finish_reason or [DONE]
    (SSE_GARBAGE, True, 200, "bad_response"),
    (SSE_DONE_UNFINISHED, True, 200, "bad_response"),
], ids=["html-200", "array-200", "no-choices", "error-200", "html-500", "short-body", "not-http", "sse-no-end", "sse-garbage",
        "sse-done-unfinished"])
def test_malformed_upstream_answers_are_attributed_never_a_proxy_500(faults, reply, stream, status, cause):
    proxy, fault = faults
    fault.set_mode("reply", reply=reply)
    before = failures(proxy, "via-fault-m", cause)
    tokens = metric_value(scrape(proxy.url), "modelcanary_tokens_total", model="via-fault-m")
    got, raw, _ = asyncio.run(post(proxy.url, chat("via-fault-m", stream=stream)))
    assert got == status, raw
    if stream:  # the client is told, before any [DONE] (where SDKs stop reading): never silently
        events = sse_events(raw)
        told = [e for e in events if isinstance(e, dict) and "error" in e]
        assert told and told[0]["error"]["code"] == cause, raw
        assert "[DONE]" not in events[:events.index(told[0])], raw
    else:
        err = assert_openai_error(raw)
        assert err["code"] != "proxy_error"
        if reply is ERROR_200:  # the upstream's words reach the client; a refused call bills nothing
            assert err["code"] == cause and "Rate limit reached" in err["message"], err
            assert metric_value(scrape(proxy.url), "modelcanary_tokens_total", model="via-fault-m") == tokens
    assert failures(proxy, "via-fault-m", cause, before + 1) == before + 1
    assert metric_value(scrape(proxy.url), "modelcanary_failures_total", cause="proxy_error") == 0


def json_reply(status: str, body: dict, headers: bytes = b"") -> bytes:
    data = json.dumps(body).encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n%s"
            % (status.encode(), len(data), headers, data))


def sse_reply(*events: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + b"".join(events)


def completion(message: dict, finish: str = "stop", usage: dict | None = None) -> dict:
    return {"id": "chatcmpl-9", "object": "chat.completion", "model": "good-model",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
            "usage": usage or {"prompt_tokens": 3, "completion_tokens": 2}}


def requests_recorded(proxy, outcome: str | None = None) -> float:
    labels = {"outcome": outcome} if outcome else {}
    return metric_value(scrape(proxy.url), "modelcanary_requests_total", model="via-fault-m", **labels)


def wait_recorded(proxy, n: float, outcome: str | None = None) -> float:
    deadline = time.monotonic() + 3
    while (got := requests_recorded(proxy, outcome)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def in_flight(proxy) -> float:
    return metric_value(scrape(proxy.url), "modelcanary_in_flight_requests", route="via-fault-m")


TOOL_ARGS_OBJECT = completion({"content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    finish="tool_calls")
CONTENT_PARTS = completion({"content": [{"type": "text", "text": '{"city": "Paris"}'}]})
USAGE_NOT_INT = completion({"content": "hi"}, usage={"prompt_tokens": 3, "completion_tokens": "7"})


@pytest.mark.parametrize(("answer", "extra", "outcome", "cause"), [
    (TOOL_ARGS_OBJECT, {}, "failed", "invalid_tool_call"),  # arguments must be a string of JSON
    (CONTENT_PARTS, {"response_format": {"type": "json_object"}}, "completed", None),
    (USAGE_NOT_INT, {}, "completed", None),
], ids=["tool-arguments-object", "content-parts-json", "usage-not-int"])
def test_answers_of_unexpected_shape_are_passed_on_and_recorded(faults, answer, extra, outcome, cause):
    """A 200 whose fields have types the proxy did not expect reaches the client as it came, and the
    call is recorded like any other (before: a 500, or nothing recorded and the in-flight gauge left up)."""
    proxy, fault = faults
    fault.set_mode("reply", reply=json_reply("200 OK", answer))
    before = requests_recorded(proxy, outcome)
    status, raw, _ = asyncio.run(post(proxy.url, chat("via-fault-m", **extra)))
    assert status == 200 and json.loads(raw) == answer, raw
    assert wait_recorded(proxy, before + 1, outcome) == before + 1
    if cause is not None:
        assert metric_value(scrape(proxy.url), "modelcanary_failures_total", model="via-fault-m", cause=cause,
                            blame="model") >= 1
    assert in_flight(proxy) == 0
    assert metric_value(scrape(proxy.url), "modelcanary_failures_total", cause="proxy_error") == 0


def test_upstream_rate_limit_headers_reach_the_client_and_no_tokens_are_charged(faults):
    """The openai SDK decides its retries from `x-should-retry`: passed on, a quota error is tried once
    through the proxy as it is directly. A refused call bills no tokens."""
    proxy, fault = faults
    headers = (b"x-should-retry: false\r\nretry-after-ms: 1500\r\nx-ratelimit-remaining-requests: 0\r\n"
               b"x-request-id: req_upstream_1\r\nset-cookie: __cf_bm=abc\r\n")
    fault.set_mode("reply", reply=json_reply("429 Too Many Requests", {"error": {
        "message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota"}},
        headers))
    text = scrape(proxy.url)
    tokens = metric_value(text, "modelcanary_tokens_total", model="via-fault-m")
    cost = metric_value(text, "modelcanary_cost_usd_total", model="via-fault-m")
    before = requests_recorded(proxy)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=2, timeout=30)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="via-fault-m", messages=[{"role": "user", "content": "hi"}])
    got = e.value.response.headers
    assert got["x-should-retry"] == "false" and got["retry-after-ms"] == "1500"
    assert got["x-ratelimit-remaining-requests"] == "0" and got["x-upstream-request-id"] == "req_upstream_1"
    assert got["x-request-id"] != "req_upstream_1" and "set-cookie" not in got
    assert wait_recorded(proxy, before + 1) == before + 1
    time.sleep(0.3)  # a retry by the SDK would have been recorded by now
    assert requests_recorded(proxy) == before + 1
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_tokens_total", model="via-fault-m") == tokens
    assert metric_value(text, "modelcanary_cost_usd_total", model="via-fault-m") == cost


CHUNK = (b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
         b'"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}\n\n')
RATE_LIMIT_EVENT = b'data: {"error":{"message":"Rate limit reached","code":"rate_limit_exceeded"}}\n\n'
TWO_LINE_EVENT = (b'data: {"id":"c1","object":"chat.completion.chunk",\n'
                  b'data: "choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}\n\n')


def test_stream_error_event_keeps_its_cause_and_is_not_doubled(faults):
    proxy, fault = faults
    fault.set_mode("reply", reply=sse_reply(CHUNK, RATE_LIMIT_EVENT))
    before = failures(proxy, "via-fault-m", "rate_limited")
    status, raw, _ = asyncio.run(post(proxy.url, chat("via-fault-m", stream=True)))
    assert status == 200
    errors = [e for e in sse_events(raw) if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "rate_limit_exceeded", raw
    assert failures(proxy, "via-fault-m", "rate_limited", before + 1) == before + 1


def test_stream_event_over_several_data_lines_is_one_event(faults):
    """SSE joins an event's data lines with newlines, as the SDKs do."""
    proxy, fault = faults
    fault.set_mode("reply", reply=sse_reply(CHUNK, TWO_LINE_EVENT, b"data: [DONE]\n\n"))
    before = requests_recorded(proxy, "completed")
    malformed = failures(proxy, "via-fault-m", "bad_response")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=30)
    chunks = list(client.chat.completions.create(model="via-fault-m", stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello"
    assert wait_recorded(proxy, before + 1, "completed") == before + 1
    assert failures(proxy, "via-fault-m", "bad_response") == malformed


def test_simulator_bad_response_plain_and_stream(faults):
    proxy, _ = faults
    status, raw, _ = asyncio.run(post(proxy.url, chat("bad-m")))
    assert status == 502
    assert_openai_error(raw, "bad_response")
    assert failures(proxy, "bad-m", "bad_response", 1) == 1
    # a stream cut mid-way (a partial chunk, then the connection drops): an SSE error event, blamed on the provider
    status, raw, _ = asyncio.run(post(proxy.url, chat("bad-m", stream=True)))
    assert status == 200
    events = sse_events(raw)
    assert all(isinstance(e, dict) for e in events), events  # the cut-off chunk is not forwarded
    assert events[-1]["error"]["code"] == "connection_error", raw[-300:]  # the simulator drops the connection
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_failures_total", model="bad-m", blame="provider") == 2
    assert metric_value(text, "modelcanary_failures_total", cause="proxy_error") == 0


# ---- hostile clients -----------------------------------------------------------------------------------


def _loris(port: int, stop: threading.Event, closed: list[float], t0: float) -> None:
    """Open a request and send one header line every 0.5 s, never finishing the head."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(0.5)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        i = 0
        while not stop.is_set():
            try:
                s.sendall(b"X-Slow-%d: a\r\n" % i)
                i += 1
                if s.recv(4096) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
            # got bytes: the server answered (408) and will close
            while True:
                try:
                    if s.recv(4096) == b"":
                        break
                except (TimeoutError, OSError):
                    break
            break
        else:
            return
        closed.append(time.monotonic() - t0)
    finally:
        s.close()


def test_slow_loris_and_huge_headers_do_not_starve_other_clients(faults):
    proxy, _ = faults
    stop = threading.Event()
    closed: list[float] = []
    t0 = time.monotonic()
    lorises = [threading.Thread(target=_loris, args=(proxy.port, stop, closed, t0), daemon=True) for _ in range(50)]
    for t in lorises:
        t.start()

    def huge(size: int) -> tuple[int, bytes]:
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
        except OSError:
            pass  # the server may close before the whole head is sent
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
        s.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]) if head else 0, body

    def hammer_huge(stop_at: float, results: list[int]) -> None:
        while time.monotonic() < stop_at:
            results.append(huge(4 * 1024 * 1024)[0])

    time.sleep(1.0)  # all 50 slow-loris connections open and trickling
    huge_results: list[int] = []
    hammers = [threading.Thread(target=hammer_huge, args=(time.monotonic() + 3, huge_results)) for _ in range(2)]
    for t in hammers:
        t.start()
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=10)
    latencies = []
    for i in range(20):
        s = time.monotonic()
        client.chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": f"normal {i}"}])
        latencies.append(time.monotonic() - s)
    for t in hammers:
        t.join(10)
    latencies.sort()
    assert latencies[-1] < 1.0 and latencies[len(latencies) // 2] < 0.25, latencies
    assert huge_results and set(huge_results) == {431}, huge_results

    # a head just under the limit is served; over it, refused with an OpenAI-shaped 431
    status, _ = huge(MAX_HEAD_BYTES - 1024)
    assert status == 200
    status, body = huge(MAX_HEAD_BYTES + 1)
    assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"

    # the server reclaims the slow-loris connections after HEAD_TIMEOUT_S
    deadline = t0 + HEAD_TIMEOUT_S + 5
    while len(closed) < 50 and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    for t in lorises:
        t.join(5)
    assert len(closed) == 50, f"{len(closed)} of 50 slow-loris connections were closed by the server"
    assert min(closed) >= HEAD_TIMEOUT_S - 0.5
