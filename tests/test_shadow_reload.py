"""A reload in memory mode replaces the shadow child (collectors.embedded): traffic already sent to the
old child is still evaluated (the old child finishes it before it exits), and a reload that changes
nothing keeps the child."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import yaml

from collectors.embedded.channel import Channel
from collectors.embedded.child import STOP, TRAFFIC, ChannelBus, encode
from service.records import PrimaryResult, TrafficEvent
from tests.fixtures.servers import SIM_MODEL, metric_value, proxy_config, scrape, sim_config

pytestmark = pytest.mark.timeout(180)

ROUTE = "support-bot"
TOKEN = "shadow-reload-token"
CHILD_STARTED = "shadow workers run in a child process"
BURST = 30


def reload(proxy) -> None:
    req = urllib.request.Request(proxy.url + "/admin/reload", method="POST", data=b"",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def counts(proxy) -> tuple[float, float, float]:
    """(sampled, evaluated, dropped) for the route so far."""
    text = scrape(proxy.url)
    return (metric_value(text, "modelcanary_events_published_total", topic="traffic"),
            metric_value(text, "modelcanary_shadow_requests_total", route=ROUTE, model="candidate-m"),
            metric_value(text, "modelcanary_shadow_dropped_total", route=ROUTE))


def wait_counts(proxy, done, timeout_s: float, what: str) -> tuple[float, float, float]:
    deadline = time.monotonic() + timeout_s
    while not done(now := counts(proxy)):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: (sampled, evaluated, dropped) = {now}")
        time.sleep(0.1)
    return now


def test_traffic_sent_to_the_old_child_is_evaluated_across_a_reload(servers):
    slow = {**SIM_MODEL, "latency_s": {"median": 3.0, "p95": 3.0}}  # shadow calls to the candidate take 3 s
    sim = servers.simulator(sim_config({"good-model": dict(SIM_MODEL), "new-model": slow}, time_scale=1.0))
    cfg = proxy_config(sim.url, shadow={"sample_rate": 1.0, "max_per_minute": 100_000, "noise_floor": False})
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)

    def ask(i: int) -> None:
        client.chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": f"reload test {i}"}])

    ask(0)
    wait_counts(proxy, lambda c: c[1] == 1, 30, "the first evaluation")

    # nothing changed: the child keeps running (the reload is applied before the next request is offered)
    reload(proxy)
    ask(1)
    wait_counts(proxy, lambda c: c[1] == 2, 30, "an evaluation after a reload that changed nothing")
    assert proxy.output().count(CHILD_STARTED) == 1

    with ThreadPoolExecutor(BURST) as pool:
        list(pool.map(ask, range(2, 2 + BURST)))
    sampled = wait_counts(proxy, lambda c: c[0] == 2 + BURST, 10, "the burst's traffic")[0]
    # right after the burst, most of it waits in the old child (one 3-second evaluation is in flight)
    cfg = yaml.safe_load(proxy.config_path.read_text())
    cfg["routes"][ROUTE]["shadow"]["max_per_minute"] = 100_001
    proxy.config_path.write_text(yaml.safe_dump(cfg))
    reload(proxy)

    _, evaluated, dropped = wait_counts(proxy, lambda c: c[1] + c[2] >= sampled, 60, "every sampled request")
    assert (evaluated, dropped) == (sampled, 0)
    assert proxy.output().count(CHILD_STARTED) == 2


def test_a_stopping_child_hands_out_what_it_was_sent_then_gives_up_the_rest_and_counts_it():
    """collectors.embedded.child.ChannelBus: after STOP the worker still gets what was sent before it,
    one record at a time, until the drain time runs out; the rest is dropped and counted."""

    def event(i: int) -> bytes:
        return encode(TrafficEvent(request_id=f"rid-{i}", ts=time.time(), route=ROUTE, segment="chat",
                                   request={"messages": []}, config_version="v",
                                   primary=PrimaryResult(model="s", status=200, latency_s=0.1, outcome="completed")))

    async def stopped(events: int, drain_s: float, takes: int) -> tuple[list[int], bool, int]:
        ours, theirs = socket.socketpair()
        stop = asyncio.Event()
        bus = ChannelBus(theirs, stop)
        parent = Channel(ours, lambda kind, payload: None, lambda: None)
        for i in range(events):
            parent.send(TRAFFIC, event(i))
        parent.send(STOP, str(drain_s).encode())
        sizes = [len(await bus.get_batch(100, 1.0)) for _ in range(takes)]
        await asyncio.wait_for(stop.wait(), 5)
        parent.close()
        return sizes, await bus.get_batch(100, 0.1) == [], bus.dropped

    # time to drain: the worker takes the three one by one, then stop is set with nothing dropped
    assert asyncio.run(stopped(3, 5.0, takes=4)) == ([1, 1, 1, 0], True, 0)
    # no time: nothing more is handed out, all three are counted
    assert asyncio.run(stopped(3, 0.0, takes=0)) == ([], True, 3)
