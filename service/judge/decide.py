"""DESIGN §9: from comparisons to a decision (rollback / step / promote / hold) with its reasons.

`evaluate` runs every catalog comparison in every segment; `decide` applies
the rules; `rule` is the same rules on arrays (the benchmark runs it over
thousands of simulated rollouts at once); `analysis` is the `/analysis/{route}`
body for Argo Rollouts and Flagger.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from service.config import RouteConfig
from service.judge.catalog import MetricSpec, alpha_per_comparison, build_catalog, comparisons_budget
from service.judge.comparisons import (
    INCONCLUSIVE,
    VERDICT_NAMES,
    WITHIN,
    WORSE,
    Boundary,
    MixtureBoundary,
    compare,
)
from service.judge.evidence import RouteEvidence
from service.records import Evidence, LastDecision, RolloutState

HOLD, STEP, PROMOTE, ROLLBACK = 0, 1, 2, 3
DECISION_NAMES = {HOLD: "hold", STEP: "step", PROMOTE: "promote", ROLLBACK: "rollback"}
MAX_HOLD_REASONS = 3


@dataclass(frozen=True)
class Comparison:
    spec: MetricSpec
    segment: str
    stable: float | None
    candidate: float | None
    effect: float | None          # proportions: candidate − stable; ratios: candidate / stable
    interval: tuple[float, float] | None
    n: int                        # candidate observations
    n_stable: int
    verdict: int                  # WORSE / WITHIN / INCONCLUSIVE

    @property
    def verdict_name(self) -> str:
        return VERDICT_NAMES[self.verdict]

    def evidence(self) -> Evidence:
        return Evidence(metric=self.spec.name, segment=self.segment, stable=self.stable, candidate=self.candidate,
                        effect=self.effect, interval=self.interval, n=self.n, verdict=self.verdict_name)

    def reason(self) -> str:
        where = "overall" if self.segment == "overall" else f"segment {self.segment}"
        return f"{where}: {self.spec.label} {describe_effect(self)}"

    def as_dict(self) -> dict:
        return {"metric": self.spec.name, "label": self.spec.label, "segment": self.segment,
                "source": self.spec.source, "stable": self.stable, "candidate": self.candidate,
                "effect": self.effect, "interval": list(self.interval) if self.interval else None,
                "n": self.n, "n_stable": self.n_stable, "margin": self.spec.margin, "unit": self.spec.unit,
                "verdict": self.verdict_name}


def _num(x: float) -> str:
    return f"{x:.1f}".replace("-", "−")


def _signed(x: float) -> str:
    s = f"{x:+.1f}"
    return s.replace("-", "−") if x < 0 else s


def describe_effect(c: Comparison) -> str:
    """'−6.2 pts (94.8% → 88.6%, interval −8.9…−3.4, n=812)' or '×1.42 ($0.0010 → $0.0014, …)'."""
    if c.effect is None or c.interval is None:
        return f"no comparison yet (n={c.n})"
    lo, hi = c.interval
    if c.spec.unit == "ratio":
        vals = f"${c.stable:.6g} → ${c.candidate:.6g}, " if c.stable is not None and c.candidate is not None else ""
        hi_s = "∞" if math.isinf(hi) else f"×{hi:.2f}"
        return f"×{c.effect:.2f} ({vals}interval ×{lo:.2f}…{hi_s}, n={c.n})"
    vals = ""
    if c.stable is not None and c.candidate is not None:
        vals = f"{_num(100 * c.stable)}% → {_num(100 * c.candidate)}%, "
    lo_s = "−∞" if math.isinf(lo) else _num(100 * lo)
    hi_s = "∞" if math.isinf(hi) else _num(100 * hi)
    return f"{_signed(100 * c.effect)} pts ({vals}interval {lo_s}…{hi_s}, n={c.n})"


def _f(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def evaluate(evidence: RouteEvidence, rc: RouteConfig, boundary: Boundary | None = None,
             alpha: float | None = None) -> list[Comparison]:
    """Every catalog comparison in every segment that has data in both arms."""
    boundary = boundary or MixtureBoundary()
    alpha_each = alpha if alpha is not None else alpha_per_comparison(rc)
    if not evidence.windows:
        return []
    n_seg = len(evidence.segments)
    catalog = build_catalog(rc)
    # Specs sharing a test are judged in one vectorised call: (specs × segments, windows, fields).
    groups: dict[int, list[tuple[int, MetricSpec]]] = {}
    for order, spec in enumerate(catalog):
        groups.setdefault(id(spec.test), []).append((order, spec))
    found: dict[tuple[int, int], Comparison] = {}
    for members in groups.values():
        specs = [spec for _, spec in members]
        arms = [evidence.arms(spec) for spec in specs]
        s_arr = np.concatenate([a[0] for a in arms])
        c_arr = np.concatenate([a[1] for a in arms])
        bound = np.repeat([spec.bound for spec in specs], n_seg)
        worse_if = np.repeat([spec.worse_if for spec in specs], n_seg)
        res = compare(specs[0].test, boundary, s_arr, c_arr, alpha_each, bound, worse_if)
        est = res.estimate
        no_events = specs[0].test.no_events(s_arr, c_arr)  # left out rather than reported as a comparison
        for k, (order, spec) in enumerate(members):
            for j, seg in enumerate(evidence.segments):
                i = k * n_seg + j
                n_c, n_s = int(est.n_candidate[i]), int(est.n_stable[i])
                if n_c == 0 or n_s == 0 or no_events[i] or not math.isfinite(float(est.effect[i])):
                    continue
                lo, hi = float(res.lo[i]), float(res.hi[i])
                effect = float(est.effect[i])
                if spec.unit == "ratio":
                    effect, lo, hi = math.exp(effect), math.exp(lo), math.exp(min(hi, 700.0))
                found[order, j] = Comparison(
                    spec=spec, segment=seg, stable=_f(est.stable[i]), candidate=_f(est.candidate[i]),
                    effect=effect, interval=(lo, hi), n=n_c, n_stable=n_s, verdict=int(res.verdict[i]))
    return [found[key] for key in sorted(found)]  # catalog order, then segment order


def rule(any_worse, step_ready, last_step, promote_ok, past_max, rollback_on_inconclusive):
    """DESIGN §9 on arrays (or scalars): HOLD / STEP / PROMOTE / ROLLBACK codes.

    rollback if anything is confidently worse; otherwise step when the step's
    samples and time are met (not at the last step); promote at the last step
    when also non-inferiority is shown everywhere with enough data; otherwise
    hold, or roll back past max_step_seconds when on_inconclusive is rollback.
    """
    any_worse, step_ready, last_step, promote_ok, past_max, rbi = np.broadcast_arrays(
        *(np.asarray(a, dtype=bool) for a in (any_worse, step_ready, last_step, promote_ok, past_max,
                                              rollback_on_inconclusive)))
    return np.where(any_worse, ROLLBACK,
                    np.where(step_ready & ~last_step, STEP,
                             np.where(step_ready & last_step & promote_ok, PROMOTE,
                                      np.where(past_max & rbi, ROLLBACK, HOLD))))


def gating(c: Comparison, rc: RouteConfig) -> bool:
    """A comparison with enough data to gate promotion: both arms ≥ min_samples_per_step."""
    need = rc.rollout.min_samples_per_step
    return c.n >= need and c.n_stable >= need


def decide(state: RolloutState, rc: RouteConfig, comparisons: list[Comparison], step_samples: int,
           now: float | None = None) -> LastDecision | None:
    """The judge's verdict for a route in shadow or canary; None for other phases."""
    now = time.time() if now is None else now
    if state.candidate is None or state.phase not in ("shadow", "canary"):
        return None
    ro = rc.rollout
    steps = ro.steps
    shadow = state.phase == "shadow"
    last = (not shadow) and state.step_index >= len(steps) - 1
    needed = ro.min_shadow_samples if shadow else ro.min_samples_per_step
    age = max(0.0, now - state.since)
    step_ready = step_samples >= needed and age >= ro.min_step_seconds
    worse = [c for c in comparisons if c.verdict == WORSE]
    gates = [c for c in comparisons if gating(c, rc)]
    primary = any(c.spec.name == "completion_rate" and c.segment == "overall" for c in gates)
    pending = [c for c in gates if c.verdict != WITHIN]
    promote_ok = primary and not pending
    past_max = age > ro.max_step_seconds
    code = int(rule(bool(worse), step_ready, last, promote_ok, past_max, ro.on_inconclusive == "rollback"))

    where = _where(state, steps)
    if code == ROLLBACK and worse:
        return LastDecision(decision="rollback", reasons=[c.reason() for c in worse],
                            evidence=[c.evidence() for c in worse], ts=now)
    if code == ROLLBACK:  # inconclusive past max_step_seconds
        lines = [f"inconclusive after {age:.0f} s at {where} (max_step_seconds {ro.max_step_seconds:g}, "
                 f"on_inconclusive rollback)"]
        lines += _progress(step_samples, needed, age, ro.min_step_seconds, shadow) if not step_ready else []
        lines += [f"not shown within margin: {c.reason()}" for c in pending[:MAX_HOLD_REASONS]]
        return LastDecision(decision="rollback", reasons=lines, evidence=[c.evidence() for c in pending], ts=now)
    if code == STEP:
        nxt = steps[state.step_index + 1] if state.step_index + 1 < len(steps) else 100
        kind = "shadow samples" if shadow else "candidate samples"
        lines = [f"{where} → {nxt:g}%: {step_samples} {kind} in {age:.0f} s, nothing confidently worse "
                 f"({len(comparisons)} comparisons)"]
        overall = [c for c in comparisons if c.segment == "overall"]
        return LastDecision(decision="step", reasons=lines, evidence=[c.evidence() for c in overall], ts=now)
    if code == PROMOTE:
        segs = sorted({c.segment for c in gates if c.segment != "overall"})
        lines = [f"non-inferiority shown for all {len(gates)} comparisons with ≥ {ro.min_samples_per_step} "
                 f"samples (overall" + (f" and segments {', '.join(segs)})" if segs else ")")]
        return LastDecision(decision="promote", reasons=lines, evidence=[c.evidence() for c in gates], ts=now)
    # hold
    lines: list[str] = []
    if not step_ready:
        lines += _progress(step_samples, needed, age, ro.min_step_seconds, shadow, where)
    elif last:
        if not primary:
            lines.append(f"{where}: overall completion rate has fewer than {ro.min_samples_per_step} samples per arm")
        if pending:
            lines.append(f"{where}: waiting for non-inferiority in {len(pending)} of {len(gates)} comparisons")
            lines += [c.reason() for c in _widest_first(pending)[:MAX_HOLD_REASONS]]
            if len(pending) > MAX_HOLD_REASONS:
                lines.append(f"(+{len(pending) - MAX_HOLD_REASONS} more)")
    if past_max:
        lines.append(f"inconclusive past max_step_seconds ({ro.max_step_seconds:g} s); on_inconclusive: hold")
    if not lines:
        lines.append(f"{where}: holding")
    ev = [c.evidence() for c in (pending if step_ready else [c for c in comparisons if c.segment == "overall"])]
    return LastDecision(decision="hold", reasons=lines, evidence=ev, ts=now)


def _where(state: RolloutState, steps: list[float]) -> str:
    if state.phase == "shadow":
        return "shadow"
    i = state.step_index
    return f"step {i + 1}/{len(steps)} ({steps[i]:g}%)" if 0 <= i < len(steps) else f"step {i + 1}"


def _progress(samples: int, needed: int, age: float, min_s: float, shadow: bool, where: str | None = None) -> list[str]:
    kind = "shadow samples" if shadow else "candidate samples"
    prefix = f"{where}: " if where else ""
    return [f"{prefix}{samples}/{needed} {kind}, {min(age, min_s):.0f}/{min_s:g} s"]


def _widest_first(cs: list[Comparison]) -> list[Comparison]:
    """Pending comparisons with the widest intervals (furthest from being shown) first."""
    def width(c: Comparison) -> float:
        if c.interval is None:
            return math.inf
        lo, hi = c.interval
        return hi - lo
    return sorted(cs, key=width, reverse=True)


@dataclass
class Judgement:
    decision: LastDecision | None
    comparisons: list[Comparison]
    alpha_each: float
    budget: int
    step_samples: int

    def report(self) -> dict:
        """report["judge"]: the verdict per metric and segment."""
        d = self.decision
        return {
            "decision": d.decision if d else None,
            "reasons": d.reasons if d else [],
            "alpha_per_comparison": self.alpha_each,
            "comparisons_budget": self.budget,
            "step_samples": self.step_samples,
            "counts": {name: sum(1 for c in self.comparisons if c.verdict == code)
                       for code, name in VERDICT_NAMES.items()},
            "comparisons": [c.as_dict() for c in self.comparisons],
        }


def judge(state: RolloutState, rc: RouteConfig, evidence: RouteEvidence, now: float | None = None,
          boundary: Boundary | None = None) -> Judgement:
    comparisons = evaluate(evidence, rc, boundary)
    samples = evidence.step_samples(state.phase if state.phase != "paused" else (state.paused_from or "canary"))
    decision = decide(state, rc, comparisons, samples, now)
    return Judgement(decision, comparisons, alpha_per_comparison(rc), comparisons_budget(rc), samples)


def analysis(state: RolloutState) -> dict:
    """GET /analysis/{route} (DESIGN §5): always a dict, `healthy` for Argo, `promote_ready` for Flagger."""
    verdict = state.recommendation or state.last_decision
    decision = verdict.decision if verdict else "hold"
    reasons = list(verdict.reasons) if verdict else ["no decision yet"]
    if state.phase == "rolled_back":
        healthy, ready = False, False
    elif state.phase == "promoted":
        healthy, ready = True, True
    else:
        healthy = decision != "rollback"
        ready = state.phase != "paused" and decision in ("step", "promote") and healthy
    return {"route": state.route, "phase": state.phase, "decision": decision, "healthy": healthy,
            "promote_ready": ready, "reasons": reasons}


__all__ = ["Comparison", "HOLD", "INCONCLUSIVE", "Judgement", "PROMOTE", "ROLLBACK", "STEP", "WITHIN", "WORSE",
           "analysis", "decide", "evaluate", "judge", "rule"]
