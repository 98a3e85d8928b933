"""The judge's statistics: known cases, interval coverage, type-I error under continuous peeking."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.judge import stats
from service.judge.comparisons import (
    INCONCLUSIVE,
    WITHIN,
    WORSE,
    CostRatioTest,
    FixedBoundary,
    LatencyExceedanceTest,
    MixtureBoundary,
    ProportionTest,
    compare,
)

EDGES = np.concatenate([[0.0], np.geomspace(0.05, 8.0, 60), [np.inf]])


# ---- known cases ---------------------------------------------------------------------------------

def test_mixture_radius_closed_form():
    v, a, tau = 1e-4, 0.05, 0.02
    expected = math.sqrt(v * (v + tau**2) / tau**2 * (2 * math.log(1 / a) + math.log((v + tau**2) / v)))
    assert stats.mixture_radius(v, a, tau) == pytest.approx(expected)
    r = stats.mixture_radius(np.array([np.inf, 1e-3, 1e-4, 1e-5, 0.0]), 0.01, 0.02)
    assert r[0] == np.inf and r[-1] == 0.0
    assert r[1] > r[2] > r[3] > 0  # shrinks as information accrues


def test_mixture_is_wider_than_fixed_and_grows_slowly_with_smaller_alpha():
    v = np.array([1e-4])
    assert stats.mixture_radius(v, 0.01, 0.02) > stats.fixed_radius(v, 0.01)
    # Bonferroni over 150 comparisons costs a log factor, not a factor of 150
    assert stats.mixture_radius(v, 0.01 / 150, 0.02) / stats.mixture_radius(v, 0.01, 0.02) < 1.5


def test_multi_scale_radius_is_the_tightest_component_at_its_share_of_alpha():
    v = np.array([1e-6, 1e-4, 1e-2])
    taus, weights = (0.03, 0.01, 0.1, 0.3), (0.7, 0.1, 0.1, 0.1)
    r = stats.multi_scale_radius(v, 0.01, taus, weights)
    parts = np.stack([stats.mixture_radius(v, 0.01 * w, t) for t, w in zip(taus, weights)])
    assert np.allclose(r, parts.min(axis=0))
    # with little data (large variance) the large scale wins by far: a collapse on a few
    # dozen requests is not held back by a boundary tuned for 3-point effects
    assert r[2] < 0.5 * stats.mixture_radius(v[2], 0.01, 0.03)
    with pytest.raises(ValueError):
        stats.multi_scale_radius(v, 0.01, (0.1, 0.2), (0.8, 0.8))


def test_optimal_tau_minimises_radius_at_its_variance():
    v_star = 5e-5
    tau = stats.optimal_tau(v_star, 0.01)
    r = stats.mixture_radius(v_star, 0.01, tau)
    for other in (tau / 3, tau * 3):
        assert stats.mixture_radius(v_star, 0.01, other) > r


def test_proportion_difference_known_values():
    e = stats.proportion_difference(np.array([[90.0]]), np.array([[100.0]]), np.array([[40.0]]), np.array([[50.0]]))
    assert e.stable[0] == pytest.approx(0.9)
    assert e.candidate[0] == pytest.approx(0.8)
    assert e.effect[0] == pytest.approx(-0.1)
    assert e.n_stable[0] == 100 and e.n_candidate[0] == 50
    # Agresti–Caffo rates, each floored at the pooled rate's variance
    ps, pc, pooled = 91 / 102, 41 / 52, 131 / 152
    v = pooled * (1 - pooled)
    assert e.var[0] == pytest.approx(max(ps * (1 - ps), v) / 100 + max(pc * (1 - pc), v) / 50)


def test_windows_are_not_pooled_simpsons_paradox():
    # Within each window both arms are equal; the weights differ between windows and the rate
    # drifts over time. Pooling arms across windows would show a 4-point gap; the stratified
    # estimate shows none.
    n_s = np.array([9900.0, 5000.0])
    n_c = np.array([100.0, 5000.0])
    x_s = np.array([0.99, 0.95]) * n_s
    x_c = np.array([0.99, 0.95]) * n_c
    e = stats.proportion_difference(x_s, n_s, x_c, n_c)
    pooled = x_c.sum() / n_c.sum() - x_s.sum() / n_s.sum()
    assert abs(pooled) > 0.015
    assert e.effect == pytest.approx(0.0, abs=1e-12)


def test_empty_arm_gives_no_estimate():
    e = stats.proportion_difference(np.array([5.0]), np.array([10.0]), np.array([0.0]), np.array([0.0]))
    assert np.isnan(e.effect) and np.isinf(e.var) and e.n_candidate == 0


def test_histogram_quantile_and_share_above():
    rng = np.random.default_rng(3)
    x = rng.lognormal(math.log(0.3), 0.6, 200_000)
    h = np.histogram(x, EDGES)[0].astype(float)
    for q in (0.5, 0.95):
        assert stats.histogram_quantile(h, EDGES, q) == pytest.approx(np.quantile(x, q), rel=0.02)
    thr = np.quantile(x, 0.9)
    assert stats.histogram_share_above(h, EDGES, thr) / len(x) == pytest.approx(0.1, abs=0.003)
    assert np.isnan(stats.histogram_quantile(np.zeros_like(h), EDGES, 0.5))
    assert stats.histogram_share_above(h, EDGES, np.inf) == 0


def test_latency_exceedance_detects_a_heavier_tail():
    rng = np.random.default_rng(4)
    s = np.histogram(rng.lognormal(math.log(0.3), 0.6, 20_000), EDGES)[0][None, :].astype(float)
    c = np.histogram(rng.lognormal(math.log(0.3), 0.8, 20_000), EDGES)[0][None, :].astype(float)
    e = stats.share_above_reference_quantile(s, c, EDGES)
    assert e.stable == pytest.approx(0.05)
    # P(Z > 1.645 * 0.6 / 0.8) ≈ 0.109
    assert e.candidate == pytest.approx(0.109, abs=0.01)


def test_log_ratio_of_means_known_ratio():
    # stable: 1000 requests at $0.002, 900 completed; candidate: 1000 at $0.003, 900 completed
    def arm(n, cost, done):
        d = np.r_[np.ones(done), np.zeros(n - done)]
        c = np.full(n, cost)
        return np.array([[n, c.sum(), (c * c).sum(), d.sum(), (c * d).sum()]])
    e = stats.log_ratio_of_means(arm(1000, 0.002, 900), arm(1000, 0.003, 900))
    assert math.exp(float(e.effect)) == pytest.approx(1.5)
    assert float(e.stable) == pytest.approx(0.002 / 0.9)
    assert float(e.candidate) == pytest.approx(0.003 / 0.9)


def test_compare_verdicts_against_a_margin():
    test = ProportionTest()
    stable = np.array([[[10_000.0, 9_500.0]]])      # (1 segment, 1 window, (n, x))
    worse = np.array([[[5_000.0, 4_300.0]]])        # 86 %
    equal = np.array([[[10_000.0, 9_500.0]]])
    few = np.array([[[10.0, 5.0]]])
    b = MixtureBoundary()
    assert compare(test, b, stable, worse, 0.01, -0.01, "below").verdict[0] == WORSE
    assert compare(test, b, stable, equal, 0.01, -0.02, "below").verdict[0] == WITHIN
    assert compare(test, b, stable, few, 0.01, -0.01, "below").verdict[0] == INCONCLUSIVE


# ---- simulation: coverage and type-I error under continuous monitoring -----------------------------

def _peek_proportions(p_s, p_c, runs, looks, per_look, share_c, alpha, boundary, margin=0.0, seed=0,
                      weights=None):
    """Fraction of runs in which the judge *ever* (at any of `looks`) calls the candidate worse
    than `margin`, and in which the interval ever misses the true difference."""
    rng = np.random.default_rng(seed)
    W = 1 if weights is None else len(weights)
    n_s, x_s, n_c, x_c = (np.zeros((runs, W)) for _ in range(4))
    ever_worse = np.zeros(runs, dtype=bool)
    ever_miss = np.zeros(runs, dtype=bool)
    test = ProportionTest()
    for t in range(looks):
        w = 0 if weights is None else min(t * W // looks, W - 1)
        share = share_c if weights is None else weights[w]
        a = rng.poisson(per_look * share, runs)
        b = rng.poisson(per_look * (1 - share), runs)
        n_c[:, w] += a
        x_c[:, w] += rng.binomial(a, p_c)
        n_s[:, w] += b
        x_s[:, w] += rng.binomial(b, p_s)
        s = np.stack([n_s, x_s], axis=-1)
        c = np.stack([n_c, x_c], axis=-1)
        res = compare(test, boundary, s, c, alpha, -margin, "below")
        ever_worse |= res.verdict == WORSE
        ok = (res.estimate.n_candidate >= 30) & (res.estimate.n_stable >= 30)
        ever_miss |= ok & ((res.lo > p_c - p_s) | (res.hi < p_c - p_s))
    return ever_worse.mean(), ever_miss.mean()


@pytest.mark.parametrize("p, share", [(0.95, 0.05), (0.95, 0.5), (0.99, 0.05), (0.6, 0.25)])
def test_type_one_error_holds_under_continuous_peeking(p, share):
    alpha = 0.05
    worse, miss = _peek_proportions(p, p, runs=2000, looks=200, per_look=200, share_c=share, alpha=alpha,
                                    boundary=MixtureBoundary())
    # 2000 runs: the binomial sd at 0.05 is 0.005; allow two of them
    assert worse <= alpha + 0.01
    assert miss <= alpha + 0.01


def test_peeking_inflates_the_fixed_horizon_test_but_not_ours():
    ours, _ = _peek_proportions(0.95, 0.95, runs=2000, looks=200, per_look=200, share_c=0.5, alpha=0.05,
                                boundary=MixtureBoundary(), seed=1)
    naive, _ = _peek_proportions(0.95, 0.95, runs=2000, looks=200, per_look=200, share_c=0.5, alpha=0.05,
                                 boundary=FixedBoundary(), seed=1)
    assert ours <= 0.06
    assert naive > 2 * 0.05 / 2  # one side of a two-sided 5 % test is 2.5 % at one look; peeking exceeds 5 %


def test_coverage_with_a_real_difference_and_changing_weights():
    # candidate 3 points worse, canary weight ramps 1 % → 5 % → 25 % → 50 % over the looks
    _, miss = _peek_proportions(0.95, 0.92, runs=2000, looks=200, per_look=400, share_c=None, alpha=0.05,
                                boundary=MixtureBoundary(), weights=[0.01, 0.05, 0.25, 0.5], seed=2)
    assert miss <= 0.06


def test_false_non_inferiority_is_bounded():
    # truth: candidate exactly 1 point worse (on the margin) → "within 1 point" must rarely be claimed
    rng = np.random.default_rng(5)
    runs, looks = 2000, 150
    n_s, x_s, n_c, x_c = (np.zeros((runs, 1)) for _ in range(4))
    ever_within = np.zeros(runs, dtype=bool)
    for _ in range(looks):
        a = rng.poisson(150, runs)
        b = rng.poisson(150, runs)
        n_c[:, 0] += a
        x_c[:, 0] += rng.binomial(a, 0.94)
        n_s[:, 0] += b
        x_s[:, 0] += rng.binomial(b, 0.95)
        res = compare(ProportionTest(), MixtureBoundary(), np.stack([n_s, x_s], -1), np.stack([n_c, x_c], -1),
                      0.05, -0.01, "below")
        ever_within |= res.verdict == WITHIN
    assert ever_within.mean() <= 0.06


def test_latency_exceedance_type_one_error_under_peeking():
    rng = np.random.default_rng(6)
    runs, looks, alpha = 1000, 100, 0.05
    cdf = np.diff(np.r_[0.0, np.clip(_lognorm_cdf(EDGES[1:-1], 0.3, 0.6), 0, 1), 1.0])
    hs = np.zeros((runs, 1, len(cdf)))
    hc = np.zeros((runs, 1, len(cdf)))
    ever = np.zeros(runs, dtype=bool)
    test = LatencyExceedanceTest(edges=EDGES)
    for _ in range(looks):
        hs[:, 0] += rng.poisson(150 * cdf, (runs, len(cdf)))
        hc[:, 0] += rng.poisson(50 * cdf, (runs, len(cdf)))
        ever |= compare(test, MixtureBoundary(), hs, hc, alpha, 0.0, "above").verdict == WORSE
    assert ever.mean() <= alpha + 0.015


def test_cost_ratio_coverage_under_peeking():
    rng = np.random.default_rng(7)
    runs, looks, alpha = 1000, 100, 0.05
    true_log_ratio = math.log((0.003 / 0.9) / (0.002 / 0.95))
    arms = [np.zeros((runs, 1, 5)) for _ in range(2)]
    miss = np.zeros(runs, dtype=bool)
    for _ in range(looks):
        for arm, (mean_cost, p_done, n) in zip(arms, ((0.002, 0.95, 60), (0.003, 0.9, 40))):
            c = rng.gamma(2.0, mean_cost / 2.0, (runs, n))
            d = (rng.random((runs, n)) < p_done).astype(float)
            arm[:, 0] += np.stack([np.full(runs, n), c.sum(1), (c * c).sum(1), d.sum(1), (c * d).sum(1)], -1)
        res = compare(CostRatioTest(), MixtureBoundary(), arms[0], arms[1], alpha, math.log(1.25), "above")
        miss |= (res.lo > true_log_ratio) | (res.hi < true_log_ratio)
    assert miss.mean() <= alpha + 0.015


def _lognorm_cdf(x, median, sigma):
    from scipy import stats as st
    return st.norm.cdf((np.log(x) - math.log(median)) / sigma)
