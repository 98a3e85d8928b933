"""The controller on the memory bus: rollback with the segment's reason, a full promotion, no traffic
holds, restart keeps phase and step, report on the state, webhook on phase change."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from service.bus.memory import MemoryBus
from service.config import parse_config
from service.records import OutcomeEvent
from service.rollout.book import RolloutBook
from service.rollout.controller import Controller
from service.rollout.notify import Notifier, safe_url, webhook_payload
from tests.judge_traffic import BAD_TOOLS, make_config, traffic

pytestmark = pytest.mark.anyio

STABLE = {"chat": 0.97, "json": 0.97, "tools": 0.97}
BETTER = {"chat": 0.995, "json": 0.995, "tools": 0.995}
WIDE_MARGINS = {"completion_rate": 0.03, "model_failure_rate": 0.03, "latency_p95_exceedance": 0.1,
                "agreement_gap": 0.1}


def publish(bus: MemoryBus, records: list) -> None:
    for r in records:
        bus.publish("outcomes" if isinstance(r, OutcomeEvent) else "evaluations", r)


async def drive(bus, book, p_cand, until, *, per_round=400, shadow_rate=0.3, timeout=20.0, seed=0,
                latency_scale=1.0):
    """Publish traffic the way the proxy would, following the book's current split."""
    rng = random.Random(seed)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = book.get("bot")
        if until(state):
            return state
        split = book.routing["bot"]
        weight = split.weight if split.canary else 0.0
        publish(bus, traffic(per_round, weight, STABLE, p_cand, shadow_rate=shadow_rate, rng=rng,
                             latency_scale=latency_scale))
        await asyncio.sleep(0.02)
    return book.get("bot")


async def start(controller):
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    await asyncio.sleep(0)
    return stop, task


async def test_bad_tools_segment_is_rolled_back_with_its_reason():
    cfg = make_config(rollout={"min_shadow_samples": 100, "min_samples_per_step": 100})
    bus, book = MemoryBus(), RolloutBook(cfg)
    controller = Controller(cfg, bus, book, report_interval_s=0.2)
    stop, task = await start(controller)
    try:
        final = await drive(bus, book, BAD_TOOLS, lambda s: s.phase in ("rolled_back", "promoted"))
    finally:
        stop.set()
        await task
    assert final.phase == "rolled_back"
    d = final.last_decision
    assert d.decision == "rollback" and d.by == "controller"
    assert any(r.startswith("segment tools:") for r in d.reasons), d.reasons
    assert all(e.verdict == "worse" for e in d.evidence)
    assert {e.segment for e in d.evidence} >= {"tools"}
    # the capability matrix travels on the state
    assert final.report is not None
    assert {"judge", "live"} <= set(final.report)
    assert any(c["segment"] == "tools" and c["verdict"] == "worse" for c in final.report["judge"]["comparisons"])
    assert final.canary_weight == 0.0 and book.routing["bot"].canary is None


async def test_good_candidate_walks_shadow_steps_and_is_promoted():
    cfg = make_config(rollout={"steps": [10, 50], "min_shadow_samples": 100, "min_samples_per_step": 150,
                               "margins": WIDE_MARGINS})
    bus, book = MemoryBus(), RolloutBook(cfg)
    seen: list[tuple[str, int]] = []
    book.on_change(lambda new, old: seen.append((new.phase, new.step_index)))
    controller = Controller(cfg, bus, book, report_interval_s=0.2)
    stop, task = await start(controller)
    try:
        final = await drive(bus, book, BETTER, lambda s: s.phase in ("rolled_back", "promoted"), per_round=600,
                            latency_scale=0.7, timeout=30)
    finally:
        stop.set()
        await task
    assert final.phase == "promoted", (final.last_decision, final.recommendation)
    assert final.last_decision.decision == "promote"
    assert "non-inferiority shown" in final.last_decision.reasons[0]
    assert ("canary", 0) in seen and ("canary", 1) in seen
    assert book.routing["bot"].stable == "candidate-m"


async def test_no_traffic_holds():
    cfg = make_config(rollout={"min_step_seconds": 0.5})
    bus, book = MemoryBus(), RolloutBook(cfg)
    controller = Controller(cfg, bus, book, report_interval_s=0.1)
    stop, task = await start(controller)
    await asyncio.sleep(0.6)
    stop.set()
    await task
    state = book.get("bot")
    assert state.phase == "shadow" and state.step_index == -1
    assert state.recommendation is not None and state.recommendation.decision == "hold"
    assert "0/100 shadow samples" in state.recommendation.reasons[0]


async def test_restart_with_persisted_state_keeps_phase_and_step(tmp_path):
    cfg = make_config(rollout={"steps": [10, 50, 75], "min_shadow_samples": 100, "min_samples_per_step": 150})
    path = tmp_path / "rollouts.json"
    bus, book = MemoryBus(), RolloutBook(cfg, persist_path=path)
    controller = Controller(cfg, bus, book, report_interval_s=0.2)
    stop, task = await start(controller)
    try:
        reached = await drive(bus, book, BETTER, lambda s: s.phase == "canary" and s.step_index >= 1,
                              per_round=600, latency_scale=0.7)
    finally:
        stop.set()
        await task
    assert reached.phase == "canary" and reached.step_index >= 1
    assert book.flush(10)  # what a process exit waits for
    # a new process: same file, new bus, new controller, no traffic yet
    bus2, book2 = MemoryBus(), RolloutBook(cfg, persist_path=path)
    resumed = book2.get("bot")
    assert (resumed.phase, resumed.step_index, resumed.canary_weight) == \
        (reached.phase, reached.step_index, reached.canary_weight)
    controller2 = Controller(cfg, bus2, book2, report_interval_s=0.1)
    stop2, task2 = await start(controller2)
    await asyncio.sleep(0.3)
    stop2.set()
    await task2
    after = book2.get("bot")
    assert (after.phase, after.step_index) == (reached.phase, reached.step_index)
    assert after.recommendation.decision == "hold"


async def test_advisory_mode_recommends_only():
    cfg = make_config(rollout={"mode": "advisory"})
    bus, book = MemoryBus(), RolloutBook(cfg)
    controller = Controller(cfg, bus, book, report_interval_s=0.2)
    stop, task = await start(controller)
    try:
        final = await drive(bus, book, BAD_TOOLS,
                            lambda s: s.recommendation is not None and s.recommendation.decision == "rollback")
    finally:
        stop.set()
        await task
    assert final.phase == "shadow"
    assert final.recommendation.decision == "rollback"
    assert any("tools" in r for r in final.recommendation.reasons)


@asynccontextmanager
async def webhook_receiver() -> AsyncIterator[tuple[str, list[dict], asyncio.Event]]:
    """An HTTP server on a free port that takes webhook POSTs: (its URL, the bodies, set at the first)."""
    received: list[dict] = []
    got = asyncio.Event()

    async def hook(request: web.Request) -> web.Response:
        received.append(await request.json())
        got.set()
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/hook", received, got
    finally:
        await runner.cleanup()


async def webhook_after_rollback(url: str, got: asyncio.Event) -> None:
    """A controller notifying `url` sees an operator roll route bot back; returns once `got` is set."""
    cfg = make_config(notify={"webhook_url": url})
    bus, book = MemoryBus(), RolloutBook(cfg)
    controller = Controller(cfg, bus, book)
    assert controller.notifier.url == url
    stop, task = await start(controller)
    book.operate("bot", "rollback", by="operator", reason="drill")
    await asyncio.wait_for(got.wait(), 10)
    stop.set()
    await task


async def test_webhook_gets_a_post_on_phase_change():
    async with webhook_receiver() as (url, received, got):
        await webhook_after_rollback(url, got)
    body = received[0]
    assert body["route"] == "bot" and body["from"] == "shadow" and body["to"] == "rolled_back"
    assert body["reasons"] == ["drill"] and "rolled_back" in body["text"]
    assert "report" not in body["state"]


async def test_webhook_failure_is_logged_not_raised(caplog):
    cfg = make_config(notify={"webhook_url": "http://127.0.0.1:9/unreachable"})
    bus, book = MemoryBus(), RolloutBook(cfg)
    controller = Controller(cfg, bus, book)
    stop, task = await start(controller)
    state = book.operate("bot", "promote")  # shadow → first step; the POST fails in the background
    await asyncio.sleep(0.3)
    stop.set()
    await task
    assert state.phase == "canary"
    assert any("webhook" in r.message for r in caplog.records)


async def test_each_segments_phase_or_step_change_is_posted_naming_it():
    """rollout.scope segment: each segment steps on its own, so each of its changes is a POST naming it;
    the route's phase (their summary) changing is one more, with no step of its own."""
    async with webhook_receiver() as (url, received, _):
        cfg = make_config(rollout={"scope": "segment"}, notify={"webhook_url": url})
        bus, book = MemoryBus(), RolloutBook(cfg)
        controller = Controller(cfg, bus, book)
        stop, task = await start(controller)
        book.operate("bot", "promote", by="operator", segment="json")  # json and the route: shadow → canary
        book.operate("bot", "promote", by="operator", segment="json")  # json: its second step
        book.operate("bot", "rollback", by="operator", segment="tools")
        await controller.notifier.drain(10)
        stop.set()
        await task
    posted = sorted((b["segment"] or "", b["from"], b["to"], b["step_index"]) for b in received)
    assert posted == [("", "shadow", "canary", -1), ("json", "canary", "canary", 1), ("json", "shadow", "canary", 0),
                      ("tools", "shadow", "rolled_back", -1)], posted
    texts = {b["text"] for b in received}
    assert "modelcanary: route bot shadow → canary: promote by operator in segment json" in texts  # no step:
    # the segments step, each on its own
    assert "modelcanary: route bot segment json canary → canary step 2 (50%): promote by operator in segment json" \
        in texts, texts


def test_webhook_payload_names_the_step():
    cfg = make_config()
    book = RolloutBook(cfg)
    old = book.get("bot")
    new = book.operate("bot", "promote")
    p = webhook_payload(new, old)
    assert p["from"] == "shadow" and p["to"] == "canary" and "step 1 (10%)" in p["text"]


def test_interval_follows_min_step_seconds_and_control_interval():
    cfg = make_config(rollout={"min_step_seconds": 20})
    c = Controller(cfg, MemoryBus(), RolloutBook(cfg))
    assert c.interval_s == pytest.approx(2.0)
    cfg2 = make_config(rollout={"min_step_seconds": 20}, control={"interval_s": 0.5})
    assert Controller(cfg2, MemoryBus(), RolloutBook(cfg2)).interval_s == pytest.approx(0.5)
    cfg3 = make_config(rollout={"min_step_seconds": 20}, control={"interval_s": 4})  # longer than the default
    assert Controller(cfg3, MemoryBus(), RolloutBook(cfg3)).interval_s == pytest.approx(4.0)


async def test_a_busy_bus_is_judged_every_interval_not_on_every_batch():
    """In memory mode the judge shares the proxy's event loop: records arriving all the time are
    taken in, but judged only every interval_s (here 2 s), not on each batch."""
    cfg = make_config(rollout={"min_step_seconds": 20})
    bus, book = MemoryBus(), RolloutBook(cfg)
    controller = Controller(cfg, bus, book)
    ticks: list[float] = []
    tick = controller.tick
    controller.tick = lambda now=None: (ticks.append(time.monotonic()), tick(now))[1]  # type: ignore[method-assign]
    stop, task = await start(controller)
    rng = random.Random(1)
    started = time.monotonic()
    while time.monotonic() - started < 3.0:  # a batch every ~50 ms
        publish(bus, traffic(20, 0.0, STABLE, STABLE, shadow_rate=0.3, rng=rng))
        await asyncio.sleep(0.02)
    stop.set()
    await task
    assert 1 <= len(ticks) <= 2, [round(t - started, 2) for t in ticks]
    assert controller.evidence["bot"].windows[-1].shadow_records > 100  # every batch was taken in


def test_a_new_rollout_of_the_same_models_is_judged_on_its_own_evidence():
    """The candidate is removed from the config, then named again: the book starts a new rollout in
    shadow, and the controller must not judge it on the previous rollout's evidence (same pair)."""
    cfg = make_config(rollout={"min_shadow_samples": 100, "min_samples_per_step": 100})
    bus, book = MemoryBus(), RolloutBook(cfg)
    controller = Controller(cfg, bus, book)
    for record in traffic(3000, 0.0, STABLE, BAD_TOOLS, shadow_rate=0.5, rng=random.Random(1)):
        controller.ingest(record)  # the first rollout's evidence: a bad candidate, not judged yet
    assert sum(w.shadow_records for w in controller.evidence["bot"].windows) > 1000
    without = parse_config({"providers": {"sim": {"base_url": "http://127.0.0.1:9"}},
                            "models": {"stable-m": {"provider": "sim", "name": "good"}},
                            "routes": {"bot": {"stable": "stable-m"}}})
    book.reload(without)  # the operator removes the candidate ...
    time.sleep(0.01)
    assert book.reload(cfg) == ["bot"]  # ... and names it again: a new rollout, no tick in between
    assert book.get("bot").phase == "shadow"
    controller.tick()  # no record of the new rollout yet: it holds in shadow
    state = book.get("bot")
    assert state.phase == "shadow", state.last_decision
    assert state.recommendation is not None and state.recommendation.decision == "hold"
    assert "0/100 shadow samples" in state.recommendation.reasons[0]
    ev = controller.evidence["bot"]
    assert len(ev.windows) == 1 and ev.windows[0].shadow_records == 0
    # within the new rollout the evidence is kept across its windows (a pause and a resume)
    for record in traffic(200, 0.0, STABLE, STABLE, shadow_rate=0.5, rng=random.Random(2)):
        controller.ingest(record)
    kept = controller.evidence["bot"].windows[0].shadow_records
    assert kept > 0
    book.operate("bot", "pause")
    book.operate("bot", "resume")
    controller.tick()
    assert controller.evidence["bot"] is ev and ev.windows[0].shadow_records == kept and len(ev.windows) == 2


SECRET_HOOK = "https://hooks.slack.com:44x/services/T0SECRET/B0SECRET/XXXXSECRETTOKEN"


@pytest.mark.parametrize("url,shown", [
    (SECRET_HOOK, "https://hooks.slack.com:44x/…"),
    ("https://user:SECRETPASS@hooks.slack.com:99999/services/T0SECRET", "https://hooks.slack.com:99999/…"),
    ("https://hooks.slack.com:1:2/services/T0SECRET", "https://hooks.slack.com:?/…"),
    ("https://hooks.slack.com:SECRETSECRET/services/T0SECRET", "https://hooks.slack.com:?/…"),
    ("http://[::1/services/T0SECRET", "?://?/…"),
    ("http://[::1]:8080/services/T0SECRET?token=SECRET", "http://[::1]:8080/…"),
    ("hooks.slack.com/services/T0SECRET", "?://?/…"),
    ("https://user:SECRETPASS@hooks.slack.com/services/T0SECRET", "https://hooks.slack.com/…"),
])
def test_safe_url_never_raises_and_shows_no_secret(url, shown):
    assert safe_url(url) == shown


async def test_a_webhook_url_that_does_not_parse_fails_quietly_without_its_secret(caplog):
    """The POST fails (a port that is not a number): one warning with the host only; the task ends
    without an exception (asyncio would log it, whole URL included) and no session is left open."""
    caplog.set_level(logging.DEBUG)
    cfg = make_config()
    bus, book = MemoryBus(), RolloutBook(cfg)
    controller = Controller(cfg, bus, book, Notifier(SECRET_HOOK))  # the config refuses it; a Notifier need not
    book.operate("bot", "pause")  # a phase change: the webhook task starts, nobody drains it
    tasks = list(controller.notifier._tasks)
    assert tasks
    await asyncio.wait(tasks, timeout=10)
    assert all(t.done() and not t.cancelled() and t.exception() is None for t in tasks)
    del tasks
    gc.collect()
    await asyncio.sleep(0)
    warnings = [r.getMessage() for r in caplog.records if "webhook" in r.getMessage()]
    assert warnings == ["webhook https://hooks.slack.com:44x/… failed: InvalidUrlClientError"], warnings
    assert not any("Unclosed" in r.getMessage() for r in caplog.records), caplog.text
    assert "SECRET" not in caplog.text
