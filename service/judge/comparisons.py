"""The judge-test extension point: how one metric of two arms becomes an effect and an interval.

A `JudgeTest` turns the two arms' sufficient statistics (windows on axis −2,
fields on the last axis, any leading shape) into an `Estimate`; a `Boundary`
turns the estimate's variance into a one-sided radius; `interval` makes the
verdict. Adding a metric means adding a test here (and a line in `catalog.py`);
the hot path never sees it.

Implementations side by side, live (two independent arms, sessions as clusters):

* `ProportionTest` — difference of two proportions: completion rate, model
  failure rate (all causes and per cause), client retry rate, task success.
  Fields: (n, successes) or, with sessions, (n, x, Σ_j N_j², Σ_j X_j N_j, Σ_j X_j²).
* `LatencyExceedanceTest` — share of candidate calls slower than the stable's
  p95, against the stable's own 5 %. Fields: a latency histogram, optionally
  followed by the log-latency moments for sessions (n, Σy, Σy², Σ_j Y_j², Σ_j Y_j N_j, Σ_j N_j²).
* `CostRatioTest` — cost per completed request, as a log ratio.
  Fields: (n, ΣC, ΣC², ΣD, ΣCD, ΣD²), C and D per session.

and paired (shadow records: the same request answered by both models):

* `PairedMeanTest` — mean of per-record differences c − s: McNemar-style for
  binary outcomes (completion and failures against the stable asked again,
  agreement against the noise floor), and paired scores (similarity, judge
  preference, stability). Fields on both arms: (n, Σd, Σd², Σc, Σs).
* `PairedExceedanceTest` — the latency exceedance on pairs. Fields: stable a
  histogram, candidate three (its own, the pairs' minimum, the pairs' maximum),
  concatenated or on an axis of their own (…, 3, bins).
* `PairedCostRatioTest` — cost per completion on pairs. Fields: as
  `CostRatioTest`, the candidate's followed by (Σc c_s, Σc d_s, Σd c_s, Σd d_s).

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
COST_TAUS = (0.1, 0.03, 0.3, 1.0)  # log-ratio units

# Below this many observations in either arm no verdict is given (the normal
# approximation behind the boundary needs some data; "too little data" is a hold).
MIN_COUNT_FOR_VERDICT = 30


class JudgeTest(Protocol):
    # read-only members: the tests are frozen dataclasses
    @property
    def name(self) -> str: ...

    @property
    def ratio(self) -> bool:
        """The effect is a log ratio (arms' values are combined on the log scale)."""
        ...

    @property
    def taus(self) -> tuple[float, ...]:
        """Mixing scales of the boundary, in effect units (prior effect sizes)."""
        ...

    @property
    def weights(self) -> tuple[float, ...]:
        """Their prior weights (sum ≤ 1)."""
        ...

    @property
    def effect_range(self) -> tuple[float, float] | None:
        """Where the effect can lie (intervals are clipped to it)."""
        ...

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        """Arms' sufficient statistics (…, windows, fields) → one Estimate per leading element."""
        ...

    def no_events(self, stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
        """Per leading element: True where the metric never happened in either arm (nothing to judge)."""
        ...


class Boundary(Protocol):
    @property
    def name(self) -> str: ...  # read-only: the boundaries are frozen dataclasses

    def radius(self, var: np.ndarray, alpha: float, taus: tuple, weights: tuple) -> np.ndarray:
        """One-sided: the chance that the effect ever exceeds the estimate by more (or falls short
        of it by more) is at most `alpha`. `taus` are mixing scales (arrays broadcast with var)."""
        ...


@dataclass(frozen=True)
class MixtureBoundary:
    """Normal-mixture confidence sequence, one side at alpha: valid however often it is looked at."""

    name: str = "mixture"

    def radius(self, var: np.ndarray, alpha: float, taus: tuple, weights: tuple) -> np.ndarray:
        return stats.multi_scale_radius(var, stats.one_sided(alpha), taus, weights)


@dataclass(frozen=True)
class FixedBoundary:
    """Fixed-horizon z bound, one side at alpha: valid for a single look only (benchmark baseline)."""

    name: str = "fixed"

    def radius(self, var: np.ndarray, alpha: float, taus: tuple, weights: tuple) -> np.ndarray:
        return stats.fixed_radius(var, 2.0 * alpha)


def _no_events(stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    # A rate that is zero in both arms (a cause that never happened) is trivially within its margin.
    none: np.ndarray = (stable[..., 1].sum(axis=-1) == 0) & (candidate[..., 1].sum(axis=-1) == 0)
    return none


def _never(stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    return np.zeros(stable.shape[0], dtype=bool)


@dataclass(frozen=True)
class ProportionTest:
    name: str = "proportion_difference"
    taus: tuple[float, ...] = PROPORTION_TAUS
    weights: tuple[float, ...] = SCALE_WEIGHTS
    effect_range: tuple[float, float] | None = (-1.0, 1.0)
    ratio: bool = False

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        s = np.asarray(stable, dtype=float)
        c = np.asarray(candidate, dtype=float)
        deff = [stats.cluster_design_effect(*(a[..., i] for i in range(5))) if a.shape[-1] == 5 else 1.0
                for a in (s, c)]
        return stats.proportion_difference(s[..., 1], s[..., 0], c[..., 1], c[..., 0], deff[0], deff[1])

    no_events = staticmethod(_no_events)


@dataclass(frozen=True)
class LatencyExceedanceTest:
    edges: np.ndarray = field(default_factory=lambda: LATENCY_EDGES)
    q: float = 0.95
    name: str = "latency_exceedance"
    taus: tuple[float, ...] = PROPORTION_TAUS
    weights: tuple[float, ...] = SCALE_WEIGHTS
    effect_range: tuple[float, float] | None = (-1.0, 1.0)
    ratio: bool = False

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        bins = len(self.edges) - 1
        s = np.asarray(stable, dtype=float)
        c = np.asarray(candidate, dtype=float)
        deff = [stats.mean_design_effect(*(a[..., bins + i] for i in range(6))) if a.shape[-1] > bins else 1.0
                for a in (s, c)]
        return stats.share_above_reference_quantile(s[..., :bins], c[..., :bins], self.edges, self.q, *deff)

    no_events = staticmethod(_never)


@dataclass(frozen=True)
class CostRatioTest:
    name: str = "log_ratio_of_means"
    taus: tuple[float, ...] = COST_TAUS
    weights: tuple[float, ...] = SCALE_WEIGHTS
    effect_range: tuple[float, float] | None = None
    ratio: bool = True

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        return stats.log_ratio_of_means(stable, candidate)

    no_events = staticmethod(_never)


@dataclass(frozen=True)
class PairedMeanTest:
    """Mean of per-record differences candidate − stable (both arms carry the same pair fields)."""

    name: str = "paired_mean_difference"
    taus: tuple[float, ...] = PROPORTION_TAUS
    weights: tuple[float, ...] = SCALE_WEIGHTS
    effect_range: tuple[float, float] | None = (-1.0, 1.0)
    ratio: bool = False
    prior_sd: float = 1.0  # one pseudo-difference this far from the mean: never a zero variance

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        return stats.paired_mean_difference(candidate, self.prior_sd)

    def no_events(self, stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
        # fields (n, Σd, Σd², Σcandidate, Σstable): nothing ever happened on either side (a failure
        # cause that never occurred) is trivially within its margin
        none: np.ndarray = np.abs(candidate[..., 2:]).sum(axis=(-1, -2)) == 0
        return none


@dataclass(frozen=True)
class PairedExceedanceTest:
    edges: np.ndarray = field(default_factory=lambda: LATENCY_EDGES)
    q: float = 0.95
    name: str = "paired_latency_exceedance"
    taus: tuple[float, ...] = PROPORTION_TAUS
    weights: tuple[float, ...] = SCALE_WEIGHTS
    effect_range: tuple[float, float] | None = (-1.0, 1.0)
    ratio: bool = False

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        c = np.asarray(candidate, dtype=float)
        if c.shape[-1] != 3 * (len(self.edges) - 1):  # already (…, 3, bins)
            return stats.paired_share_above(stable, c, self.edges, self.q)
        return stats.paired_share_above(stable, c.reshape(*c.shape[:-1], 3, -1), self.edges, self.q)

    no_events = staticmethod(_never)


@dataclass(frozen=True)
class PairedCostRatioTest:
    name: str = "paired_log_ratio_of_means"
    taus: tuple[float, ...] = COST_TAUS
    weights: tuple[float, ...] = SCALE_WEIGHTS
    effect_range: tuple[float, float] | None = None
    ratio: bool = True

    def estimate(self, stable: np.ndarray, candidate: np.ndarray) -> Estimate:
        c = np.asarray(candidate, dtype=float)
        return stats.log_ratio_of_means(stable, c[..., :6], c[..., 6:])

    no_events = staticmethod(_never)


# Latency histogram: [0, 1 ms), 240 log bins of ~5.9 % from 1 ms to 1000 s, [1000 s, ∞).
LATENCY_EDGES: np.ndarray = np.concatenate([[0.0], np.geomspace(1e-3, 1e3, 241), [np.inf]])


@dataclass(frozen=True, slots=True)
class Interval:
    estimate: Estimate
    lo: np.ndarray
    hi: np.ndarray
    verdict: np.ndarray  # WORSE / WITHIN / INCONCLUSIVE


def within_scale(test: JudgeTest, bound: float | np.ndarray) -> np.ndarray:
    """The mixing scale of the promotion side: the margin (in effect units), where that end must cross."""
    scale = np.abs(np.asarray(bound, dtype=float))
    return np.where(scale > 0, scale, test.taus[0])


def interval(test: JudgeTest, boundary: Boundary, est: Estimate, alpha_worse: float, alpha_within: float,
             bound: float | np.ndarray, worse_if: Literal["above", "below"] | np.ndarray,
             min_count: int = MIN_COUNT_FOR_VERDICT,
             within_scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> Interval:
    """Interval and verdict of an estimate against a non-inferiority bound (in effect units).

    worse_if="above": the candidate is worse when the effect exceeds `bound`
    (failure rates, latency, log cost ratio); "below": when it falls under
    `bound` (completion rate, task success, agreement; bound is then −margin).
    The interval's two ends answer the two one-sided questions, each at its own
    level. "Worse" needs the whole interval past the bound, so the end on the
    better side decides a rollback: it is at `alpha_worse` (any comparison may
    trigger a rollback, so alpha is split). "Within" needs the whole interval on
    the good side, so the end on the worse side decides promotion: it is at
    `alpha_within` (promotion needs every required comparison, an
    intersection-union test, so each takes the full alpha), with the mixing scale
    at the margin, where that end must cross (`within_scales` overrides it:
    (taus, weights)).
    worse ⇔ the whole interval is on the wrong side of the bound; within ⇔ the
    whole interval is on the right side. `bound` and `worse_if` may be arrays
    over the leading shape (several metrics of one test judged in one call).
    """
    r_worse = boundary.radius(est.var, alpha_worse, test.taus, test.weights)
    r_within = boundary.radius(est.var, alpha_within, *(within_scales or ((within_scale(test, bound),), (1.0,))))
    above = np.asarray(worse_if) == "above"
    lo = est.effect - np.where(above, r_worse, r_within)
    hi = est.effect + np.where(above, r_within, r_worse)
    if test.effect_range is not None:  # a confidence set may always be intersected with the parameter space
        lo = np.clip(lo, *test.effect_range)
        hi = np.clip(hi, *test.effect_range)
    enough = (est.n_stable >= min_count) & (est.n_candidate >= min_count) & np.isfinite(est.var)
    worse = np.where(above, lo > bound, hi < bound)
    within = np.where(above, hi < bound, lo > bound)
    verdict = np.where(enough & worse, WORSE, np.where(enough & within, WITHIN, INCONCLUSIVE))
    return Interval(est, lo, hi, verdict)


def compare(test: JudgeTest, boundary: Boundary, stable: np.ndarray, candidate: np.ndarray, alpha: float,
            bound: float | np.ndarray, worse_if: Literal["above", "below"] | np.ndarray,
            min_count: int = MIN_COUNT_FOR_VERDICT, alpha_within: float | None = None) -> Interval:
    """`interval` of the test's estimate from the two arms; both ends at `alpha` unless `alpha_within`."""
    return interval(test, boundary, test.estimate(stable, candidate), alpha,
                    alpha if alpha_within is None else alpha_within, bound, worse_if, min_count)
