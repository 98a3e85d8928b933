"""rollout.scope segment with several candidates, on the memory bus: each segment its own phase,
weight and step; one candidate canaried per segment, picked by rollout.select; routing by
(route, segment), sticky per session; operator actions on one segment."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from collectors.spend import OverBudget, SpendCap
from service.bus.memory import MemoryBus
from service.config import parse_config
from service.judge.decide import evaluate
from service.judge.segments import analysis_of
from service.proxy.routing import pick
from service.proxy.sampler import ShadowSampler
from service.records import OutcomeEvent
from service.rollout.book import RolloutBook, TransitionError, UnknownSegment
from service.rollout.controller import Controller
from tests.judge_traffic import SEG_SHARES, evaluation, outcome

pytestmark = pytest.mark.anyio

STABLE = {"chat": 0.97, "json": 0.97, "tools": 0.97}
# cheaper, better at chat and JSON, breaks tool calls
CHEAP = {"chat": 0.995, "json": 0.995, "tools": 0.6}
# worse everywhere (and cheaper still: `cheapest` must not pick what failed shadow)
WORSE = {"chat": 0.75, "json": 0.75, "tools": 0.75}
COST = {"cheap-m": 0.0005, "worse-m": 0.0003}
MARGINS = {"completion_rate": 0.03, "model_failure_rate": 0.03, "latency_p95_exceedance": 0.1,
           "agreement_gap": 0.1, "cost_per_completion_ratio": 1.25}


def config(rollout: dict | None = None, candidates: list[str] | None = None):
    ro = {"steps": [10, 50], "min_shadow_samples": 100, "min_samples_per_step": 150, "min_step_seconds": 0,
          "max_step_seconds": 3600, "alpha": 0.01, "scope": "segment", "margins": MARGINS}
    ro.update(rollout or {})
    models = {"stable-m": {"provider": "sim", "name": "good"}, "cheap-m": {"provider": "sim", "name": "cheap"},
              "worse-m": {"provider": "sim", "name": "worse"}}
    route = {"stable": "stable-m", "candidates": candidates or ["cheap-m", "worse-m"], "rollout": ro,
             "shadow": {"sample_rate": 0.3, "noise_floor": True}}
    return parse_config({"providers": {"sim": {"base_url": "http://127.0.0.1:9"}}, "models": models,
                         "routes": {"bot": route}})


def round_of(book: RolloutBook, n: int, rng: random.Random, behaviour: dict[str, dict[str, float]],
             shadow_rate: float = 0.3) -> list:
    """n live requests routed as the proxy routes them (by segment and session), plus shadow
    evaluations of every candidate on the same sampled stable successes."""
    segs, shares = zip(*SEG_SHARES.items())
    out: list = []
    split = book.routing["bot"]
    for _ in range(n):
        seg = rng.choices(segs, shares)[0]
        model, role = pick("bot", split, f"s{rng.randrange(10_000)}", seg, "", [])
        lat = rng.lognormvariate(-1.2, 0.5)
        if role == "canary":
            ok = rng.random() < behaviour[model][seg]
            out.append(outcome("canary", seg, ok, latency=lat * 0.7, cost=COST[model]).model_copy(
                update={"model": model}))
            continue
        served = behaviour.get(model, STABLE)[seg] if model != "stable-m" else STABLE[seg]
        ok = rng.random() < served
        out.append(outcome("stable", seg, ok, latency=lat).model_copy(update={"model": model}))
        if ok and model == "stable-m" and rng.random() < shadow_rate:
            again_ok = rng.random() < STABLE[seg]
            rid = f"req-{rng.random()}"
            for cand in behaviour:
                rec = evaluation(seg, rng.random() < behaviour[cand][seg], agree=rng.random() < 0.93,
                                 floor=rng.random() < 0.95, latency=rng.lognormvariate(-1.2, 0.5) * 0.7,
                                 stable_latency=lat, cost=COST[cand], again_ok=again_ok)
                out.append(rec.model_copy(update={"candidate_model": cand, "request_id": rid}))
    return out


async def run(cfg, until, timeout: float = 40.0, per_round: int = 600):
    bus, book = MemoryBus(), RolloutBook(cfg)
    controller = Controller(cfg, bus, book, report_interval_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    rng = random.Random(3)
    deadline = time.monotonic() + timeout
    behaviour = {"cheap-m": CHEAP, "worse-m": WORSE}
    try:
        while time.monotonic() < deadline and not until(book.get("bot")):
            for r in round_of(book, per_round, rng, behaviour):
                bus.publish("outcomes" if isinstance(r, OutcomeEvent) else "evaluations", r)
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await task
    return book


def finished(state) -> bool:
    return state.phase in ("promoted", "rolled_back", "partial")


async def test_each_segment_gets_its_own_outcome_and_candidate():
    book = await run(config({"select": "cheapest"}), finished)
    state = book.get("bot")
    segs = state.segments
    assert {n: s.phase for n, s in segs.items()} == {"tools": "rolled_back", "json": "promoted", "chat": "promoted"}, \
        {n: (s.phase, s.last_decision) for n, s in segs.items()}
    assert state.phase == "partial"
    # the cheaper candidate serves chat and JSON; tools stay on stable
    assert segs["chat"].candidate == segs["json"].candidate == "cheap-m"
    assert "select cheapest" in segs["chat"].selected and "cheap-m" in segs["chat"].selected
    assert segs["tools"].candidate is None and set(segs["tools"].rejected) == {"cheap-m", "worse-m"}
    # the worse one is ruled out everywhere, each time on that segment's own evidence
    for name, seg in segs.items():
        d = seg.rejected["worse-m"]
        assert d.decision == "rollback" and all(r.startswith(f"segment {name}, worse-m:") for r in d.reasons), d
        assert {e.segment for e in d.evidence} == {name}
    tools = segs["tools"].rejected["cheap-m"]
    assert any(r.startswith("segment tools, cheap-m:") and "n=" in r for r in tools.reasons), tools.reasons
    routing = book.routing["bot"]
    assert pick("bot", routing, "s1", "chat", "", []) == ("cheap-m", "stable")
    assert pick("bot", routing, "s1", "tools", "", []) == ("stable-m", "stable")
    assert pick("bot", routing, "s1", "multi_turn", "", []) == ("stable-m", "stable")  # never joined: stable
    # the report: candidates × segments, and /analysis per segment
    matrix = state.report["matrix"]
    rows = {(r["candidate"], r["segment"]): r for r in matrix["rows"]}
    assert rows["cheap-m", "chat"]["status"] == "promoted" and rows["cheap-m", "tools"]["status"] == "ruled out"
    assert rows["cheap-m", "tools"]["cells"]["completion_rate"]["verdict"] == "worse"
    assert set(state.report["candidates"]) == {"cheap-m", "worse-m"}
    # the report's verdict is the one applied (the segments' sum), never a route-level one over all of
    # them (which would read "rollback" here, for tools)
    applied = state.recommendation or state.last_decision
    assert applied is not None
    assert state.report["judge"]["decision"] == applied.decision != "rollback", applied
    assert state.report["judge"]["reasons"] == list(applied.reasons)
    assert all(c["judge"]["decision"] is None for c in state.report["candidates"].values())
    body = analysis_of(state)
    assert body["phase"] == "partial" and body["healthy"] is True and body["promote_ready"] is False
    assert body["segments"]["chat"]["phase"] == "promoted" and body["segments"]["tools"]["healthy"] is False


async def test_select_first_and_best_pick_among_those_that_passed():
    for rule in ("first", "best"):
        book = await run(config({"select": rule}, candidates=["worse-m", "cheap-m"]),
                         lambda s: s.segments.get("chat") is not None and s.segments["chat"].candidate is not None)
        chat = book.get("bot").segments["chat"]
        assert chat.candidate == "cheap-m", chat  # worse-m is listed first, but never passed shadow
        assert f"select {rule}" in chat.selected


def test_routing_honours_each_segments_weight_and_stays_sticky():
    cfg = config()
    book = RolloutBook(cfg)
    book.operate("bot", "promote", segment="chat")        # chat: shadow → 10 %
    book.operate("bot", "promote", segment="json")
    book.operate("bot", "promote", segment="json")        # json: → 50 %
    state = book.get("bot")
    assert (state.segments["chat"].canary_weight, state.segments["json"].canary_weight) == (0.10, 0.50)
    assert state.segments["chat"].candidate == "cheap-m"   # nothing passed shadow yet: the first listed
    split = book.routing["bot"]
    share = {seg: sum(pick("bot", split, f"user-{i}", seg, "", [])[1] == "canary" for i in range(20_000)) / 20_000
             for seg in ("chat", "json", "tools")}
    assert abs(share["chat"] - 0.10) < 0.01 and abs(share["json"] - 0.50) < 0.015 and share["tools"] == 0.0
    first = {i: pick("bot", split, f"user-{i}", "chat", "", []) for i in range(500)}
    assert all(pick("bot", split, f"user-{i}", "chat", "", []) == first[i] for i in range(500))
    book.operate("bot", "promote", segment="chat")        # 10 % → 50 %: a session on canary stays there
    wider = book.routing["bot"]
    assert all(pick("bot", wider, f"user-{i}", "chat", "", [])[1] == "canary" for i, (_, role) in first.items()
               if role == "canary")
    assert state.phase == "canary" and state.scope == "segment"


def test_operator_actions_on_one_segment():
    book = RolloutBook(config())
    with pytest.raises(TransitionError, match="no segment has joined"):
        book.operate("bot", "pause")
    with pytest.raises(UnknownSegment, match="no segment 'nope'.*chat"):
        book.operate("bot", "promote", segment="nope")
    book.operate("bot", "promote", segment="tools")
    book.operate("bot", "promote", segment="chat")
    state = book.operate("bot", "pause", segment="tools")
    assert state.segments["tools"].phase == "paused" and state.segments["chat"].phase == "canary"
    with pytest.raises(TransitionError, match="segment 'tools' is paused; resume it first"):
        book.operate("bot", "promote", segment="tools")
    state = book.operate("bot", "rollback", segment="tools")
    tools = state.segments["tools"]
    assert tools.phase == "rolled_back" and tools.canary_weight == 0.0 and set(tools.rejected) == {"cheap-m", "worse-m"}
    assert tools.last_decision.by == "operator" and "rollback by operator in segment tools" in tools.last_decision.reasons
    with pytest.raises(TransitionError, match="segment 'tools' is rolled_back"):
        book.operate("bot", "resume", segment="tools")
    assert book.routing["bot"].segments["tools"].canary is None
    # without --segment: every segment the action applies to
    state = book.operate("bot", "promote")
    assert state.segments["chat"].phase == "canary" and state.segments["chat"].canary_weight == 0.5
    state = book.operate("bot", "promote")
    assert state.segments["chat"].phase == "promoted" and state.phase == "partial"
    with pytest.raises(TransitionError, match="partial"):
        book.operate("bot", "promote", segment="chat")


def test_an_operator_promote_that_ends_a_segment_is_a_promote():
    """As the judge's step past the last step and the route-scope operator's: the segment's decision,
    the route's and the decisions counter say `promote`, not `step`."""
    from service import metrics

    book = RolloutBook(config())

    def counted(decision: str) -> float:
        return metrics.rollout_decisions_total.labels("bot", decision)._value.get()

    book.operate("bot", "promote", segment="chat")  # another segment still deciding: the route goes on
    before = {d: counted(d) for d in ("step", "promote")}
    for _ in range(2):  # shadow → 10% → 50%
        state = book.operate("bot", "promote", segment="json")
        assert state.segments["json"].last_decision.decision == "step"
    state = book.operate("bot", "promote", segment="json")
    json_seg = state.segments["json"]
    assert json_seg.phase == "promoted" and json_seg.last_decision.decision == "promote"
    assert json_seg.last_decision.by == "operator" and state.last_decision.decision == "promote"
    assert (counted("step") - before["step"], counted("promote") - before["promote"]) == (2, 1)
    state = book.operate("bot", "promote")  # chat 10% → 50%: a step; json has ended
    assert state.last_decision.decision == "step"


def test_a_segment_paused_and_resumed_keeps_its_steps_samples_and_clock():
    """DESIGN §9 per segment: the step's candidate outcomes and time count from when the step began,
    through a pause and its resume (each still its own evidence window)."""
    from service.judge.evidence import RouteEvidence
    from service.judge.segments import decide_segments

    cfg = config({"min_samples_per_step": 100})
    rc = cfg.routes["bot"]
    book = RolloutBook(cfg)
    ev = RouteEvidence("bot", rc, "stable-m", "cheap-m")

    def commit(state, n: int) -> None:
        ev.sync(state)
        for i in range(n):
            ev.add_outcome(outcome("stable", "chat", True).model_copy(update={"model": "stable-m"}))
            ev.add_outcome(outcome("canary", "chat", i % 50 != 0).model_copy(update={"model": "cheap-m"}))

    stepped = book.operate("bot", "promote", segment="chat")
    commit(stepped, 40)
    commit(book.operate("bot", "pause", segment="chat"), 40)
    resumed = book.operate("bot", "resume", segment="chat")
    commit(resumed, 40)
    chat = resumed.segments["chat"]
    assert (chat.phase, chat.step_index, chat.since) == ("canary", 0, stepped.segments["chat"].since)
    assert len(ev.windows) == 3                  # step, pause, resume: compared within each
    assert ev.segment_samples("chat", shadow=False, since=chat.since) == 120
    ev.sync(resumed)
    verdict = decide_segments(resumed, rc, {"cheap-m": evaluate(ev, rc)}, {"cheap-m": ev}, time.time())["chat"]
    assert verdict.decision.decision == "step", verdict.decision.reasons


def test_segment_names_need_scope_segment():
    cfg = parse_config({"providers": {"sim": {"base_url": "http://127.0.0.1:9"}},
                        "models": {"a": {"provider": "sim", "name": "a"}, "b": {"provider": "sim", "name": "b"}},
                        "routes": {"bot": {"stable": "a", "candidate": "b"}}})
    book = RolloutBook(cfg)
    with pytest.raises(TransitionError, match="rollout.scope: route"):
        book.operate("bot", "pause", segment="chat")
    assert book.get("bot").phase == "shadow" and book.get("bot").segments == {}


def test_segments_survive_a_restart_and_reach_followers(tmp_path):
    """Memory mode: the state file keeps each segment's phase; Kafka mode: a replica that follows the
    rollouts topic routes each segment as the controller's book does."""
    cfg = config()
    published: list = []
    book = RolloutBook(cfg, persist_path=tmp_path / "rollouts.json", publish=published.append)
    book.operate("bot", "promote", segment="json")
    book.operate("bot", "rollback", segment="tools")
    assert book.flush(10)
    again = RolloutBook(cfg, persist_path=tmp_path / "rollouts.json")
    assert {n: (s.phase, s.canary_weight, s.candidate) for n, s in again.get("bot").segments.items()} == \
        {"json": ("canary", 0.1, "cheap-m"), "tools": ("rolled_back", 0.0, None)}
    follower = RolloutBook(cfg)
    assert all(follower.adopt(state) for state in published)
    assert follower.get("bot").segments == book.get("bot").segments
    assert follower.routing["bot"].segments["json"].weight == 0.1
    assert pick("bot", follower.routing["bot"], "s", "tools", "", []) == ("stable-m", "stable")


def test_each_candidate_has_its_share_of_the_routes_shadow_budget():
    cfg = config()
    route = cfg.routes["bot"]
    route.shadow.max_usd_per_hour, route.shadow.max_per_minute = 1.0, 10
    cap = SpendCap(cfg)
    cap.add("bot", 0.5, now=0.0, share="cheap-m")
    with pytest.raises(OverBudget, match="candidate cheap-m's share .0.5 USD. of shadow.max_usd_per_hour"):
        cap.check("bot", now=1.0, share="cheap-m")
    cap.check("bot", now=1.0, share="worse-m")  # the other candidate still has its half
    cap.add("bot", 0.5, now=2.0, share="worse-m")
    with pytest.raises(OverBudget, match="route bot: shadow.max_usd_per_hour"):
        cap.check("bot", now=3.0)
    # every sampled request goes to both candidates: half of max_per_minute is sampled, spread over
    # the minute (a burst takes one token, then one every 12 s)
    sampler = ShadowSampler(cfg)
    assert sum(sampler.admit("bot", now=100.0) for _ in range(20)) == 1
    assert sum(sampler.admit("bot", now=100.0 + k / 10) for k in range(1, 611)) == 5  # 61 s


async def test_a_segment_without_a_verdict_in_time_follows_on_inconclusive():
    cfg = config({"min_shadow_samples": 10**6, "max_step_seconds": 1.0, "on_inconclusive": "rollback"})
    book = await run(cfg, lambda s: len(s.segments) == 3 and finished(s), timeout=20, per_round=100)
    state = book.get("bot")
    assert state.phase == "rolled_back", {n: s.phase for n, s in state.segments.items()}
    for seg in state.segments.values():
        assert seg.phase == "rolled_back" and set(seg.rejected) == {"cheap-m", "worse-m"}
    for name in ("chat", "json"):  # where the cheaper candidate is not worse: out of time, not of evidence
        reasons = state.segments[name].rejected["cheap-m"].reasons
        assert reasons[0].startswith(f"segment {name}, cheap-m: inconclusive after"), reasons


def test_a_conversation_is_placed_alike_on_every_replica_and_every_turn():
    """Without a session, a conversation's place in the split comes from its start: the same in every
    process (replicas, `--workers`), and for each later turn of it."""
    import os
    import subprocess
    import sys

    from service.proxy.routing import conversation_unit

    start = [{"role": "system", "content": "You are the order desk."}, {"role": "user", "content": "Where is it?"}]
    code = ("import json, sys; from service.proxy.routing import conversation_unit; "
            "print(conversation_unit('Bearer k|', json.loads(sys.argv[1])))")
    placed = {subprocess.run([sys.executable, "-c", code, json.dumps(start)], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
              for seed in ("1", "2", "3")}
    assert len(placed) == 1, placed
    later = [*start, {"role": "assistant", "content": "On its way."}, {"role": "user", "content": "When?"}]
    assert conversation_unit("Bearer k|", later) == conversation_unit("Bearer k|", start) == float(placed.pop())
    assert conversation_unit("Bearer other|", start) != conversation_unit("Bearer k|", start)


def test_a_lone_surrogate_in_a_session_or_the_messages_still_places_the_request():
    """A lone surrogate (valid JSON, `"\\ud800"`) in a session's `user` or in the messages places the
    request like any text (the upstream call is refused later with a 400 naming it), never a 500."""
    from service.proxy.routing import conversation_unit, unit_hash

    lone = json.loads('"\\ud800"')
    assert 0.0 <= unit_hash("bot", lone) < 1.0
    assert 0.0 <= conversation_unit("Bearer k|", [{"role": "user", "content": lone}]) < 1.0
