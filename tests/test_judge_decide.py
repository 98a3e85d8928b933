"""DESIGN §9 rules: rollback lists every worse comparison, thin data holds, promotion needs
non-inferiority everywhere with enough data (each comparison at the full alpha), advisory only
records, max_step_seconds; the forecast of a blocking comparison; live and shadow as one metric."""

from __future__ import annotations

import math
import random
import re
import time

import pytest

from service.judge.catalog import alpha_per_comparison, build_catalog, comparisons_budget, sample_unit
from service.judge.decide import WITHIN, WORSE, analysis, decide, evaluate, judge
from service.judge.evidence import LIVE_CANDIDATE, RouteEvidence, step_began
from service.records import LastDecision, SegmentState
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


def test_shadow_without_sampling_says_why_it_never_ends():
    """With shadow.sample_rate 0 the shadow samples the phase waits for never come: the hold says so."""
    state, rc, ev = _setup(make_config(shadow={"sample_rate": 0.0}), phase="shadow")
    reasons = judge(state, rc, ev).decision.reasons
    assert reasons[0].startswith("shadow: 0/100 shadow samples")
    assert "shadow.sample_rate is 0: no shadow samples will come; promote by hand, or set " \
           "rollout.min_shadow_samples: 0" in reasons
    state, rc, ev = _setup(make_config(), phase="shadow")  # sampling: they are on their way
    assert not any("sample_rate" in r for r in judge(state, rc, ev).decision.reasons)


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
    # no live candidate traffic yet: the evidence is the shadow pairs (candidate vs the stable asked again)
    tools = next(e for e in d.evidence if (e.metric, e.segment) == ("completion_rate", "tools"))
    assert tools.verdict == "worse" and tools.n > 100
    assert any(r.startswith("segment tools: completion rate (shadow)") for r in d.reasons)


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


def test_a_requests_feedback_counts_once_and_a_sessions_each_time():
    """A client that posts its feedback again (a retry, a repeat) does not outweigh other requests';
    feedback by session (its id is the session's hash) counts each time, told apart by its time."""
    cfg = make_config()
    state, rc, ev = _setup(cfg, step=1)
    fb = outcome("canary", "chat", True)
    fb.kind, fb.outcome, fb.success = "feedback", None, False
    assert ev.add_outcome(fb)
    for i in range(5):  # the same request's feedback again, later
        assert not ev.add_outcome(fb.model_copy(update={"ts": fb.ts + i + 1}))
    session = fb.model_copy(update={"request_id": "a" * 16, "session_id_hash": "a" * 16})
    for i in range(3):
        assert ev.add_outcome(session.model_copy(update={"ts": fb.ts + i}))
    assert not ev.add_outcome(session.model_copy(update={"ts": fb.ts}))  # delivered twice
    assert ev.totals(LIVE_CANDIDATE, "chat").fb_n == 4


# ---- promotion as an intersection-union test, forecasts, one metric with all its evidence ---------------

def _exact(ev, role: str, segment: str, n: int, p: float, ts: float | None = None) -> None:
    """n outcomes of one arm at exactly the rate p (failures spread evenly), so estimates stay put."""
    for i in range(n):
        ok = math.floor((i + 1) * (1 - p) + 1e-9) == math.floor(i * (1 - p) + 1e-9)
        ev.add_outcome(outcome(role, segment, ok, ts=ts))


def _last_step(cfg, age_s: float = 600.0):
    now = time.time()
    state, rc, ev = _setup(cfg, step=len(cfg.routes["bot"].rollout.steps) - 1, since=now - age_s)
    return state, rc, ev, now


NO_SHADOW = {"sample_rate": 0.0}


def test_promotion_needs_each_comparison_at_the_full_alpha_not_a_share_of_it():
    cfg = make_config(rollout={"min_samples_per_step": 200}, shadow=NO_SHADOW)
    state, rc, ev, now = _last_step(cfg)
    _exact(ev, "stable", "chat", 20_000, 0.95, ts=now - 300)
    _exact(ev, "canary", "chat", 20_000, 0.95, ts=now - 300)
    j = judge(state, rc, ev, now)
    assert j.decision.decision == "promote", j.decision.reasons
    comp = next(c for c in j.comparisons if (c.spec.name, c.segment) == ("completion_rate", "chat"))
    lo, hi = comp.interval
    assert lo > -rc.rollout.margins.completion_rate
    # the rollback side's radius, at alpha / K: an interval that wide on both sides would still hold
    assert comp.effect - (hi - comp.effect) < -rc.rollout.margins.completion_rate
    report = j.report()
    assert report["alpha_within"] == rc.rollout.alpha
    assert report["alpha_per_comparison"] == pytest.approx(rc.rollout.alpha / report["comparisons_budget"])


def test_the_promotion_eta_names_the_comparisons_that_do_not_gate_yet():
    """Chat gates with an ETA; tools has data below min_samples_per_step: its comparisons will gate
    too, so the "promotion possible" line says the ETA holds only if they pass as well."""
    cfg = make_config(rollout={"min_samples_per_step": 200}, shadow=NO_SHADOW)
    state, rc, ev, now = _last_step(cfg, age_s=600.0)
    for role in ("stable", "canary"):
        _exact(ev, role, "chat", 5000, 0.95, ts=now - 30)
        _exact(ev, role, "tools", 100, 0.95, ts=now - 30)
    d = judge(state, rc, ev, now).decision
    assert d.decision == "hold" and "promotion possible in ~" in d.reasons[0], d.reasons
    assert re.search(r"; \d+ more comparisons \(segment tools\) gate once both arms have 200 samples$",
                     d.reasons[0]), d.reasons[0]


def test_a_blocking_comparison_forecasts_the_samples_and_time_it_needs():
    cfg = make_config(rollout={"min_samples_per_step": 200}, shadow=NO_SHADOW)
    state, rc, ev, now = _last_step(cfg, age_s=600.0)
    _exact(ev, "stable", "chat", 5000, 0.95, ts=now - 30)
    _exact(ev, "canary", "chat", 5000, 0.95, ts=now - 30)
    j = judge(state, rc, ev, now)
    d = j.decision
    assert d.decision == "hold"
    comp = next(c for c in j.comparisons if (c.spec.name, c.segment) == ("completion_rate", "chat"))
    f = comp.forecast
    assert f is not None and f.needed_n > 1000
    assert f.eta_s == pytest.approx(f.needed_n / (5000 / 600), rel=0.02)  # at the window's 8.3 canary samples/s
    # the slowest are listed (here all alike: completion, model failures, the failure cause)
    pattern = r"(overall|segment chat): .+ non-inferiority needs ~[\d.]+k? more canary samples \(~.+ at this step's average traffic\)"
    assert any(re.fullmatch(pattern, r) for r in d.reasons), d.reasons
    assert "promotion possible in ~" in d.reasons[0]
    ev_rec = next(e for e in d.evidence if (e.metric, e.segment) == ("completion_rate", "chat"))
    assert (ev_rec.needed_n, ev_rec.eta_s) == (f.needed_n, f.eta_s)
    row = next(c for c in j.report()["comparisons"] if (c["metric"], c["segment"]) == ("completion_rate", "chat"))
    assert row["needed_n"] == f.needed_n and "needs ~" in row["forecast"]

    def verdict_after(extra: int) -> int:
        _, _, ev2, _ = _last_step(cfg, age_s=600.0)
        _exact(ev2, "stable", "chat", 5000 + extra, 0.95, ts=now - 300)
        _exact(ev2, "canary", "chat", 5000 + extra, 0.95, ts=now - 300)
        return next(c.verdict for c in evaluate(ev2, rc) if (c.spec.name, c.segment) == ("completion_rate", "chat"))

    # at an unchanged effect the forecast is what it takes: a little less is not enough, that much is
    assert verdict_after(int(0.9 * f.needed_n)) != WITHIN
    assert verdict_after(int(1.05 * f.needed_n)) == WITHIN


def test_the_forecast_says_when_more_data_cannot_show_non_inferiority():
    cfg = make_config(rollout={"min_samples_per_step": 200}, shadow=NO_SHADOW)
    state, rc, ev, now = _last_step(cfg)
    _exact(ev, "stable", "chat", 3000, 0.985, ts=now - 300)
    _exact(ev, "canary", "chat", 3000, 0.97, ts=now - 300)   # 1.5 pts worse: beyond the margin, not yet sure
    j = judge(state, rc, ev, now)
    assert j.decision.decision == "hold"
    comp = next(c for c in j.comparisons if (c.spec.name, c.segment) == ("completion_rate", "chat"))
    assert comp.verdict != WORSE and comp.forecast is not None and comp.forecast.needed_n is None
    assert any(re.match(r"(overall|segment chat): .+ non-inferiority cannot be shown at the current effect \([+−]1\.5 pts,"
                        r" margin 1 pts\): widen the margin or fix the candidate", r) for r in j.decision.reasons), \
        j.decision.reasons


def test_an_arm_of_one_session_gives_no_forecast_and_no_verdict_from_its_count():
    """A sticky client sent every canary request of a segment in one session: its clustered variance
    is infinite, so that part says nothing, and the forecast says there is nothing to forecast from
    yet (it said "cannot be shown at the current effect: widen the margin")."""
    cfg = make_config(rollout={"min_samples_per_step": 200}, shadow=NO_SHADOW)
    state, rc, ev, now = _last_step(cfg)
    _exact(ev, "stable", "chat", 4000, 0.97, ts=now - 300)
    _exact(ev, "canary", "chat", 4000, 0.97, ts=now - 300)
    _exact(ev, "stable", "json", 400, 0.97, ts=now - 300)
    for i in range(400):
        ev.add_outcome(outcome("canary", "json", i % 33 != 0, ts=now - 300).model_copy(
            update={"session_id_hash": "one-long-session"}))
    j = judge(state, rc, ev, now)
    comp = next(c for c in j.comparisons if (c.spec.name, c.segment) == ("completion_rate", "json"))
    assert comp.verdict_name == "inconclusive"
    reason = next(r for r in j.decision.reasons if r.startswith("segment json: completion rate"))
    assert reason.endswith("no forecast yet: an arm has too few samples or sessions for an interval"), reason


def test_observations_of_a_part_without_weight_do_not_make_up_the_30_a_verdict_needs():
    """The live part of one session carries no weight, so the comparison rests on 12 shadow pairs:
    too few for a verdict (it rolled back, its 60 live requests counted towards the 30)."""
    cfg = make_config(rollout={"steps": [5, 50]})
    now = time.time()
    state, rc, ev = _setup(cfg, since=now - 600)
    _exact(ev, "stable", "tools", 2000, 0.97, ts=now - 30)
    for _ in range(60):
        ev.add_outcome(outcome("canary", "tools", True, ts=now - 30).model_copy(update={"session_id_hash": "one"}))
    for _ in range(12):
        ev.add_evaluation(evaluation("tools", False, ts=now - 30, cause="refusal"))
    comp = next(c for c in evaluate(ev, rc) if (c.spec.name, c.segment) == ("completion_rate", "tools"))
    assert comp.n == 12 and comp.verdict_name != "worse", (comp.n, comp.verdict_name, comp.interval)


def _agreement(ev, n: int, ts: float) -> None:
    """n shadow records of chat: the candidate agrees with the stable 93 % of the time, the noise floor
    95 % (a fixed cycle of 100, so the estimate stays put at multiples of 100)."""
    for i in range(n):
        ev.add_evaluation(evaluation("chat", True, agree=i % 100 >= 7, floor=(i + 50) % 100 >= 5, ts=ts))


def test_a_shadow_only_forecast_counts_its_own_pairs():
    """needed_n of a shadow-only comparison is in its own pairs, and its words say so."""
    cfg = make_config(rollout={"min_samples_per_step": 200})
    state, rc, ev, now = _last_step(cfg, age_s=600.0)
    _agreement(ev, 1000, ts=now - 30)
    j = judge(state, rc, ev, now)
    comp = next(c for c in j.comparisons if (c.spec.name, c.segment) == ("agreement_gap", "chat"))
    f = comp.forecast
    assert comp.verdict != WITHIN and f is not None and f.needed_n is not None
    assert re.fullmatch(r"segment chat: agreement vs noise floor non-inferiority needs ~[\d.]+k? more shadow "
                        r"samples \(~.+ at this step's average traffic\)", comp.forecast_reason()), comp.forecast_reason()
    assert f.eta_s == pytest.approx(f.needed_n / (1000 / 600), rel=0.02)  # at the window's shadow samples/s

    def verdict_after(extra: int) -> int:
        _, _, ev2, _ = _last_step(cfg, age_s=600.0)
        _agreement(ev2, 1000 + 100 * math.ceil(extra / 100), ts=now - 30)
        return next(c.verdict for c in evaluate(ev2, rc) if (c.spec.name, c.segment) == ("agreement_gap", "chat"))

    assert verdict_after(int(0.85 * f.needed_n)) != WITHIN
    assert verdict_after(int(1.1 * f.needed_n)) == WITHIN


def test_each_metric_names_what_its_forecast_counts():
    cfg = make_config(shadow={"stability": {"sample_rate": 0.1}})
    units = {spec.name: sample_unit(spec) for spec in build_catalog(cfg.routes["bot"])}
    assert units["completion_rate"] == units["cost_per_completion"] == "candidate samples (canary and shadow)"
    assert units["client_retry_rate"] == "canary samples"
    assert units["task_success_rate"] == "canary feedback events"
    assert units["agreement_gap"] == units["similarity_gap"] == "shadow samples"
    assert units["stability_gap"] == "stability pairs"
    no_shadow = {spec.name: sample_unit(spec) for spec in build_catalog(make_config(shadow=NO_SHADOW).routes["bot"])}
    assert no_shadow["completion_rate"] == "canary samples"
    no_replay = build_catalog(make_config(shadow={"noise_floor": False}).routes["bot"])
    assert sample_unit(next(s for s in no_replay if s.name == "completion_rate")) == \
        "candidate samples (canary and shadow)"


def test_no_forecast_before_the_last_step():
    """§1: forecasts are of what blocks promotion, at the last step only."""
    cfg = make_config(rollout={"min_samples_per_step": 200, "min_step_seconds": 3000}, shadow=NO_SHADOW)
    now = time.time()
    state, rc, ev = _setup(cfg, step=0, since=now - 600)
    _exact(ev, "stable", "chat", 5000, 0.95, ts=now - 30)
    _exact(ev, "canary", "chat", 5000, 0.95, ts=now - 30)
    j = judge(state, rc, ev, now)
    assert j.decision.decision == "hold" and j.decision.reasons[0].startswith("step 1/2 (10%): ")
    assert all(e.needed_n is None and e.eta_s is None for e in j.decision.evidence), j.decision.evidence
    assert all(c.forecast is None for c in j.comparisons)
    assert all(row["needed_n"] is None and row["forecast"] is None for row in j.report()["comparisons"])
    assert not any("non-inferiority needs" in r for r in j.decision.reasons)


def test_segment_scope_forecasts_only_segments_at_their_last_step():
    cfg = make_config(rollout={"min_samples_per_step": 200, "scope": "segment"}, shadow=NO_SHADOW)
    now = time.time()
    state, rc, ev = _setup(cfg, step=0, since=now - 600)
    state = state.model_copy(update={"scope": "segment", "segments": {
        "chat": SegmentState(phase="canary", step_index=1, since=now - 600, candidate="candidate-m"),
        "json": SegmentState(phase="canary", step_index=0, since=now - 600, candidate="candidate-m")}})
    for seg in ("chat", "json"):
        _exact(ev, "stable", seg, 5000, 0.95, ts=now - 30)
        _exact(ev, "canary", seg, 5000, 0.95, ts=now - 30)
    forecast_in = {c.segment for c in judge(state, rc, ev, now).comparisons if c.forecast is not None}
    assert forecast_in == {"chat"}


def test_no_eta_without_recent_traffic_or_from_a_fresh_window():
    """§5: a rate needs a window ≥ 10 s old with a candidate record in the last 60 s."""
    cfg = make_config(rollout={"min_samples_per_step": 200}, shadow=NO_SHADOW)

    def forecast_at(age_s: float, last_record_s: float):
        state, rc, ev, now = _last_step(cfg, age_s=age_s)
        _exact(ev, "stable", "chat", 5000, 0.95, ts=now - last_record_s)
        _exact(ev, "canary", "chat", 5000, 0.95, ts=now - last_record_s)
        j = judge(state, rc, ev, now)
        comp = next(c for c in j.comparisons if (c.spec.name, c.segment) == ("completion_rate", "chat"))
        return comp, j.decision

    quiet, d = forecast_at(600.0, 300.0)   # nothing arrived for 5 minutes
    assert quiet.forecast.needed_n > 1000 and quiet.forecast.eta_s is None
    assert "(no ETA: no candidate traffic in the last 60 s)" in quiet.forecast_reason()
    assert "promotion possible in" not in d.reasons[0]
    young, _ = forecast_at(0.5, 0.1)       # a step (or a resume) half a second ago
    assert young.forecast.needed_n is not None and young.forecast.eta_s is None
    assert "(no ETA yet: the current window is 0 s old, a rate needs 10 s)" in young.forecast_reason()
    steady, _ = forecast_at(600.0, 30.0)
    assert steady.forecast.eta_s == pytest.approx(steady.forecast.needed_n / (5000 / 600), rel=0.02)


def test_pause_and_resume_keep_the_steps_samples_and_clock():
    """DESIGN §9: min_samples_per_step counts candidate outcomes since the step began; a pause and its
    resume open windows (the judge still compares within each) but do not restart the step."""
    cfg = make_config(rollout={"min_samples_per_step": 300, "min_step_seconds": 600}, shadow=NO_SHADOW)
    rc = cfg.routes["bot"]
    now = time.time()
    windows = [("shadow", -1, now - 2000), ("canary", 0, now - 1000), ("paused", 0, now - 400),
               ("canary", 0, now - 100)]
    base = RolloutBook(cfg).get("bot")
    ev = RouteEvidence("bot", rc, base.stable, base.candidate)
    state = base
    for i, (phase, step, since) in enumerate(windows):
        state = base.model_copy(update={"phase": phase, "step_index": step, "since": since, "windows": windows[:i + 1],
                                        "canary_weight": 0.1 if step == 0 else 0.0,
                                        "paused_from": "canary" if phase == "paused" else None})
        ev.sync(state)
        if step == 0:
            _exact(ev, "stable", "chat", 1000, 0.97, ts=since + 1)
            _exact(ev, "canary", "chat", 120, 0.97, ts=since + 1)
    assert step_began(state) == now - 1000
    j = judge(state, rc, ev, now)
    assert j.step_samples == 360
    assert j.decision.decision == "step", j.decision.reasons
    assert "360 candidate samples in 1000 s" in j.decision.reasons[0]


def test_a_pause_and_resume_through_the_book_keep_the_step():
    book = RolloutBook(make_config())
    stepped = book.operate("bot", "promote")
    book.operate("bot", "pause")
    resumed = book.operate("bot", "resume")
    assert (resumed.phase, resumed.step_index) == ("canary", 0) and resumed.since > stepped.since
    assert step_began(resumed) == stepped.since
    assert step_began(book.operate("bot", "promote")) > resumed.since   # the next step starts its own clock


def test_forecasts_reach_analysis_and_status():
    from rich.console import Console

    from service.admin.cli import status_table
    from service.records import dump

    cfg = make_config(rollout={"min_samples_per_step": 200}, shadow=NO_SHADOW)
    state, rc, ev, now = _last_step(cfg)
    _exact(ev, "stable", "chat", 5000, 0.95, ts=now - 300)
    _exact(ev, "canary", "chat", 5000, 0.95, ts=now - 300)
    book = RolloutBook(cfg)
    book.states["bot"] = state
    held = book.decide("bot", judge(state, rc, ev, now).decision)
    assert any("non-inferiority needs ~" in r for r in analysis(held)["reasons"])
    console = Console(record=True, width=200)
    console.print(status_table([dump(held)]))
    assert "non-inferiority needs ~" in console.export_text()


def test_live_and_shadow_evidence_of_one_metric_are_one_comparison():
    cfg = make_config(rollout={"min_samples_per_step": 100})
    state, rc, ev = _setup(cfg, step=1)
    _feed(ev, traffic(8000, 0.5, STABLE, GOOD, shadow_rate=0.3, rng=random.Random(9)))
    comp = next(c for c in evaluate(ev, rc) if (c.spec.name, c.segment) == ("completion_rate", "overall"))
    assert comp.source == "live+shadow"
    parts = {p["source"]: p for p in comp.parts}
    assert set(parts) == {"live", "shadow"}
    assert comp.n == parts["live"]["n"] + parts["shadow"]["n"]
    assert comp.reason().startswith("overall: completion rate (live+shadow) ")
    # without the stable asked again (no noise floor), the candidate's shadow outcomes join its live ones
    cfg2 = make_config(rollout={"min_samples_per_step": 100}, shadow={"noise_floor": False})
    state2, rc2, ev2 = _setup(cfg2, step=1)
    for r in traffic(8000, 0.5, STABLE, GOOD, shadow_rate=0.3, rng=random.Random(9)):
        if r.schema_ == "modelcanary.outcome/v1":
            ev2.add_outcome(r)
        else:
            ev2.add_evaluation(r.model_copy(update={"stable_again": None}))
    comp2 = next(c for c in evaluate(ev2, rc2) if (c.spec.name, c.segment) == ("completion_rate", "overall"))
    assert comp2.source == "live+shadow" and comp2.n == parts["live"]["n"] + ev2.current.shadow_records
