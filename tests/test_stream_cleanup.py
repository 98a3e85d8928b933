"""A stream's bookkeeping always ends (issue 12): a client that leaves before the first byte still
leaves the in-flight gauge at 0, gets an outcome `client_cancelled`, and does not hold up shutdown.
The same for a streamed pass-through endpoint, and for a plain answer that arrives once its client
has gone (never `completed`: nobody received it).

The first test drives the response at the ASGI level, as a server whose `send` yields (flow control,
an HTTP/2 server, middleware) would: the disconnect is seen while the status line is still being
sent, so the stream's generator never starts, and closing a generator that never started runs none
of its code. The others go through the real `modelcanary serve`."""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import time

import pytest

from service.config import ProviderConfig
from service.proxy.outcome import failed
from service.proxy.recorder import Call
from service.proxy.streaming import StreamRelay
from service.upstream.openai_compatible import OpenAICompatibleProvider
from tests.fixtures.servers import SIM_MODEL, metric_value, proxy_config, scrape, sim_config

pytestmark = pytest.mark.timeout(90)

TTFT_S = 1.5


def slow_first_byte() -> dict:
    m = copy.deepcopy(SIM_MODEL)
    m["ttft_s"] = {"median": TTFT_S, "p95": TTFT_S * 1.05}
    m["latency_s"] = {"median": TTFT_S + 0.5, "p95": TTFT_S + 0.6}
    return sim_config({"good-model": m, "new-model": copy.deepcopy(m)}, time_scale=1.0)


async def leave_before_first_byte(port: int, path: str, body: dict) -> bytes:
    """Send a streamed request and hang up before any byte of the answer has come back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(body).encode()
    writer.write(b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (path.encode(), len(raw), raw))
    await writer.drain()
    try:
        got = await asyncio.wait_for(reader.read(1), TTFT_S / 3)
    except TimeoutError:
        got = b""
    writer.transport.abort()
    return got


def wait_metrics(url: str, ok, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    text = scrape(url)
    while not ok(text) and time.monotonic() < deadline:
        time.sleep(0.05)
        text = scrape(url)
    return text


def test_a_stream_never_started_still_ends_its_call(servers):
    sim = servers.simulator(sim_config())
    finished: list[Call] = []

    async def scenario() -> tuple[list[dict], bool]:
        provider = OpenAICompatibleProvider("sim", ProviderConfig(base_url=sim.url + "/v1"))
        body = json.dumps({"model": "good-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        reply = await provider.send("/chat/completions", body.encode(), {"Content-Type": "application/json"}, True)
        call = Call(request_id="r1", route="support-bot", model_key="stable-m", role="stable", segment="chat",
                    started=time.perf_counter(), request={}, stream=True)
        relay = StreamRelay(call, reply, lambda raw, clipped: failed("bad_response"), None, finished.append,
                            lambda: False)
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.disconnect"}  # the client has already gone

        async def send(message: dict) -> None:
            sent.append(message)
            await asyncio.sleep(0)  # a server that yields while it writes

        await relay.response({"x-request-id": "r1"})({"type": "http"}, receive, send)
        released = reply._release is None  # the upstream connection was handed back (closed mid-answer)
        await provider.close()
        return sent, released

    sent, released = asyncio.run(scenario())
    assert [m["type"] for m in sent] == ["http.response.start"]  # not a byte of the answer went out
    assert len(finished) == 1 and finished[0].verdict == failed("client_cancelled")
    assert released


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "support-bot", "stream": True,
                              "messages": [{"role": "user", "content": "tell me a story"}]}),
    ("/v1/completions", {"model": "support-bot", "stream": True, "prompt": "tell me a story"}),
    # not streamed: the answer comes whole, to a client that has left, so it never reaches anyone
    ("/v1/chat/completions", {"model": "support-bot", "messages": [{"role": "user", "content": "tell me a story"}]}),
], ids=["chat", "passthrough", "plain"])
def test_client_leaving_before_the_answer_is_recorded_and_released(servers, path, body):
    sim = servers.simulator(slow_first_byte())
    cfg = proxy_config(sim.url)
    cfg["server"] = {"drain_seconds": 30}
    proxy = servers.proxy(cfg)

    got = asyncio.run(leave_before_first_byte(proxy.port, path, body))
    assert got == b"", "the client was meant to leave before the first byte"

    def settled(text: str) -> bool:
        return metric_value(text, "modelcanary_failures_total", cause="client_cancelled", blame="client") == 1

    text = wait_metrics(proxy.url, settled, timeout_s=TTFT_S + 10)
    assert metric_value(text, "modelcanary_failures_total", cause="client_cancelled", blame="client") == 1
    assert metric_value(text, "modelcanary_requests_total", outcome="failed") == 1
    assert metric_value(text, "modelcanary_requests_total", outcome="completed") == 0
    assert metric_value(text, "modelcanary_in_flight_requests", route="support-bot") == 0

    # nothing is left in flight, so shutdown does not wait for drain_seconds
    t0 = time.monotonic()
    proxy.signal(signal.SIGTERM)
    proxy.proc.wait(20)
    assert time.monotonic() - t0 < 10
    assert "Traceback" not in proxy.output()
