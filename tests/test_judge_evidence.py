"""Evidence: per-session sums for the clustered variance, shadow records as pairs, bounded session memory."""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict

import numpy as np
import pytest

from service.judge import evidence as ev_mod
from service.judge.comparisons import WORSE
from service.judge.decide import evaluate
from service.judge.evidence import ArmAcc, RouteEvidence
from service.records import RolloutState
from tests.judge_traffic import evaluation, make_config, outcome


def _state(since: float) -> RolloutState:
    return RolloutState(route="bot", stable="stable-m", candidate="candidate-m", phase="canary", canary_weight=0.5,
                        step_index=1, since=since)


def _evidence(cfg=None) -> tuple[RouteEvidence, float]:
    cfg = cfg or make_config(shadow={"sample_rate": 0.0})
    now = time.time()
    ev = RouteEvidence("bot", cfg.routes["bot"], "stable-m", "candidate-m")
    ev.sync(_state(now - 600))
    return ev, now


def test_session_sums_are_the_sums_over_sessions():
    ev, now = _evidence()
    rng = random.Random(1)
    requests = []
    for k in range(3000):
        sid = None if rng.random() < 0.3 else f"s{rng.randrange(200)}"
        ok = rng.random() < 0.9
        cause = rng.choice(["refusal", "truncated"])
        lat, cost, retry = rng.lognormvariate(-1, 0.5), rng.random() * 0.01, rng.random() < 0.05
        o = outcome("canary", "chat", ok, ts=now - 10, cause=cause, latency=lat, cost=cost, retry=retry)
        o.session_id_hash = sid
        assert ev.add_outcome(o)
        requests.append((sid or f"alone{k}", ok, None if ok else cause, lat, cost, retry))
    groups = defaultdict(list)
    for r in requests:
        groups[r[0]].append(r)
    v = ev.totals(("live", "candidate"), "chat")  # one window: the totals are that window's counters
    vec = ev.current.accs[("live", "candidate", "chat")].vector()
    n_j = np.array([len(g) for g in groups.values()], dtype=float)

    def per_session(f) -> np.ndarray:
        return np.array([sum(f(r) for r in g) for g in groups.values()], dtype=float)

    for name, f in (("completed", lambda r: r[1]), ("model_failed", lambda r: not r[1]),
                    ("cause:refusal", lambda r: r[2] == "refusal"), ("retry", lambda r: r[5])):
        x_j = per_session(f)
        assert vec[ArmAcc.FIELDS[name]] == pytest.approx([3000, x_j.sum(), (n_j * n_j).sum(), (x_j * n_j).sum(),
                                                          (x_j * x_j).sum()])
    c_j, d_j = per_session(lambda r: r[4]), per_session(lambda r: r[1])
    assert vec[ArmAcc.FIELDS["cost"]] == pytest.approx([3000, c_j.sum(), (c_j * c_j).sum(), d_j.sum(),
                                                        (c_j * d_j).sum(), (d_j * d_j).sum()])
    y_j = per_session(lambda r: math.log(r[3]) if r[1] else 0.0)
    yy = sum(math.log(r[3]) ** 2 for r in requests if r[1])
    assert vec[ArmAcc.FIELDS["latency"]][-6:] == pytest.approx([d_j.sum(), y_j.sum(), yy, (y_j * y_j).sum(),
                                                                (y_j * d_j).sum(), (d_j * d_j).sum()])
    assert v.n == 3000 and v.completed == d_j.sum()


def test_sessions_widen_the_live_interval():
    def interval_width(sessions: bool) -> float:
        ev, now = _evidence()
        rng = random.Random(2)
        for role in ("stable", "canary"):
            for s in range(300):
                p = rng.betavariate(3.8, 0.2)          # sessions differ: some fail often
                for _ in range(20):
                    o = outcome(role, "chat", rng.random() < p, ts=now - 10)
                    o.session_id_hash = f"{role}{s}" if sessions else None
                    ev.add_outcome(o)
        c = next(c for c in evaluate(ev, ev.rc) if (c.spec.name, c.segment) == ("completion_rate", "chat"))
        return c.interval[1] - c.interval[0]
    assert interval_width(sessions=True) > 1.5 * interval_width(sessions=False)


def test_session_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(ev_mod, "SESSION_MEMORY", 50)
    ev, now = _evidence()
    for s in range(200):
        o = outcome("canary", "chat", True, ts=now - 10)
        o.session_id_hash = f"s{s}"
        ev.add_outcome(o)
    assert len(ev._sessions) == 50


def test_a_shadow_record_is_one_pair_per_metric():
    ev, now = _evidence(make_config())
    ok_both = evaluation("tools", True, ts=now - 10, latency=0.5, stable_latency=0.3)
    cand_fails = evaluation("tools", False, ts=now - 10, cause="invalid_tool_call")
    stable_fails = evaluation("tools", True, ts=now - 10, again_ok=False)
    for rec in (ok_both, cand_fails, stable_fails):
        assert ev.add_evaluation(rec)
    tools = ev.segments.index("tools")
    # (n, Σd, Σd², Σcandidate, Σstable) with d = candidate − stable asked again: one pair each way
    assert ev.arm(("shadow", "candidate"), "replay:completed")[tools, 0].tolist() == [3, 0, 2, 2, 2]
    # both failures were invalid tool calls, one on each side
    cause = ev.arm(("shadow", "candidate"), "replay:cause:invalid_tool_call")[tools, 0]
    assert cause.tolist() == [3, 0, 2, 1, 1]
    pairs = ev.arm(("shadow", "candidate"), "latency_pairs")[tools, 0].reshape(3, -1)
    assert pairs.sum(axis=1).tolist() == [2, 2, 2]  # the candidate's, the minimum, the maximum: completed pairs only


def test_one_session_tells_nothing_about_sessions():
    # a single sticky session on the canary failing half its requests: one observation of a session,
    # not 40 of a request; the request-level variance would call it confidently worse
    def verdicts(session: bool) -> set[int]:
        ev, now = _evidence()
        for i in range(4000):
            ev.add_outcome(outcome("stable", "chat", i % 20 != 0, ts=now - 10))
        for i in range(40):
            o = outcome("canary", "chat", i % 2 == 0, ts=now - 10)
            o.session_id_hash = "s1" if session else None
            ev.add_outcome(o)
        return {c.verdict for c in evaluate(ev, ev.rc) if c.spec.name == "completion_rate"}
    assert WORSE in verdicts(session=False)
    assert WORSE not in verdicts(session=True)


def test_calls_passed_through_are_no_evidence():
    """Embeddings, files and the like go to the stable model only, whatever the split: counted, they
    would make the stable arm of `overall` look faster (or slower) than the candidate's for nothing."""
    ev, now = _evidence()
    assert ev.add_outcome(outcome("stable", "chat", True, ts=now))
    assert not ev.add_outcome(outcome("stable", "other", True, ts=now, latency=0.01))
    assert not ev.add_outcome(outcome("stable", "other", False, ts=now))
    assert ev.windows[-1].live_acc(ev_mod.LIVE_STABLE, "overall").n == 1
