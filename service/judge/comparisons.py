"""The judge-test extension point: how one metric of two arms becomes an effect and an interval.

A `JudgeTest` turns the two arms' sufficient statistics (windows on axis −2,
fields on the last axis, any leading shape) into an `Estimate`; a `Boundary`
turns the estimate's variance into an interval radius. Adding a metric means
adding a test here (and a line in `catalog.py`); the hot path never sees it.

Implementations side by side:

* `ProportionTest` — difference of two proportions: completion rate, model
  failure rate (all causes and per cause), client retry rate, task success,
  agreement against the noise floor. Fields: (n, successes).
* `LatencyExceedanceTest` — share of candidate calls slower than the stable's
  p95, against the stable's own 5 %. Fields: a latency histogram.
* `CostRatioTest` — cost per completed request, as a log ratio.
  Fields: (n, Σcost, Σcost², Σcompleted, Σcost·completed).

Boundaries: `MixtureBoundary` (anytime-valid, what the judge uses) and
`FixedBoundary` (a fixed-horizon z interval, kept only as the benchmark's
"peeking" baseline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from service.judge import stats
from service.judge.stats import Estimate

WORSE = 2
WITHIN = 1
INCONCLUSIVE = 0
VERDICT_NAMES = {WORSE: "worse", WITHIN: "within", INCONCLUSIVE: "inconclusive"}

# Mixing scales (prior effect sizes) of the boundary: most weight on the effects a margin is
# about (a few points), some on small and on large effects, so that a 40-point collapse on
# 50 requests is caught as fast as a 4-point drop on 2,000 (stats.multi_scale_radius).
PROPORTION_TAUS = (0.03, 0.01, 0.1, 0.3)
SCALE_WEIGHTS = (0.7, 0.1, 0.1, 0.1)

# Below this many observations in either arm no verdict is given (the normal
# approximation behind the boundary needs some data; "too little data" is a hold).
MIN_COUNT_FOR_VERDICT = 30


class JudgeTest(Protocol):
    name: str
    taus: tuple[float, ...]     # mixing scales of the boundary, in effect units (prior effect sizes)
    weights: tuple[float, ...]  # their prior weights (sum ≤ 1)
    effect_range: tuple[float, float] | None  # where the effect can lie (intervals are clipped to it)

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        """Arms' sufficient statistics (…, windows, fields) → one Estimate per leading element."""
        ...

    def no_events(self, stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
        """Per leading element: True where the metric never happened in either arm (nothing to judge)."""
        ...


class Boundary(Protocol):
    name: str

    def radius(self, var: np.ndarray, alpha: float, test: JudgeTest) -> np.ndarray: ...


@dataclass(frozen=True)
class MixtureBoundary:
    """Two-sided normal-mixture confidence sequence: valid however often it is looked at."""

    name: str = "mixture"

    def radius(self, var: np.ndarray, alpha: float, test: JudgeTest) -> np.ndarray:
        return stats.multi_scale_radius(var, alpha, test.taus, test.weights)


@dataclass(frozen=True)
class FixedBoundary:
    """Fixed-horizon z interval: valid for a single look only (benchmark baseline)."""

    name: str = "fixed"

    def radius(self, var: np.ndarray, alpha: float, test: JudgeTest) -> np.ndarray:
        return stats.fixed_radius(var, alpha)


@dataclass(frozen=True)
class ProportionTest:
    name: str = "proportion_difference"
    taus: tuple[float, ...] = PROPORTION_TAUS
    weights: tuple[float, ...] = SCALE_WEIGHTS
    effect_range: tuple[float, float] | None = (-1.0, 1.0)

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        s = np.asarray(stable, dtype=float)
        c = np.asarray(candidate, dtype=float)
        return stats.proportion_difference(s[..., 1], s[..., 0], c[..., 1], c[..., 0])

    def no_events(self, stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
        # A rate that is zero in both arms (a cause that never happened) is trivially within its margin.
        return (stable[..., 1].sum(axis=-1) == 0) & (candidate[..., 1].sum(axis=-1) == 0)


@dataclass(frozen=True)
class LatencyExceedanceTest:
    edges: np.ndarray = field(default_factory=lambda: LATENCY_EDGES)
    q: float = 0.95
    name: str = "latency_exceedance"
    taus: tuple[float, ...] = PROPORTION_TAUS
    weights: tuple[float, ...] = SCALE_WEIGHTS
    effect_range: tuple[float, float] | None = (-1.0, 1.0)

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        return stats.share_above_reference_quantile(stable, candidate, self.edges, self.q)

    def no_events(self, stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
        return np.zeros(stable.shape[0], dtype=bool)


@dataclass(frozen=True)
class CostRatioTest:
    name: str = "log_ratio_of_means"
    taus: tuple[float, ...] = (0.1, 0.03, 0.3, 1.0)
    weights: tuple[float, ...] = SCALE_WEIGHTS
    effect_range: tuple[float, float] | None = None

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        return stats.log_ratio_of_means(stable, candidate)

    def no_events(self, stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
        return np.zeros(stable.shape[0], dtype=bool)


# Latency histogram: [0, 1 ms), 240 log bins of ~5.9 % from 1 ms to 1000 s, [1000 s, ∞).
LATENCY_EDGES = np.concatenate([[0.0], np.geomspace(1e-3, 1e3, 241), [np.inf]])


@dataclass(frozen=True, slots=True)
class Interval:
    estimate: Estimate
    lo: np.ndarray
    hi: np.ndarray
    verdict: np.ndarray  # WORSE / WITHIN / INCONCLUSIVE


def compare(test: JudgeTest, boundary: Boundary, stable: np.ndarray, candidate: np.ndarray, alpha: float,
            bound: float | np.ndarray, worse_if: Literal["above", "below"] | np.ndarray,
            min_count: int = MIN_COUNT_FOR_VERDICT) -> Interval:
    """Estimate, interval and verdict against a non-inferiority bound (in effect units).

    worse_if="above": the candidate is worse when the effect exceeds `bound`
    (failure rates, latency, log cost ratio); "below": when it falls under
    `bound` (completion rate, task success, agreement; bound is then −margin).
    worse ⇔ the whole interval is on the wrong side of the bound; within ⇔ the
    whole interval is on the right side. `bound` and `worse_if` may be arrays
    over the leading shape (several metrics of one test judged in one call).
    """
    est = test.estimate(stable, candidate)
    r = boundary.radius(est.var, alpha, test)
    lo = est.effect - r
    hi = est.effect + r
    if test.effect_range is not None:  # a confidence set may always be intersected with the parameter space
        lo = np.clip(lo, *test.effect_range)
        hi = np.clip(hi, *test.effect_range)
    enough = (est.n_stable >= min_count) & (est.n_candidate >= min_count) & np.isfinite(r)
    above = np.asarray(worse_if) == "above"
    worse = np.where(above, lo > bound, hi < bound)
    within = np.where(above, hi < bound, lo > bound)
    verdict = np.where(enough & worse, WORSE, np.where(enough & within, WITHIN, INCONCLUSIVE))
    return Interval(est, lo, hi, verdict)
