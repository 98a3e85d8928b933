"""The judge's statistics: known cases, interval coverage, type-I error under continuous peeking,
paired shadow records, sessions, and how sources combine."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.judge import stats
from service.judge.comparisons import (
    INCONCLUSIVE,
    PROPORTION_TAUS,
    SCALE_WEIGHTS,
    WITHIN,
    WORSE,
    CostRatioTest,
    FixedBoundary,
    LatencyExceedanceTest,
    MixtureBoundary,
    PairedCostRatioTest,
    PairedExceedanceTest,
    PairedMeanTest,
    ProportionTest,
    compare,
    interval,
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
        return np.array([[n, c.sum(), (c * c).sum(), d.sum(), (c * d).sum(), d.sum()]])
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

PROMOTION_GATE = 300


def _peek_proportions(p_s, p_c, runs, looks, per_look, share_c, alpha, boundary, margin=0.0, seed=0,
                      weights=None):
    """Fraction of runs in which the judge *ever* (at any of `looks`) calls the candidate worse
    than `margin`, and in which the interval ever misses the true difference — on its worse side
    (the truth above it: a false alarm) or on its better side (the truth below it: a false "within"),
    each one-sided at alpha. The better end only decides promotion, which needs PROMOTION_GATE
    observations per arm (min_samples_per_step), so it is counted from there."""
    rng = np.random.default_rng(seed)
    W = 1 if weights is None else len(weights)
    n_s, x_s, n_c, x_c = (np.zeros((runs, W)) for _ in range(4))
    ever_worse = np.zeros(runs, dtype=bool)
    ever_miss = np.zeros((2, runs), dtype=bool)
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
        n_min = np.minimum(res.estimate.n_candidate, res.estimate.n_stable)
        ever_miss |= np.stack([(n_min >= 30) & (res.hi < p_c - p_s), (n_min >= PROMOTION_GATE) & (res.lo > p_c - p_s)])
    return ever_worse.mean(), ever_miss.mean(axis=1).max()


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
    arms = [np.zeros((runs, 1, 6)) for _ in range(2)]
    miss = np.zeros(runs, dtype=bool)
    for _ in range(looks):
        for arm, (mean_cost, p_done, n) in zip(arms, ((0.002, 0.95, 60), (0.003, 0.9, 40))):
            c = rng.gamma(2.0, mean_cost / 2.0, (runs, n))
            d = (rng.random((runs, n)) < p_done).astype(float)
            arm[:, 0] += np.stack([np.full(runs, n), c.sum(1), (c * c).sum(1), d.sum(1), (c * d).sum(1), d.sum(1)], -1)
        res = compare(CostRatioTest(), MixtureBoundary(), arms[0], arms[1], alpha, math.log(1.25), "above")
        miss |= (res.lo > true_log_ratio) | (res.hi < true_log_ratio)
    assert miss.mean() <= alpha + 0.015


def _lognorm_cdf(x, median, sigma):
    from scipy import stats as st
    return st.norm.cdf((np.log(x) - math.log(median)) / sigma)


# ---- one-sided levels, paired records, sessions, combining sources ---------------------------------------

def test_one_sided_level_is_the_two_sided_boundary_at_2_alpha():
    assert stats.one_sided(0.01) == pytest.approx(0.02 / 1.01)
    v = np.array([1e-5])
    one = MixtureBoundary().radius(v, 0.01, PROPORTION_TAUS, SCALE_WEIGHTS)
    two = stats.multi_scale_radius(v, 0.01, PROPORTION_TAUS, SCALE_WEIGHTS)
    assert one < two  # one side at α needs less than both sides at α


def test_intervals_end_at_their_own_level_each_side():
    # "below" metric: the worse end (above the estimate) at alpha_worse, the better end at alpha_within
    est = stats.Estimate(*(np.array([x]) for x in (0.95, 0.95, 0.0, 1e-5, 5000, 5000)))
    res = interval(ProportionTest(), MixtureBoundary(), est, 0.01 / 150, 0.01, -0.01, "below")
    up, down = float(res.hi[0] - 0.0), float(0.0 - res.lo[0])
    assert up > down > 0
    assert down == pytest.approx(float(stats.mixture_radius(1e-5, stats.one_sided(0.01), 0.01)))
    # an "above" metric mirrors it
    res2 = interval(ProportionTest(), MixtureBoundary(), est, 0.01 / 150, 0.01, 0.01, "above")
    assert float(res2.hi[0]) == pytest.approx(down) and float(-res2.lo[0]) == pytest.approx(up)


def test_variance_for_radius_inverts_the_boundary():
    d = np.array([0.004, 0.01, 0.03])
    v = stats.variance_for_radius(d, 0.0198, np.array([0.01, 0.01, 0.05]))
    assert np.allclose(stats.mixture_radius(v, 0.0198, np.array([0.01, 0.01, 0.05])), d, rtol=1e-3)
    assert np.isnan(stats.variance_for_radius(np.array([-0.01, 0.0]), 0.01, 0.01)).all()


def _pairs(n11, n01, n10, n00):
    """Fields (n, Σd, Σd², Σc, Σs) of binary pairs: c candidate ok, s stable (asked again) ok."""
    n = n11 + n01 + n10 + n00
    return np.array([[[n, n01 - n10, n01 + n10, n11 + n01, n11 + n10]]], dtype=float)


def test_paired_binary_outcomes_are_mcnemars_comparison():
    f = _pairs(880, 3, 8, 109)          # 1000 requests, 11 discordant
    e = PairedMeanTest().estimate(f, f)
    assert e.effect[0] == pytest.approx(-0.005)
    assert e.stable[0] == pytest.approx(0.888) and e.candidate[0] == pytest.approx(0.883)
    # only the discordant pairs carry variance: (Σd² − (Σd)²/n + prior²) / (n + 1) per pair
    assert e.var[0] == pytest.approx((11 - 25 / 1000 + 1) / 1001 / 1000)
    # the same margins as two independent arms would give a ~20× wider variance
    indep = stats.proportion_difference(np.array([[888.0]]), np.array([[1000.0]]), np.array([[883.0]]),
                                        np.array([[1000.0]]))  # (1 element, 1 window)
    assert indep.var[0] > 15 * e.var[0]


def test_paired_binary_outcomes_keep_alpha_under_peeking():
    # hard requests fail for both (correlated pairs), candidate as good as the stable: never worse than 0
    rng = np.random.default_rng(11)
    runs, looks, alpha = 2000, 150, 0.05
    f = np.zeros((runs, 1, 5))
    ever = np.zeros(runs, dtype=bool)
    for _ in range(looks):
        m = 100
        hard = rng.random((runs, m)) < 0.1
        p = np.where(hard, 0.5, 0.98)
        s, c = rng.random((runs, m)) < p, rng.random((runs, m)) < p
        d = c.astype(float) - s
        f[:, 0] += np.stack([np.full(runs, m), d.sum(1), (d * d).sum(1), c.sum(1), s.sum(1)], -1)
        ever |= compare(PairedMeanTest(), MixtureBoundary(), f, f, alpha, 0.0, "below").verdict == WORSE
    assert ever.mean() <= alpha + 0.01


def test_paired_latency_exceedance():
    rng = np.random.default_rng(12)
    n = 20_000
    shared = rng.lognormal(math.log(0.3), 0.5, n)          # the request's own size: both sides
    s = shared * rng.lognormal(0, 0.3, n)
    for scale, expected in ((1.0, 0.0), (1.3, None)):
        c = shared * rng.lognormal(0, 0.3, n) * scale
        hists = [np.histogram(x, EDGES)[0] for x in (s, c, np.minimum(s, c), np.maximum(s, c))]
        stable = np.array(hists[0], dtype=float)[None, None]
        cand = np.concatenate(hists[1:]).astype(float)[None, None]
        e = PairedExceedanceTest(edges=EDGES).estimate(stable, cand)
        unpaired = stats.share_above_reference_quantile(stable, cand[..., :len(EDGES) - 1], EDGES)
        assert e.effect[0] == pytest.approx(unpaired.effect[0], abs=0.005)
        if expected is not None:
            assert abs(e.effect[0]) < 0.01
        else:
            assert e.effect[0] > 0.05
        # the shared size cancels: pairs need fewer requests for the same precision
        assert e.var[0] < 0.8 * unpaired.var[0]


def test_paired_cost_ratio_uses_the_covariance_of_the_pairs():
    rng = np.random.default_rng(13)
    n = 5000
    size = rng.gamma(2.0, 0.001, n)                       # cost follows the request's size on both sides
    cs, cc = size * 1.0, size * 1.2 * rng.lognormal(0, 0.05, n)
    dc = (rng.random(n) < 0.95).astype(float)

    def arm(c, d):  # (1 element, 1 window, fields)
        return np.array([[[n, c.sum(), (c * c).sum(), d.sum(), (c * d).sum(), (d * d).sum()]]])
    ds = np.ones(n)
    cross = np.array([[[(cc * cs).sum(), (cc * ds).sum(), (dc * cs).sum(), (dc * ds).sum()]]])
    paired = PairedCostRatioTest().estimate(arm(cs, ds), np.concatenate([arm(cc, dc), cross], axis=-1))
    unpaired = CostRatioTest().estimate(arm(cs, ds), arm(cc, dc))
    assert paired.effect[0] == pytest.approx(unpaired.effect[0])
    assert math.exp(paired.effect[0]) == pytest.approx((cc.sum() / dc.sum()) / (cs.sum() / n))
    assert paired.var[0] < 0.3 * unpaired.var[0]


def test_design_effect_of_sessions():
    rng = np.random.default_rng(14)
    sessions, m, icc = 3000, 20, 0.2
    ab = 1 / icc - 1
    p = rng.beta(0.95 * ab, 0.05 * ab, sessions)
    x = rng.binomial(m, p).astype(float)
    n = np.full(sessions, float(m))
    deff = stats.cluster_design_effect(n.sum(), x.sum(), (n * n).sum(), (x * n).sum(), (x * x).sum())
    assert float(deff) == pytest.approx(1 + (m - 1) * icc, rel=0.15)
    # each request its own session: exactly 1
    y = (rng.random(5000) < 0.95).astype(float)
    assert float(stats.cluster_design_effect(5000.0, y.sum(), 5000.0, y.sum(), y.sum())) == pytest.approx(1.0)


def _session_alarms(clustered: bool, seed: int) -> float:
    """A/A with sticky 20-request sessions (ICC 0.2), 1:1, watched 100 times: how often 'worse'."""
    rng = np.random.default_rng(seed)
    runs, looks, m, alpha = 1000, 100, 20, 0.05
    ab = 1 / 0.2 - 1
    arms = [np.zeros((runs, 1, 5)) for _ in range(2)]
    ever = np.zeros(runs, dtype=bool)
    for _ in range(looks):
        for arm in arms:
            p = rng.beta(0.95 * ab, 0.05 * ab, (runs, 5))
            x = rng.binomial(m, p).astype(float)
            arm[:, 0] += np.stack([np.full(runs, 5.0 * m), x.sum(1), np.full(runs, 5.0 * m * m), m * x.sum(1),
                                   (x * x).sum(1)], -1)
        s, c = (a if clustered else a[..., :2] for a in arms)
        ever |= compare(ProportionTest(), MixtureBoundary(), s, c, alpha, 0.0, "below").verdict == WORSE
    return float(ever.mean())


def test_sessions_keep_false_alarms_at_alpha_only_when_clustered():
    naive = _session_alarms(clustered=False, seed=15)
    clustered = _session_alarms(clustered=True, seed=15)
    assert naive > 0.1          # requests treated as independent: far more false alarms than α = 5 %
    assert clustered <= 0.05 + 0.015


def test_sources_are_combined_by_inverse_variance():
    a = stats.Estimate(*(np.array([x]) for x in (0.95, 0.94, -0.01, 4e-5, 1000, 1000)))
    b = stats.Estimate(*(np.array([x]) for x in (0.97, 0.97, 0.0, 1e-5, 400, 400)))
    e = stats.combine_estimates([a, b])
    assert e.effect[0] == pytest.approx((-0.01 / 4e-5 + 0.0 / 1e-5) / (1 / 4e-5 + 1 / 1e-5))
    assert e.var[0] == pytest.approx(1 / (1 / 4e-5 + 1 / 1e-5))
    assert e.candidate[0] - e.stable[0] == pytest.approx(e.effect[0])
    assert e.n_candidate[0] == 1400
    empty = stats.Estimate(*(np.array([x]) for x in (np.nan, np.nan, np.nan, np.inf, 0, 0)))
    assert stats.combine_estimates([a, empty]).effect[0] == pytest.approx(-0.01)


@pytest.mark.parametrize("latency", [0.05, 0.3, 1.05, 1.5, 2.25, 4.0])
def test_values_that_do_not_vary_have_the_sessions_factor_only(latency):
    """Σ(y − ȳ)² and the clustered sum are both 0 for equal values: as the evidence adds them up, in
    floats, both are rounding, and their ratio is no design effect (it reached 130 at 1.05 s)."""
    from service.judge.comparisons import LATENCY_EDGES
    from service.judge.evidence import _S_WIDTH, ArmAcc

    arm, sessions = ArmAcc(), {}
    for i in range(2000):  # 100 sessions of 20 requests, every one as fast as the others
        arm.add_request(sessions.setdefault(i // 20, [0.0] * _S_WIDTH), "completed", None, None, latency, 0.001)
    x = arm.vector()[ArmAcc.FIELDS["latency"]][None, None, :]
    first = len(LATENCY_EDGES) - 1  # the histogram's bins come first
    deff = float(stats.mean_design_effect(*(x[..., first + i] for i in range(6))).ravel()[0])
    assert deff == pytest.approx(100 / 99)
