"""Synthetic records for the judge and controller tests (what the proxy and shadow workers emit)."""

from __future__ import annotations

import itertools
import random
import time

from service.config import Config, parse_config
from service.records import Agreement, CandidateResult, EvaluationRecord, OutcomeEvent, Repro

_ids = itertools.count()

SEG_SHARES = {"chat": 0.6, "json": 0.25, "tools": 0.15}


def make_config(rollout: dict | None = None, shadow: dict | None = None, **top) -> Config:
    ro = {"steps": [10, 50], "min_shadow_samples": 100, "min_samples_per_step": 100, "min_step_seconds": 0,
          "max_step_seconds": 3600, "alpha": 0.01}
    ro.update(rollout or {})
    sh = {"sample_rate": 0.2, "noise_floor": True}
    sh.update(shadow or {})
    data = {
        "providers": {"sim": {"base_url": "http://127.0.0.1:9"}},
        "models": {"stable-m": {"provider": "sim", "name": "good"}, "candidate-m": {"provider": "sim", "name": "new"}},
        "routes": {"bot": {"stable": "stable-m", "candidate": "candidate-m", "rollout": ro, "shadow": sh}},
        **top,
    }
    return parse_config(data)


def outcome(role: str, segment: str, ok: bool, *, ts: float | None = None, cause: str = "invalid_tool_call",
            latency: float = 0.3, cost: float = 0.001, route: str = "bot", retry: bool = False) -> OutcomeEvent:
    model = "stable-m" if role == "stable" else "candidate-m"
    return OutcomeEvent(request_id=f"r{next(_ids)}", ts=time.time() if ts is None else ts, route=route, model=model,
                        role=role, segment=segment, outcome="completed" if ok else "failed",
                        cause=None if ok else cause, blame=None if ok else "model", latency_s=latency,
                        cost_usd=cost, client_retry=retry)


def evaluation(segment: str, ok: bool, *, agree: bool = True, floor: bool = True, ts: float | None = None,
               cause: str = "invalid_tool_call", latency: float = 0.3, stable_latency: float = 0.3,
               cost: float = 0.001, route: str = "bot", again_ok: bool | None = True) -> EvaluationRecord:
    """A shadow record; `again_ok` is the stable asked again on the same request (None: not asked)."""
    return EvaluationRecord(
        request_id=f"e{next(_ids)}", ts=time.time() if ts is None else ts, route=route, segment=segment,
        stable_model="stable-m", candidate_model="candidate-m",
        candidate=CandidateResult(outcome="completed" if ok else "failed", cause=None if ok else cause,
                                  blame=None if ok else "model", latency_s=latency, cost_usd=cost),
        agreement=Agreement(candidate_vs_stable=agree if ok else None, stable_vs_stable=floor),
        repro=Repro(modelcanary_version="test", config_version="test"),
        stable_latency_s=stable_latency, stable_cost_usd=0.001,
        stable_again=None if again_ok is None else CandidateResult(
            outcome="completed" if again_ok else "failed", cause=None if again_ok else cause,
            blame=None if again_ok else "model", latency_s=stable_latency, cost_usd=0.001),
    )


def traffic(n: int, weight: float, p_stable: dict[str, float], p_cand: dict[str, float], *,
            shadow_rate: float = 0.0, rng: random.Random | None = None, ts: float | None = None,
            latency_scale: float = 1.0) -> list:
    """n live requests split by `weight`, plus shadow evaluations of a share of the stable's successes."""
    rng = rng or random.Random(0)
    segs, shares = zip(*SEG_SHARES.items())
    out: list = []
    for _ in range(n):
        seg = rng.choices(segs, shares)[0]
        lat = rng.lognormvariate(-1.2, 0.5)
        if rng.random() < weight:
            out.append(outcome("canary", seg, rng.random() < p_cand[seg], ts=ts, latency=lat * latency_scale))
            continue
        ok = rng.random() < p_stable[seg]
        out.append(outcome("stable", seg, ok, ts=ts, latency=lat))
        if ok and rng.random() < shadow_rate:
            c_ok = rng.random() < p_cand[seg]
            out.append(evaluation(seg, c_ok, agree=rng.random() < 0.93, floor=rng.random() < 0.95, ts=ts,
                                  latency=rng.lognormvariate(-1.2, 0.5) * latency_scale, stable_latency=lat,
                                  again_ok=rng.random() < p_stable[seg]))
    return out


GOOD = {"chat": 0.97, "json": 0.97, "tools": 0.97}
BAD_TOOLS = {"chat": 0.99, "json": 0.99, "tools": 0.6}
