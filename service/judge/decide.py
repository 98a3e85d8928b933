"""DESIGN §9: from comparisons to a decision (rollback / step / promote / hold) with its reasons.

`evaluate` runs every catalog comparison in every segment, each with all its
evidence (live and paired shadow parts combined), and forecasts the ones that
block promotion; `decide` applies the rules; `rule` is the same rules on arrays
(the benchmark runs it over thousands of simulated rollouts at once);
`analysis` is the `/analysis/{route}` body for Argo Rollouts and Flagger.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from service.config import RouteConfig
from service.judge import stats
from service.judge.catalog import (
    POOLED_CANDIDATE,
    MetricSpec,
    Part,
    alpha_per_comparison,
    build_catalog,
    comparisons_budget,
    route_segments,
    sample_unit,
)
from service.judge.comparisons import (
    INCONCLUSIVE,
    VERDICT_NAMES,
    WITHIN,
    WORSE,
    Boundary,
    JudgeTest,
    MixtureBoundary,
    interval,
    within_scale,
)
from service.judge.evidence import RouteEvidence, step_began
from service.judge.forecast import Forecast, describe, duration_text, forecast
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
    n: int                        # candidate observations (live canary and shadow)
    n_stable: int
    verdict: int                  # WORSE / WITHIN / INCONCLUSIVE
    source: str = "live"          # where the evidence came from: live, shadow or live+shadow
    parts: tuple[dict, ...] = ()  # per source: its own effect and counts (the report)
    forecast: Forecast | None = None  # a comparison that blocks promotion: what it still needs

    @property
    def verdict_name(self) -> str:
        return VERDICT_NAMES[self.verdict]

    @property
    def where(self) -> str:
        return "overall" if self.segment == "overall" else f"segment {self.segment}"

    @property
    def label(self) -> str:
        return self.spec.label if self.source == "live" else f"{self.spec.label} ({self.source})"

    def evidence(self) -> Evidence:
        f = self.forecast
        return Evidence(metric=self.spec.name, segment=self.segment, stable=self.stable, candidate=self.candidate,
                        effect=self.effect, interval=self.interval, n=self.n, verdict=self.verdict_name,
                        needed_n=f.needed_n if f else None, eta_s=f.eta_s if f else None)

    def reason(self) -> str:
        return f"{self.where}: {self.label} {describe_effect(self)}"

    def forecast_reason(self) -> str | None:
        if self.forecast is None:
            return None
        return describe(self.where, self.spec.label, self.forecast, sample_unit(self.spec), _effect_text(self),
                        _margin_text(self.spec))

    def as_dict(self) -> dict:
        f = self.forecast
        return {"metric": self.spec.name, "label": self.spec.label, "segment": self.segment,
                "source": self.source, "stable": self.stable, "candidate": self.candidate,
                "effect": self.effect, "interval": list(self.interval) if self.interval else None,
                "n": self.n, "n_stable": self.n_stable, "margin": self.spec.margin, "unit": self.spec.unit,
                "verdict": self.verdict_name, "parts": list(self.parts),
                "needed_n": f.needed_n if f else None, "eta_s": f.eta_s if f else None,
                "forecast": self.forecast_reason()}


def _num(x: float) -> str:
    return f"{x:.1f}".replace("-", "−")


def _signed(x: float) -> str:
    s = f"{x:+.1f}"
    return s.replace("-", "−") if x < 0 else s


def _score(x: float, signed: bool = False) -> str:
    return (f"{x:+.3f}" if signed else f"{x:.3f}").replace("-", "−")


def describe_effect(c: Comparison) -> str:
    """'−6.2 pts (94.8% → 88.6%, interval −8.9…−3.4, n=812)' or '×1.42 ($0.0010 → $0.0014, …)'."""
    if c.effect is None or c.interval is None:
        return f"no comparison yet (n={c.n})"
    lo, hi = c.interval
    if c.spec.unit == "ratio":
        vals = f"${c.stable:.6g} → ${c.candidate:.6g}, " if c.stable is not None and c.candidate is not None else ""
        hi_s = "∞" if math.isinf(hi) else f"×{hi:.2f}"
        return f"×{c.effect:.2f} ({vals}interval ×{lo:.2f}…{hi_s}, n={c.n})"
    if c.spec.unit == "score":  # a mean of paired scores: similarity, judge preference, stability
        vals = f"{_score(c.stable)} → {_score(c.candidate)}, " if c.stable is not None and c.candidate is not None else ""
        return f"{_score(c.effect, signed=True)} ({vals}interval {_score(lo)}…{_score(hi)}, n={c.n})"
    vals = ""
    if c.stable is not None and c.candidate is not None:
        vals = f"{_num(100 * c.stable)}% → {_num(100 * c.candidate)}%, "
    lo_s = "−∞" if math.isinf(lo) else _num(100 * lo)
    hi_s = "∞" if math.isinf(hi) else _num(100 * hi)
    return f"{_signed(100 * c.effect)} pts ({vals}interval {lo_s}…{hi_s}, n={c.n})"


def _effect_text(c: Comparison) -> str:
    if c.effect is None:
        return "no estimate"
    if c.spec.unit == "ratio":
        return f"×{c.effect:.2f}"
    if c.spec.unit == "score":
        return _score(c.effect, signed=True)
    return f"{_signed(100 * c.effect)} pts"


def _margin_text(spec: MetricSpec) -> str:
    if spec.unit == "ratio":
        return f"×{spec.margin:g}"
    return f"{spec.margin:g}" if spec.unit == "score" else f"{100 * spec.margin:g} pts"


def _f(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


_EST_FIELDS = ("stable", "candidate", "effect", "var", "n_stable", "n_candidate")


def _part_source(part: Part) -> str:
    return "live+shadow" if part.candidate_arm == POOLED_CANDIDATE else part.source


@dataclass(frozen=True)
class _Plan:
    """What `evaluate` computes for a route, fixed by its config: rows are (metric, segment)."""

    catalog: list[MetricSpec]
    n_seg: int
    n_parts: int
    groups: list[tuple[JudgeTest, list[tuple[int, int, Part]]]]   # per test: (metric, part slot, part)
    families: list[tuple[JudgeTest, np.ndarray]]                   # per kind of interval: its rows
    bound: np.ndarray
    worse_if: np.ndarray
    ratio: np.ndarray
    scale: np.ndarray              # the promotion side's mixing scale per row
    alpha_each: float
    budget: int


_PLANS: dict[int, tuple[RouteConfig, _Plan]] = {}
# per test of a plan: (test, its members (metric, part slot, part), stable arms, candidate arms)
_Inputs = tuple[JudgeTest, list[tuple[int, int, Part]], np.ndarray, np.ndarray]


def _key(test: JudgeTest) -> object:
    """Equal tests share one vectorised call (a test holding arrays, e.g. histogram edges, by identity)."""
    try:
        return hash(test), test
    except TypeError:
        return id(test)


def _plan(rc: RouteConfig) -> _Plan:
    """The route's plan, built once per config object (a reload makes a new one)."""
    hit = _PLANS.get(id(rc))
    if hit is not None and hit[0] is rc:
        return hit[1]
    catalog = build_catalog(rc)
    n_seg = len(route_segments(rc))
    groups: dict[object, tuple[JudgeTest, list]] = {}
    families: dict[tuple, tuple[JudgeTest, list]] = {}
    for i, spec in enumerate(catalog):
        for k, part in enumerate(spec.parts):
            groups.setdefault(_key(part.test), (part.test, []))[1].append((i, k, part))
        # one interval call per kind of boundary and parameter space
        kind = (spec.test.taus, spec.test.weights, spec.test.effect_range)
        families.setdefault(kind, (spec.test, []))[1].extend(range(i * n_seg, (i + 1) * n_seg))
    bound = np.repeat([spec.bound for spec in catalog], n_seg)
    plan = _Plan(catalog, n_seg, max(len(spec.parts) for spec in catalog), list(groups.values()),
                 [(test, np.array(rows)) for test, rows in families.values()], bound,
                 np.repeat([spec.worse_if for spec in catalog], n_seg), np.repeat([s.test.ratio for s in catalog], n_seg),
                 np.concatenate([within_scale(spec.test, np.full(n_seg, spec.bound)) for spec in catalog]),
                 alpha_per_comparison(rc), comparisons_budget(rc))
    if len(_PLANS) > 64:
        _PLANS.clear()
    _PLANS[id(rc)] = (rc, plan)
    return plan


def evaluate(evidence: RouteEvidence, rc: RouteConfig, boundary: Boundary | None = None,
             alpha: float | None = None, now: float | None = None,
             forecast_in: Collection[str] = ()) -> list[Comparison]:
    """Every catalog comparison in every segment that has data in both arms.

    Each metric's parts (live, paired shadow) are estimated with one vectorised call per test over
    all metrics and segments, combined by inverse-variance weights, and judged in one call per kind
    of interval: the end that decides a rollback at alpha / K, the end that decides promotion at the
    route's alpha (comparisons.interval). With `now`, every comparison of a segment in `forecast_in`
    that blocks promotion (enough samples to gate, not yet within) gets a forecast at the current
    window's traffic.
    """
    if not evidence.windows:
        return []
    boundary = boundary or MixtureBoundary()
    plan = _plan(rc)
    alpha_worse = alpha if alpha is not None else plan.alpha_each
    alpha_within = rc.rollout.alpha
    parts_est, no_events, inputs = _part_estimates(evidence, plan)
    combined = stats.combine_estimates(parts_est, log_values=plan.ratio)
    rows = len(plan.bound)
    lo, hi, verdict = np.full(rows, np.nan), np.full(rows, np.nan), np.full(rows, INCONCLUSIVE)
    for test, idx in plan.families:
        sub = stats.Estimate(*(getattr(combined, name)[idx] for name in _EST_FIELDS))
        res = interval(test, boundary, sub, alpha_worse, alpha_within, plan.bound[idx], plan.worse_if[idx],
                       within_scales=((plan.scale[idx],), (1.0,)))
        lo[idx], hi[idx], verdict[idx] = res.lo, res.hi, res.verdict
    has = (combined.n_candidate > 0) & (combined.n_stable > 0) & ~no_events.all(axis=0) & np.isfinite(combined.effect)
    forecasts: dict[int, Forecast] = {}
    need = rc.rollout.min_samples_per_step
    in_scope = np.tile(np.isin(evidence.segments, list(forecast_in)), len(plan.catalog))
    blocking = has & in_scope & (verdict != WITHIN) & (combined.n_candidate >= need) & (combined.n_stable >= need)
    if now is not None and blocking.any():
        w = evidence.windows[-1]  # evidence.current
        quiet = now - (w.last_candidate_ts if w.last_candidate_ts is not None else w.start)
        forecasts = _forecasts(np.flatnonzero(blocking), combined, plan, alpha_within, inputs, now - w.start, quiet)
    return _comparisons(plan, evidence.segments, np.flatnonzero(has), combined, parts_est, lo, hi, verdict,
                        forecasts)


def _comparisons(plan: _Plan, segments: list[str], rows: np.ndarray, combined: stats.Estimate,
                 parts_est: list[stats.Estimate], lo: np.ndarray, hi: np.ndarray, verdict: np.ndarray,
                 forecasts: dict[int, Forecast]) -> list[Comparison]:
    """The Comparison records of the rows with data, in catalog order, then segment order."""
    c = {name: getattr(combined, name)[rows].tolist() for name in _EST_FIELDS}
    per_part = [{name: getattr(est, name)[rows].tolist() for name in ("effect", "n_stable", "n_candidate")}
                for est in parts_est]
    lo_l, hi_l, verdict_l = lo[rows].tolist(), hi[rows].tolist(), verdict[rows].tolist()
    out = []
    for j, r in enumerate(rows.tolist()):
        spec = plan.catalog[r // plan.n_seg]
        effect, lo_r, hi_r = c["effect"][j], lo_l[j], hi_l[j]
        ratio = spec.unit == "ratio"
        if ratio:
            effect, lo_r, hi_r = math.exp(effect), math.exp(lo_r), math.exp(hi_r) if hi_r < 700.0 else math.inf
        parts: tuple[dict, ...] = tuple({"source": _part_source(part),
                       "effect": _f(math.exp(p["effect"][j]) if ratio else p["effect"][j]),
                       "n": int(p["n_candidate"][j]), "n_stable": int(p["n_stable"][j])}
                      for part, p in zip(spec.parts, per_part) if p["n_candidate"][j] > 0 and p["n_stable"][j] > 0)
        sources = {src for part in parts for src in part["source"].split("+")}
        out.append(Comparison(
            spec=spec, segment=segments[r % plan.n_seg], stable=_f(c["stable"][j]), candidate=_f(c["candidate"][j]),
            effect=effect, interval=(lo_r, hi_r), n=int(c["n_candidate"][j]), n_stable=int(c["n_stable"][j]),
            verdict=int(verdict_l[j]), source="+".join(x for x in ("live", "shadow") if x in sources) or spec.source,
            parts=parts, forecast=forecasts.get(r)))
    return out


def _part_estimates(evidence: RouteEvidence, plan: _Plan) -> tuple[list[stats.Estimate], np.ndarray, list[_Inputs]]:
    """Every part's estimate in every segment, one vectorised call per test: (estimates per part slot
    (metrics × segments rows), whether nothing happened there, the inputs by test for forecasts)."""
    rows, n_seg = len(plan.bound), plan.n_seg
    slots = [{k: np.full(rows, np.inf if k == "var" else (0.0 if k.startswith("n_") else np.nan))
              for k in _EST_FIELDS} for _ in range(plan.n_parts)]
    no_events = np.ones((plan.n_parts, rows), dtype=bool)
    inputs: list[_Inputs] = []
    for test, members in plan.groups:
        s_arr, c_arr = evidence.arms_of([part for _, _, part in members])
        est = test.estimate(s_arr, c_arr)
        ne = test.no_events(s_arr, c_arr)
        for m, (i, k, _) in enumerate(members):
            dst, src = slice(i * n_seg, (i + 1) * n_seg), slice(m * n_seg, (m + 1) * n_seg)
            for name in _EST_FIELDS:
                slots[k][name][dst] = getattr(est, name)[src]
            no_events[k, dst] = ne[src]
        inputs.append((test, members, s_arr, c_arr))
    return [stats.Estimate(**slot) for slot in slots], no_events, inputs


def _forecasts(rows: np.ndarray, combined: stats.Estimate, plan: _Plan, alpha_within: float, inputs: list[_Inputs],
               age_s: float, quiet_s: float) -> dict[int, Forecast]:
    """Forecasts of the blocking rows, from each part's estimate on the current window alone (`age_s`
    old, its latest candidate record `quiet_s` ago)."""
    n_seg = plan.n_seg
    info = np.zeros(len(rows))
    n_now = np.zeros(len(rows))
    where = {int(r): j for j, r in enumerate(rows)}
    for test, members, s_arr, c_arr in inputs:
        pick, dest = [], []
        for m, (i, _, _) in enumerate(members):
            for seg in range(n_seg):
                j = where.get(i * n_seg + seg)
                if j is not None:
                    pick.append(m * n_seg + seg)
                    dest.append(j)
        if not pick:
            continue
        est = test.estimate(s_arr[pick][:, -1:], c_arr[pick][:, -1:])
        ok = np.isfinite(est.var) & (est.var > 0)
        np.add.at(info, dest, np.where(ok, 1.0 / np.where(ok, est.var, 1.0), 0.0))
        np.add.at(n_now, dest, np.where(ok, est.n_candidate, 0))
    found = forecast(combined.effect[rows], combined.var[rows], plan.bound[rows], plan.worse_if[rows] == "above",
                     alpha_within, plan.scale[rows], info, n_now, age_s, quiet_s,
                     combined.n_candidate[rows].astype(float))
    return {int(r): f for r, f in zip(rows, found)}


def rule(any_worse: ArrayLike, step_ready: ArrayLike, last_step: ArrayLike, promote_ok: ArrayLike,
         past_max: ArrayLike, rollback_on_inconclusive: ArrayLike) -> np.ndarray:
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


def decide(state: RolloutState, rc: RouteConfig, comparisons: list[Comparison], step_samples: int,  # noqa: C901 - the decision rule in its order (samples, time, worse, better); splitting hides it
           now: float | None = None, began: float | None = None) -> LastDecision | None:
    """The judge's verdict for a route in shadow or canary; None for other phases. `began`: when the
    step began (default `state.since`); its samples and time count from then."""
    now = time.time() if now is None else now
    if state.candidate is None or state.phase not in ("shadow", "canary"):
        return None
    ro = rc.rollout
    steps = ro.steps
    shadow = state.phase == "shadow"
    last = (not shadow) and state.step_index >= len(steps) - 1
    needed = ro.min_shadow_samples if shadow else ro.min_samples_per_step
    age = max(0.0, now - (state.since if began is None else began))
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
    lines = []
    if not step_ready:
        lines += _progress(step_samples, needed, age, ro.min_step_seconds, shadow, where)
        if shadow and rc.shadow.sample_rate == 0 and step_samples < needed:
            lines.append("shadow.sample_rate is 0: no shadow samples will come; promote by hand, or set "
                         "rollout.min_shadow_samples: 0")
    elif last:
        if not primary:
            lines.append(f"{where}: overall completion rate has fewer than {ro.min_samples_per_step} samples per arm")
        if pending:
            etas = [c.forecast.eta_s if c.forecast else None for c in pending]
            known = [e for e in etas if e is not None]
            when = (f"; promotion possible in ~{duration_text(max(known))} at this step's average traffic"
                    if len(known) == len(etas) else "")
            lines.append(f"{where}: waiting for non-inferiority in {len(pending)} of {len(gates)} comparisons{when}"
                         + _not_gating_yet(comparisons, rc))
            for c in _slowest_first(pending)[:MAX_HOLD_REASONS]:
                lines += [line for line in (c.forecast_reason(), c.reason()) if line]
            if len(pending) > MAX_HOLD_REASONS:
                lines.append(f"(+{len(pending) - MAX_HOLD_REASONS} more)")
    if past_max:
        lines.append(f"inconclusive past max_step_seconds ({ro.max_step_seconds:g} s); on_inconclusive: hold")
    if not lines:
        lines.append(f"{where}: holding")
    ev = [c.evidence() for c in (pending if step_ready else [c for c in comparisons if c.segment == "overall"])]
    return LastDecision(decision="hold", reasons=lines, evidence=ev, ts=now)


def _not_gating_yet(comparisons: list[Comparison], rc: RouteConfig) -> str:
    """The comparisons with data that will gate promotion too once both arms have enough samples:
    an ETA holds only if they show non-inferiority as well."""
    later = [c for c in comparisons if c.n > 0 and not gating(c, rc)]
    if not later:
        return ""
    segments = sorted({c.segment for c in later})
    return (f"; {len(later)} more comparisons (segment{'s' if len(segments) > 1 else ''} {', '.join(segments)}) "
            f"gate once both arms have {rc.rollout.min_samples_per_step} samples")


def _where(state: RolloutState, steps: list[float]) -> str:
    if state.phase == "shadow":
        return "shadow"
    i = state.step_index
    return f"step {i + 1}/{len(steps)} ({steps[i]:g}%)" if 0 <= i < len(steps) else f"step {i + 1}"


def _progress(samples: int, needed: int, age: float, min_s: float, shadow: bool, where: str | None = None) -> list[str]:
    kind = "shadow samples" if shadow else "candidate samples"
    prefix = f"{where}: " if where else ""
    return [f"{prefix}{samples}/{needed} {kind}, {min(age, min_s):.0f}/{min_s:g} s"]


def _slowest_first(cs: list[Comparison]) -> list[Comparison]:
    """Blocking comparisons, the furthest from being shown first: not reachable at the current effect,
    then the longest forecast, then the widest interval."""
    def key(c: Comparison) -> tuple:
        f = c.forecast
        width = (c.interval[1] - c.interval[0]) if c.interval else math.inf
        if f is None:
            return (1, 0.0, -width)
        if f.needed_n is None:
            return (0, 0.0, -width)
        return (1, -(f.eta_s if f.eta_s is not None else float(f.needed_n)), -width)
    return sorted(cs, key=key)


@dataclass
class Judgement:
    decision: LastDecision | None
    comparisons: list[Comparison]
    alpha_each: float
    budget: int
    step_samples: int
    alpha_within: float | None = None

    def report(self) -> dict:
        """report["judge"]: the verdict per metric and segment, with the forecast of each blocking one."""
        d = self.decision
        return {
            "decision": d.decision if d else None,
            "reasons": d.reasons if d else [],
            "alpha_per_comparison": self.alpha_each,       # rollback side: alpha / K
            "alpha_within": self.alpha_within,             # promotion side: each comparison at the full alpha
            "comparisons_budget": self.budget,
            "step_samples": self.step_samples,
            "counts": {name: sum(1 for c in self.comparisons if c.verdict == code)
                       for code, name in VERDICT_NAMES.items()},
            "comparisons": [c.as_dict() for c in self.comparisons],
        }


def judge(state: RolloutState, rc: RouteConfig, evidence: RouteEvidence, now: float | None = None,
          boundary: Boundary | None = None) -> Judgement:
    now = time.time() if now is None else now
    phase = state.phase if state.phase != "paused" else (state.paused_from or "canary")
    comparisons = evaluate(evidence, rc, boundary, now=now, forecast_in=_forecast_segments(state, rc, evidence))
    began = step_began(state)
    samples = evidence.step_samples(phase, began)
    decision = decide(state, rc, comparisons, samples, now, began)
    plan = _plan(rc)
    return Judgement(decision, comparisons, plan.alpha_each, plan.budget, samples, rc.rollout.alpha)


def _forecast_segments(state: RolloutState, rc: RouteConfig, evidence: RouteEvidence) -> list[str]:
    """The segments whose comparisons can block a promotion now, so get forecasts (§1: at the last
    step): all of them at the route's last step; with rollout.scope segment, those at their own last
    step with this evidence's candidate canaried (a pause keeps the step)."""
    last = len(rc.rollout.steps) - 1

    def at_last(phase: str, paused_from: str | None, step: int) -> bool:
        return (paused_from if phase == "paused" else phase) == "canary" and step >= last

    if state.scope == "segment":
        return [name for name, seg in state.segments.items()
                if seg.candidate == evidence.candidate and at_last(seg.phase, seg.paused_from, seg.step_index)]
    return evidence.segments if at_last(state.phase, state.paused_from, state.step_index) else []


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
