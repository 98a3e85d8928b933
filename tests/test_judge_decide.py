"""DESIGN §9 rules: rollback lists every worse comparison, thin data holds, promotion needs
non-inferiority everywhere with enough data, advisory only records, max_step_seconds."""

from __future__ import annotations

import random
import time

import pytest

from service.judge.catalog import alpha_per_comparison, build_catalog, comparisons_budget
from service.judge.decide import WITHIN, WORSE, analysis, decide, evaluate, judge
from service.judge.evidence import RouteEvidence
from service.records import LastDecision
from service.rollout.book import RolloutBook
from tests.judge_traffic import BAD_TOOLS, GOOD, evaluation, make_config, outcome, traffic

STABLE = {"chat": 0.97, "json": 0.97, "tools": 0.97}


def _setup(config, phase="canary", step=0, since=None):
    book = RolloutBook(config)
    rc = config.routes["bot"]
    state = book.get("bot").model_copy(update={
        "phase": phase, "step_index": step, "since": since if since is not None else time.time() - 1,
        "canary_weight": rc.rollout.steps[step] / 100 if phase == "canary" else 0.0})
    ev = RouteEvidence("bot", rc, state.stable, state.candidate)
    ev.sync(state)
    return state, rc, ev


def _feed(ev, records):
    for r in records:
        if r.schema_ == "modelcanary.outcome/v1":
            ev.add_outcome(r)
        else:
            ev.add_evaluation(r)


def test_budget_and_alpha_split():
    cfg = make_config()
    rc = cfg.routes["bot"]
    k = comparisons_budget(rc)
    assert k == len(build_catalog(rc)) * 6  # overall + 5 built-in segments
    assert alpha_per_comparison(rc) == pytest.approx(0.01 / k)
    no_shadow = make_config(shadow={"sample_rate": 0.0}).routes["bot"]
    assert comparisons_budget(no_shadow) < k


def test_no_data_holds_never_passes():
    cfg = make_config()
    state, rc, ev = _setup(cfg)
    j = judge(state, rc, ev)
    assert j.decision.decision == "hold"
    assert j.comparisons == []
    assert "0/100 candidate samples" in j.decision.reasons[0]


def test_too_little_data_holds():
    cfg = make_config(rollout={"min_samples_per_step": 500})
    state, rc, ev = _setup(cfg)
    _feed(ev, traffic(400, 0.1, STABLE, GOOD))
    j = judge(state, rc, ev)
    assert j.decision.decision == "hold"
    assert not any(c.verdict == WORSE for c in j.comparisons)


def test_rollback_lists_every_confidently_worse_comparison():
    cfg = make_config()
    state, rc, ev = _setup(cfg, step=1)
    rng = random.Random(1)
    _feed(ev, traffic(6000, 0.5, STABLE, BAD_TOOLS, rng=rng))
    # a second, independent problem: JSON answers that do not parse
    for _ in range(400):
        _feed(ev, [outcome("canary", "json", rng.random() < 0.7, cause="invalid_json"),
                   outcome("stable", "json", rng.random() < 0.99, cause="invalid_json")])
    j = judge(state, rc, ev)
    d = j.decision
    assert d.decision == "rollback"
    worse = [c for c in j.comparisons if c.verdict == WORSE]
    assert len(worse) >= 3
    assert len(d.evidence) == len(worse) == len(d.reasons)
    pairs = {(e.metric, e.segment) for e in d.evidence}
    assert ("completion_rate", "tools") in pairs
    assert ("model_failure_rate:invalid_json", "json") in pairs
    assert all(e.verdict == "worse" for e in d.evidence)
    line = next(r for r in d.reasons if r.startswith("segment tools: completion rate"))
    # e.g. "segment tools: completion rate −37.1 pts (97.2% → 60.1%, interval −42.0…−32.2, n=451)"
    assert "−" in line and "pts" in line and "interval" in line and "n=" in line and "→" in line
    tools = next(e for e in d.evidence if (e.metric, e.segment) == ("completion_rate", "tools"))
    assert tools.interval[1] < -rc.rollout.margins.completion_rate
    assert tools.stable > tools.candidate and tools.n > 100


def test_step_when_samples_and_time_are_met():
    cfg = make_config(rollout={"min_samples_per_step": 100, "min_step_seconds": 0})
    state, rc, ev = _setup(cfg, step=0)
    _feed(ev, traffic(1500, 0.1, STABLE, GOOD, rng=random.Random(2)))
    d = judge(state, rc, ev).decision
    assert d.decision == "step"
    assert "nothing confidently worse" in d.reasons[0]
    # time not yet met → hold
    cfg2 = make_config(rollout={"min_samples_per_step": 100, "min_step_seconds": 600})
    state2, rc2, ev2 = _setup(cfg2, step=0)
    _feed(ev2, traffic(1500, 0.1, STABLE, GOOD, rng=random.Random(2)))
    d2 = judge(state2, rc2, ev2).decision
    assert d2.decision == "hold" and "/600 s" in d2.reasons[0]


def test_shadow_steps_on_shadow_samples():
    cfg = make_config(rollout={"min_shadow_samples": 50})
    state, rc, ev = _setup(cfg, phase="shadow")
    _feed(ev, traffic(300, 0.0, STABLE, GOOD, shadow_rate=0.5, rng=random.Random(3)))
    assert ev.step_samples("shadow") >= 50
    assert judge(state, rc, ev).decision.decision == "step"


def test_shadow_catches_a_bad_segment_before_any_live_traffic():
    cfg = make_config(rollout={"min_shadow_samples": 100000})
    state, rc, ev = _setup(cfg, phase="shadow")
    _feed(ev, traffic(5000, 0.0, STABLE, BAD_TOOLS, shadow_rate=0.5, rng=random.Random(4)))
    d = judge(state, rc, ev).decision
    assert d.decision == "rollback"
    assert any(e.segment == "tools" and e.metric.startswith("shadow.") for e in d.evidence)


def test_promote_requires_non_inferiority_everywhere_with_enough_data():
    cfg = make_config(rollout={"min_samples_per_step": 200})
    rc = cfg.routes["bot"]
    state, _, ev = _setup(cfg, step=1)
    # a good candidate, lots of data: every comparison with enough data is within its margin
    better = {"chat": 0.995, "json": 0.995, "tools": 0.995}
    _feed(ev, traffic(40000, 0.5, STABLE, better, rng=random.Random(5), latency_scale=0.8))
    comps = evaluate(ev, rc)
    gating = [c for c in comps if c.n >= 200 and c.n_stable >= 200]
    assert gating and all(c.verdict == WITHIN for c in gating), [c.reason() for c in gating if c.verdict != WITHIN]
    d = decide(state, rc, comps, ev.step_samples("canary"))
    assert d.decision == "promote"
    assert len(d.evidence) == len(gating)
    # the same evidence plus a segment with enough data that is only inconclusive → hold
    rng = random.Random(6)
    for _ in range(260):
        _feed(ev, [outcome("canary", "multi_turn", rng.random() < 0.95),
                   outcome("stable", "multi_turn", rng.random() < 0.95)])
    comps = evaluate(ev, rc)
    mt = [c for c in comps if c.segment == "multi_turn" and c.spec.name == "completion_rate"]
    assert mt and mt[0].verdict != WITHIN
    d2 = decide(state, rc, comps, ev.step_samples("canary"))
    assert d2.decision == "hold"
    assert any("waiting for non-inferiority" in r for r in d2.reasons)
    assert any("multi_turn" in r for r in d2.reasons)


def test_segments_below_min_samples_do_not_gate_promotion():
    cfg = make_config(rollout={"min_samples_per_step": 200})
    rc = cfg.routes["bot"]
    state, _, ev = _setup(cfg, step=1)
    better = {"chat": 0.995, "json": 0.995, "tools": 0.995}
    _feed(ev, traffic(40000, 0.5, STABLE, better, rng=random.Random(5), latency_scale=0.8))
    rng = random.Random(7)
    for _ in range(50):  # a handful of multi_turn requests: not enough to gate
        _feed(ev, [outcome("canary", "multi_turn", rng.random() < 0.95),
                   outcome("stable", "multi_turn", rng.random() < 0.95)])
    assert decide(state, rc, evaluate(ev, rc), ev.step_samples("canary")).decision == "promote"


def test_max_step_seconds_on_inconclusive():
    long_ago = time.time() - 7200
    for action, expected in (("hold", "hold"), ("rollback", "rollback")):
        cfg = make_config(rollout={"max_step_seconds": 3600, "on_inconclusive": action,
                                   "min_samples_per_step": 100000})
        state, rc, ev = _setup(cfg, step=0, since=long_ago)
        _feed(ev, traffic(500, 0.1, STABLE, GOOD, ts=long_ago + 10))
        d = judge(state, rc, ev).decision
        assert d.decision == expected
        assert any("inconclusive" in r for r in d.reasons)


def test_advisory_mode_only_records():
    cfg = make_config(rollout={"mode": "advisory"})
    book = RolloutBook(cfg)
    before = book.get("bot")
    rec = LastDecision(decision="rollback", reasons=["segment tools: completion rate −6.2 pts"])
    after = book.decide("bot", rec)
    assert after.phase == before.phase == "shadow"
    assert after.recommendation.decision == "rollback"
    assert after.last_decision is None
    info = analysis(after)
    assert info["decision"] == "rollback" and info["healthy"] is False and info["promote_ready"] is False


def test_records_from_another_pair_or_before_the_rollout_are_ignored():
    cfg = make_config()
    state, rc, ev = _setup(cfg)
    assert not ev.add_outcome(outcome("canary", "chat", True, ts=state.since - 100))
    other = evaluation("chat", True)
    other.candidate_model = "someone-else"
    assert not ev.add_evaluation(other)
    assert ev.add_outcome(outcome("canary", "chat", True))


def test_analysis_shapes():
    cfg = make_config()
    book = RolloutBook(cfg)
    s = book.get("bot")
    a = analysis(s)
    assert a == {"route": "bot", "phase": "shadow", "decision": "hold", "healthy": True, "promote_ready": False,
                 "reasons": ["no decision yet"]}
    s2 = book.decide("bot", LastDecision(decision="hold", reasons=["shadow: 10/100 shadow samples, 0/0 s"]))
    assert analysis(s2)["reasons"] == ["shadow: 10/100 shadow samples, 0/0 s"]
    rolled = book.operate("bot", "rollback")
    a3 = analysis(rolled)
    assert a3["healthy"] is False and a3["phase"] == "rolled_back"


def test_task_success_from_feedback_is_judged():
    cfg = make_config()
    state, rc, ev = _setup(cfg, step=1)
    rng = random.Random(8)
    for _ in range(600):
        for role, p in (("stable", 0.9), ("canary", 0.6)):
            fb = outcome(role, "chat", True)
            fb.kind, fb.outcome, fb.success = "feedback", None, rng.random() < p
            ev.add_outcome(fb)
    j = judge(state, rc, ev)
    ts = [c for c in j.comparisons if c.spec.name == "task_success_rate" and c.segment == "chat"]
    assert ts and ts[0].verdict == WORSE and ts[0].n == 600
    assert j.decision.decision == "rollback"
    assert any(r.startswith("segment chat: task success") for r in j.decision.reasons)
