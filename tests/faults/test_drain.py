"""SIGTERM during open streams (DESIGN §5, server.drain_seconds): /readyz turns 503 at once, new
requests are refused with an OpenAI-shaped 503, every open stream finishes, then the process exits."""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import time
import urllib.error
import urllib.request
import uuid

import aiohttp
import pytest

from service.bus.kafka import read_topic
from tests.fixtures.servers import SIM_MODEL, proxy_config

pytestmark = pytest.mark.timeout(120)

STREAMS = 50


def slow_sim(latency_s: float) -> dict:
    m = copy.deepcopy(SIM_MODEL)
    m["latency_s"] = {"median": latency_s, "p95": latency_s * 1.1}
    m["ttft_s"] = {"median": 0.05, "p95": 0.08}
    m["output_tokens"] = {"median": 40, "p95": 60}
    return {"seed": 3, "time_scale": 1.0, "models": {"good-model": m, "new-model": copy.deepcopy(m)}}


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def open_streams(url: str, n: int, started: asyncio.Event,
                       ended: list[float] | None = None) -> tuple[list[bytes], int]:
    """n concurrent streams; `started` is set once each has its first chunk. Returns bodies and how many
    were 200; `ended` gets each stream's end time (monotonic)."""
    first = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(i: int) -> tuple[bytes, int]:
            nonlocal first
            body = {"model": "support-bot", "stream": True, "messages": [{"role": "user", "content": f"story {i}"}]}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                data = await r.content.readany()
                first += 1
                if first == n:
                    started.set()
                try:
                    data += await r.content.read()
                except aiohttp.ClientError:
                    pass  # cut by the server
                if ended is not None:
                    ended.append(time.monotonic())
                return data, r.status
        results = await asyncio.gather(*(one(i) for i in range(n)))
    return [b for b, _ in results], sum(1 for _, st in results if st == 200)


def test_sigterm_drains_50_open_streams(servers):
    sim = servers.simulator(slow_sim(3.0))
    cfg = proxy_config(sim.url)
    cfg["server"] = {"drain_seconds": 20}
    proxy = servers.proxy(cfg)
    observed: dict = {}

    async def scenario() -> tuple[list[bytes], int]:
        started = asyncio.Event()
        task = asyncio.create_task(open_streams(proxy.url, STREAMS, started))
        await asyncio.wait_for(started.wait(), 20)
        t_term = time.monotonic()
        proxy.signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        # /readyz turns 503 at once, so a load balancer stops sending
        while True:
            status, body = await loop.run_in_executor(None, get, proxy.url + "/readyz")
            if status == 503 or time.monotonic() - t_term > 2:
                break
            await asyncio.sleep(0.02)
        observed["readyz"] = (status, body, time.monotonic() - t_term)
        # a new request while draining is refused, OpenAI-shaped
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy.url + "/v1/chat/completions", json={
                    "model": "support-bot", "messages": [{"role": "user", "content": "late"}]}) as r:
                observed["late"] = (r.status, await r.json())
        observed["alive_while_draining"] = proxy.proc.poll() is None
        return await task

    bodies, ok = asyncio.run(scenario())
    status, body, after = observed["readyz"]
    assert status == 503 and body["status"] == "draining" and after < 0.5, observed["readyz"]
    late_status, late_body = observed["late"]
    assert late_status == 503 and late_body["error"]["code"] == "draining", observed["late"]
    assert observed["alive_while_draining"]
    assert ok == STREAMS
    for raw in bodies:  # every stream ran to its end: content, then [DONE], no error event
        text = raw.decode()
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]
        assert '"error"' not in text
    assert proxy.proc.wait(15) == 0  # and the process exits on its own once they are done


def test_drain_is_bounded_by_drain_seconds(servers, kafka_broker):
    """Streams still open when drain_seconds runs out are cut, each told so by an error event
    (`draining`) and recorded as the proxy's `draining`, not as a `proxy_error` (a bug, alerted on)."""
    sim = servers.simulator(slow_sim(8.0))
    cfg = proxy_config(sim.url)
    cfg["server"] = {"drain_seconds": 1}
    cfg["providers"]["sim"]["timeout_s"] = 30
    prefix = "drain" + uuid.uuid4().hex[:8]
    cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": kafka_broker.bootstrap,
                                                   "topic_prefix": prefix, "partitions": 1}}
    proxy = servers.proxy(cfg)
    ended: list[float] = []

    async def scenario() -> tuple[float, list[bytes]]:
        started = asyncio.Event()
        task = asyncio.create_task(open_streams(proxy.url, 5, started, ended))
        await asyncio.wait_for(started.wait(), 20)
        t0 = time.monotonic()
        proxy.signal(signal.SIGTERM)
        bodies, _ = await asyncio.wait_for(task, 20)
        return t0, bodies

    t0, bodies = asyncio.run(scenario())
    assert len(ended) == 5
    assert all(not b.decode().rstrip().endswith("[DONE]") for b in bodies)  # 8 s streams were cut ...
    assert max(ended) - t0 < 1 + 0.8, [e - t0 for e in ended]       # ... once drain_seconds (1 s) ran out
    for raw in bodies:
        assert raw.decode().rstrip().endswith('"code": "draining", "param": null}}'), raw[-300:]
    assert proxy.proc.wait(10) == 0
    assert "Exception in ASGI application" not in proxy.output()
    outcomes = [r for r in read_topic(kafka_broker.bootstrap, f"{prefix}.outcomes", timeout_s=15)
                if r.get("kind") == "request"]
    assert [(r["outcome"], r["cause"], r["blame"]) for r in outcomes] == [("failed", "draining", "proxy")] * 5
