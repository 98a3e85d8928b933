"""Shadow statistics: candidate vs stable on the shadow sample, per segment, with 95% intervals.

`ShadowStats` takes EvaluationRecords (`add`, idempotent by request_id) and `summary()` returns
the shadow part of a route's report (`report["shadow"]`, rendered by `modelcanary report ROUTE`;
`shadow_table(summary)` / `failures_table(summary)` build the rich tables). Keep one ShadowStats
per route and rollout (a new candidate starts a new one). Memory is bounded: counters, a
reservoir of latencies per segment and side (`RESERVOIR` values), three example ids per cause,
and the last `SEEN_MEMORY` request ids for de-duplication.

Where "stable" comes from:
- latency: the stable side of the record's latency pair (`record.stable_latency_s`: the stable
  model asked again when the noise floor is on, else the live answer);
- cost: the live stable answer of the same request (`record.stable_cost_usd`);
- completion and failure rates: the stable model asked again on the same request (the noise
  floor replay, `record.stable_again`) when records carry it; otherwise the live answers, which
  are completed by construction (only requests the stable model served are shadowed), so stable
  reads 1.0 there. `summary()["stable_outcomes"]` says which ("replay" or "live").
- agreement: `candidate_vs_stable` (candidate vs the live answer) against `noise_floor` (the stable
  model asked again vs its live answer); `gap` = candidate − noise floor.

Candidate latency is over completed candidate calls (failed calls are in the failure rates), and
cost per completion is the candidate's total cost over its completions.

summary() format (all numbers are floats or None when there is no data):

    {
      "schema": "modelcanary.shadow_summary/v1",
      "route": str | None, "stable_model": str | None, "candidate_model": str | None,
      "n": int,                        # records counted (after de-duplication)
      "confidence": 0.95,
      "stable_outcomes": "replay" | "live",
      "segments": {                    # "overall" first, then segments by name
        "<segment>": {
          "n": int,
          "completion_rate": {"stable": P, "candidate": P},
          "failure_rate": {"<cause>": {"stable": P, "candidate": P}, ...},   # causes seen on either side
          "agreement": {"candidate_vs_stable": P, "noise_floor": P, "gap": D},
          "latency_p50_s": {"stable": Q, "candidate": Q},
          "latency_p95_s": {"stable": Q, "candidate": Q},
          "cost_per_completion_usd": {"stable": R, "candidate": R},
          "evaluations": {"<evaluator>": {"pass": int, "fail": int, "error": int,
                                          "pass_rate": P, "mean_score": float | None}},
          "examples": {"<cause>": [request_id, ...]},   # up to 3 per candidate failure cause
          "quality": {...},            # similarity, pairwise judge, stability (service.judge.quality)
        },
      },
    }
    P (proportion)  = {"value", "count", "n", "interval": [lo, hi] | None}    Wilson score interval
    D (difference)  = {"value", "interval": [lo, hi] | None}                   Newcombe hybrid score
    Q (quantile)    = {"value", "n", "interval": [lo, hi] | None}              distribution-free order-
                      statistic interval over the reservoir sample; an end is None when the sample is
                      too small to bound it
    R (cost ratio)  = {"value", "n", "interval": [lo, hi] | None}              delta method; n = completions
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scipy.stats import binom

from service.judge.quality import Quality
from service.recent import Recent
from service.records import EvaluationRecord

if TYPE_CHECKING:
    from rich.table import Table

CONFIDENCE = 0.95
Z = 1.959963984540054
RESERVOIR = 2048
EXAMPLES = 3
SEEN_MEMORY = 200_000
OVERALL = "overall"


# ---- intervals -------------------------------------------------------------------------------------


def wilson(count: int, n: int, z: float = Z) -> tuple[float, float] | None:
    """Wilson score interval for a proportion count/n."""
    if n <= 0:
        return None
    p = count / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe(k1: int, n1: int, k2: int, n2: int, z: float = Z) -> tuple[float, float] | None:
    """Newcombe's hybrid score interval for p1 - p2 (independent samples; conservative when paired
    answers are positively correlated)."""
    a, b = wilson(k1, n1, z), wilson(k2, n2, z)
    if a is None or b is None:
        return None
    p1, p2 = k1 / n1, k2 / n2
    d = p1 - p2
    lo = d - math.sqrt((p1 - a[0]) ** 2 + (b[1] - p2) ** 2)
    hi = d + math.sqrt((a[1] - p1) ** 2 + (p2 - b[0]) ** 2)
    return max(-1.0, lo), min(1.0, hi)


def quantile_interval(values: list[float], q: float, confidence: float = CONFIDENCE
                      ) -> tuple[float | None, tuple[float | None, float | None] | None]:
    """(sample quantile, order-statistic interval) of the q-quantile of unsorted `values`.

    The interval [x_(l), x_(u)] covers the true quantile with probability >= confidence whatever the
    distribution (ranks from the Binomial(n, q) distribution). An end is None when n is too small.
    """
    n = len(values)
    if n == 0:
        return None, None
    xs = sorted(values)
    pos = q * (n - 1)
    i = int(math.floor(pos))
    est = xs[i] + (xs[min(i + 1, n - 1)] - xs[i]) * (pos - i)
    lo_rank, hi_rank = _ranks(n, q, confidence)
    lo = xs[lo_rank - 1] if lo_rank >= 1 else None
    hi = xs[hi_rank - 1] if hi_rank <= n else None
    return est, (lo, hi)


@functools.lru_cache(maxsize=4096)
def _ranks(n: int, q: float, confidence: float) -> tuple[int, int]:
    """The 1-indexed order statistics bounding the q-quantile of n values (cached: n stops growing once
    a reservoir is full, and scipy's binom.ppf costs ~0.2 ms a call)."""
    tail = (1 - confidence) / 2
    lo_rank = int(binom.ppf(tail, n, q))          # P(Bin <= lo_rank - 1) <= tail
    hi_rank = int(binom.ppf(1 - tail, n, q)) + 1
    return lo_rank, hi_rank


# ---- accumulators ----------------------------------------------------------------------------------


class Reservoir:
    """A uniform sample of at most `capacity` values of a stream (algorithm R, seeded)."""

    __slots__ = ("capacity", "seen", "values", "_rng")

    def __init__(self, capacity: int = RESERVOIR, seed: int = 0):
        self.capacity = capacity
        self.seen = 0
        self.values: list[float] = []
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.capacity:
            self.values.append(value)
            return
        j = self._rng.randrange(self.seen)
        if j < self.capacity:
            self.values[j] = value


@dataclass(slots=True)
class RatioSums:
    """Running sums for a ratio of totals sum(c) / sum(d) and its delta-method interval."""

    n: int = 0
    c: float = 0.0
    d: float = 0.0
    cc: float = 0.0
    cd: float = 0.0
    dd: float = 0.0

    def add(self, c: float, d: float) -> None:
        self.n += 1
        self.c += c
        self.d += d
        self.cc += c * c
        self.cd += c * d
        self.dd += d * d

    def summary(self) -> dict:
        if self.d <= 0:
            return {"value": None, "n": int(self.d), "interval": None}
        r = self.c / self.d
        interval = None
        if self.n >= 2:
            sse = max(0.0, self.cc - 2 * r * self.cd + r * r * self.dd)
            dbar = self.d / self.n
            se = math.sqrt(sse / (self.n - 1) / self.n) / dbar
            interval = [max(0.0, r - Z * se), r + Z * se]
        return {"value": r, "n": int(self.d), "interval": interval}


def proportion(count: int, n: int) -> dict:
    interval = wilson(count, n)
    return {"value": count / n if n else None, "count": count, "n": n,
            "interval": list(interval) if interval else None}


def _quantile(res: Reservoir, q: float) -> dict:
    est, interval = quantile_interval(res.values, q)
    return {"value": est, "n": res.seen, "interval": list(interval) if interval else None}


@dataclass(slots=True)
class _Evaluator:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    score_sum: float = 0.0
    scored: int = 0

    def add(self, passed: bool | None, score: float | None) -> None:
        if passed is True:
            self.passed += 1
        elif passed is False:
            self.failed += 1
        else:
            self.errors += 1
        if score is not None:
            self.scored += 1
            self.score_sum += score


@dataclass
class Segment:
    n: int = 0
    cand_completed: int = 0
    cand_causes: dict[str, int] = field(default_factory=dict)
    replay_n: int = 0
    replay_completed: int = 0
    replay_causes: dict[str, int] = field(default_factory=dict)
    agree_n: int = 0
    agree: int = 0
    floor_n: int = 0
    floor: int = 0
    cand_latency: Reservoir = field(default_factory=lambda: Reservoir(seed=1))
    stable_latency: Reservoir = field(default_factory=lambda: Reservoir(seed=2))
    cand_cost: RatioSums = field(default_factory=RatioSums)
    stable_cost: RatioSums = field(default_factory=RatioSums)
    evaluations: dict[str, _Evaluator] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    quality: Quality = field(default_factory=Quality)

    def add(self, r: EvaluationRecord) -> None:
        self.n += 1
        self._add_candidate(r)
        self._add_stable(r)
        self.quality.add(r)
        a = r.agreement
        if a.candidate_vs_stable is not None:
            self.agree_n += 1
            self.agree += int(a.candidate_vs_stable)
        if a.stable_vs_stable is not None:
            self.floor_n += 1
            self.floor += int(a.stable_vs_stable)
        for e in r.evaluations:
            self.evaluations.setdefault(e.name, _Evaluator()).add(e.passed, e.score)

    def _add_candidate(self, r: EvaluationRecord) -> None:
        cand = r.candidate
        completed = cand.outcome == "completed"
        if completed:
            self.cand_completed += 1
            if cand.latency_s is not None:
                self.cand_latency.add(cand.latency_s)
        elif cand.cause:
            self.cand_causes[cand.cause] = self.cand_causes.get(cand.cause, 0) + 1
            ids = self.examples.setdefault(cand.cause, [])
            if len(ids) < EXAMPLES:
                ids.append(r.request_id)
        self.cand_cost.add(cand.cost_usd or 0.0, 1.0 if completed else 0.0)

    def _add_stable(self, r: EvaluationRecord) -> None:
        again = r.stable_again
        if again is not None:
            self.replay_n += 1
            if again.outcome == "completed":
                self.replay_completed += 1
            elif again.cause:
                self.replay_causes[again.cause] = self.replay_causes.get(again.cause, 0) + 1
        if r.stable_latency_s is not None:
            self.stable_latency.add(r.stable_latency_s)
        if r.stable_cost_usd is not None:
            self.stable_cost.add(r.stable_cost_usd, 1.0)

    def summary(self, replay: bool) -> dict:
        if replay:
            stable_n, stable_completed, stable_causes = self.replay_n, self.replay_completed, self.replay_causes
        else:  # live answers: completed by construction
            stable_n, stable_completed, stable_causes = self.n, self.n, {}
        causes = sorted(set(self.cand_causes) | set(stable_causes))
        gap = newcombe(self.agree, self.agree_n, self.floor, self.floor_n)
        return {
            "n": self.n,
            "completion_rate": {"stable": proportion(stable_completed, stable_n),
                                "candidate": proportion(self.cand_completed, self.n)},
            "failure_rate": {c: {"stable": proportion(stable_causes.get(c, 0), stable_n),
                                 "candidate": proportion(self.cand_causes.get(c, 0), self.n)} for c in causes},
            "agreement": {
                "candidate_vs_stable": proportion(self.agree, self.agree_n),
                "noise_floor": proportion(self.floor, self.floor_n),
                "gap": {"value": self.agree / self.agree_n - self.floor / self.floor_n
                        if self.agree_n and self.floor_n else None, "interval": list(gap) if gap else None},
            },
            "latency_p50_s": {"stable": _quantile(self.stable_latency, 0.5),
                              "candidate": _quantile(self.cand_latency, 0.5)},
            "latency_p95_s": {"stable": _quantile(self.stable_latency, 0.95),
                              "candidate": _quantile(self.cand_latency, 0.95)},
            "cost_per_completion_usd": {"stable": self.stable_cost.summary(), "candidate": self.cand_cost.summary()},
            "evaluations": {
                name: {"pass": e.passed, "fail": e.failed, "error": e.errors,
                       "pass_rate": proportion(e.passed, e.passed + e.failed),
                       "mean_score": e.score_sum / e.scored if e.scored else None}
                for name, e in sorted(self.evaluations.items())
            },
            "examples": {c: list(ids) for c, ids in sorted(self.examples.items())},
            "quality": self.quality.summary(),
        }


class ShadowStats:
    """Shadow evaluation statistics of one route (records of other routes are ignored when `route` is set)."""

    def __init__(self, route: str | None = None, seen_memory: int = SEEN_MEMORY):
        self.route = route
        self.stable_model: str | None = None
        self.candidate_model: str | None = None
        self._seen = Recent(seen_memory)
        self._segments: dict[str, Segment] = {OVERALL: Segment()}
        self.n = 0
        self._replayed = 0

    def add(self, record: EvaluationRecord) -> None:
        """Count one record; a request_id already counted is ignored."""
        if self.route is not None and record.route != self.route:
            return
        rid = record.request_id
        if not self._seen.add(rid):
            return
        self.n += 1
        self.stable_model, self.candidate_model = record.stable_model, record.candidate_model
        if record.stable_again is not None:
            self._replayed += 1
        self._segments[OVERALL].add(record)
        segment = record.segment or "chat"
        if segment == OVERALL:
            return
        seg = self._segments.get(segment)
        if seg is None:
            seg = self._segments[segment] = Segment()
        seg.add(record)

    def summary(self) -> dict:
        replay = self._replayed > 0
        names = [OVERALL] + sorted(s for s in self._segments if s != OVERALL)
        return {
            "schema": "modelcanary.shadow_summary/v1",
            "route": self.route,
            "stable_model": self.stable_model,
            "candidate_model": self.candidate_model,
            "n": self.n,
            "confidence": CONFIDENCE,
            "stable_outcomes": "replay" if replay else "live",
            "segments": {name: self._segments[name].summary(replay) for name in names},
        }


# ---- rendering (modelcanary report) ----------------------------------------------------------------


def _pct(p: dict | None) -> str:
    if not p or p.get("value") is None:
        return "–"
    iv = p.get("interval")
    text = f"{100 * p['value']:.1f}%"
    if iv:
        text += f" [{100 * iv[0]:.1f}, {100 * iv[1]:.1f}]"
    return text


def _num(q: dict | None, fmt: str) -> str:
    if not q or q.get("value") is None:
        return "–"
    iv = q.get("interval")
    text = format(q["value"], fmt)
    if iv:
        lo = "–" if iv[0] is None else format(iv[0], fmt)
        hi = "–" if iv[1] is None else format(iv[1], fmt)
        text += f" [{lo}, {hi}]"
    return text


def shadow_table(summary: dict) -> Table:
    """A rich Table: one row per segment, stable vs candidate with 95% intervals."""
    from rich.table import Table

    title = (f"shadow: {summary.get('candidate_model') or '?'} vs {summary.get('stable_model') or '?'} "
             f"on {summary.get('n', 0)} sampled requests (95% intervals)")
    table = Table(title=title, show_lines=False)
    for col in ("segment", "n", "completion stable", "completion candidate", "agreement candidate",
                "noise floor", "p50 s stable", "p50 s candidate", "p95 s stable", "p95 s candidate",
                "$/completion stable", "$/completion candidate"):
        table.add_column(col, justify="left" if col == "segment" else "right")
    for name, row in (summary.get("segments") or {}).items():
        table.add_row(
            name, str(row["n"]),
            _pct(row["completion_rate"]["stable"]), _pct(row["completion_rate"]["candidate"]),
            _pct(row["agreement"]["candidate_vs_stable"]), _pct(row["agreement"]["noise_floor"]),
            _num(row["latency_p50_s"]["stable"], ".3f"), _num(row["latency_p50_s"]["candidate"], ".3f"),
            _num(row["latency_p95_s"]["stable"], ".3f"), _num(row["latency_p95_s"]["candidate"], ".3f"),
            _num(row["cost_per_completion_usd"]["stable"], ".6f"),
            _num(row["cost_per_completion_usd"]["candidate"], ".6f"),
        )
    return table


def failures_table(summary: dict) -> Table:
    """A rich Table: failure rate per cause and segment, with example request ids."""
    from rich.table import Table

    table = Table(title="shadow failures by cause (candidate vs stable, 95% intervals)")
    for col in ("segment", "cause", "stable", "candidate", "examples"):
        table.add_column(col)
    for name, row in (summary.get("segments") or {}).items():
        for cause, rates in row["failure_rate"].items():
            table.add_row(name, cause, _pct(rates["stable"]), _pct(rates["candidate"]),
                          ", ".join(row["examples"].get(cause, [])))
    return table
