"""Decision quality: our anytime-valid per-segment judge against three common canary judges.

Simulates per-request outcome streams with known truth (vectorised numpy, no
HTTP) and runs, on the same simulated traffic, four judges:

  ours       service.judge: normal-mixture confidence sequences per metric and
             segment, concurrent windows, alpha split over the route's
             comparisons, the DESIGN §9 rules (the same code the controller runs)
  flagger    a fixed threshold per 1-minute interval (completion ≥ 94 %, p95 ≤
             0.96 s) on the canary alone; 5 failed checks → rollback; each
             passing interval advances one step; promote after the last step
  kayenta    per-interval aggregates (completion rate, p95) of canary and
             stable, two-sided Mann–Whitney at Kayenta's default 95 %
             confidence, re-run every interval; any metric significantly worse
             → rollback; a step lasts ≥ 5 intervals and ≥ 300 canary samples
  z-test     our rules and windows with a fixed-horizon two-proportion z
             interval instead of the confidence sequence (peeks every batch)

Traffic: 2,000 requests/min (Poisson), segments chat 60 % / json 30 % /
tools 10 %, stable completion 95 %, latency log-normal (median 0.3 s, p95
0.8 s); plan steps 1-5-25-50 %, min_samples_per_step 300, min_step_seconds 60,
max_step_seconds 3600, alpha 0.01, default margins except
latency_p95_exceedance 0.03 (with the default 0.05 a +30 % p95 is inside the
margin by design). Judges look every 15 s batch (Flagger/Kayenta every minute).

    python benchmarks/judge_quality.py [--runs N] [--quick] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.config import RouteConfig  # noqa: E402
from service.judge import stats as jstats  # noqa: E402
from service.judge.catalog import alpha_per_comparison, comparisons_budget  # noqa: E402
from service.judge.comparisons import (  # noqa: E402
    WITHIN,
    WORSE,
    FixedBoundary,
    LatencyExceedanceTest,
    MixtureBoundary,
    ProportionTest,
    compare,
)
from service.judge.decide import HOLD, PROMOTE, ROLLBACK, STEP, rule  # noqa: E402

# ---- traffic and plan ------------------------------------------------------------------------------

RATE_PER_MIN = 2000
BATCH_S = 15.0
INTERVAL_BATCHES = 4                      # 1-minute intervals for Flagger / Kayenta
SEGMENTS = ("chat", "json", "tools")
SHARES = np.array([0.6, 0.3, 0.1])
STABLE_COMPLETION = 0.95
STABLE_LAT = (0.3, 0.8)                   # median, p95 seconds
Z95 = st.norm.ppf(0.95)
HORIZON_MIN = 100

ROUTE = RouteConfig.model_validate({
    "stable": "stable-m", "candidate": "candidate-m",
    "rollout": {"steps": [1, 5, 25, 50], "min_samples_per_step": 300, "min_step_seconds": 60,
                "max_step_seconds": 3600, "on_inconclusive": "hold", "alpha": 0.01,
                "margins": {"latency_p95_exceedance": 0.03}},
})
RO = ROUTE.rollout
STEPS = np.array(RO.steps) / 100.0
# Latency histogram for the simulation: coarse in the body, 5 % log bins around the p95 where
# the comparison happens (the service uses 5.9 % log bins everywhere; the functions take any edges).
EDGES = np.concatenate([[0.0, 0.1, 0.2, 0.3, 0.4], np.geomspace(0.45, 2.0, 31), [3.0, 5.0, np.inf]])
NB = len(EDGES) - 1

FLAGGER_MIN_COMPLETION = STABLE_COMPLETION - RO.margins.completion_rate
FLAGGER_MAX_P95 = STABLE_LAT[1] * 1.2
FLAGGER_THRESHOLD = 5
KAYENTA_CONF = 0.95
KAYENTA_MIN_INTERVALS = 5


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    completion: tuple[float, float, float]          # candidate completion per segment
    latency: tuple[float, float] = STABLE_LAT       # candidate median, p95
    truth: str = "same"                             # same | worse | better


SCENARIOS = [
    Scenario("aa", "A/A (95% completion)", (0.95, 0.95, 0.95)),
    Scenario("drop5", "completion −5 pts", (0.90, 0.90, 0.90), truth="worse"),
    Scenario("drop2", "completion −2 pts", (0.93, 0.93, 0.93), truth="worse"),
    Scenario("latency", "p95 latency +30%, median same", (0.95, 0.95, 0.95), (0.3, 0.8 * 1.3), truth="worse"),
    Scenario("tools", "tools −8 pts, others +1.5 (aggregate +0.55)", (0.965, 0.965, 0.87), truth="worse"),
    Scenario("better", "better everywhere (+1.5 pts, −10% latency)", (0.965, 0.965, 0.965), (0.27, 0.72),
             truth="better"),
]


def bin_probs(median: float, p95: float) -> np.ndarray:
    sigma = math.log(p95 / median) / Z95
    cdf = st.norm.cdf((np.log(np.where(EDGES > 0, EDGES, 1e-300)) - math.log(median)) / sigma)
    cdf[0], cdf[-1] = 0.0, 1.0
    return np.diff(cdf)


class Traffic:
    """Per batch, per run: completed-latency histograms and failure counts, per segment and arm."""

    def __init__(self, scn: Scenario, rng: np.random.Generator):
        self.rng = rng
        self.p = np.stack([np.full(3, STABLE_COMPLETION), np.array(scn.completion)], axis=1)      # (S, A)
        self.pb = np.stack([bin_probs(*STABLE_LAT), bin_probs(*scn.latency)], axis=0)            # (A, B)
        self.lam = RATE_PER_MIN * BATCH_S / 60.0

    def draw(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """w: canary weight per run (R,) → hist (R, S, A, B), failed (R, S, A)."""
        arm_w = np.stack([1.0 - w, w], axis=1)                                   # (R, A)
        lam = self.lam * SHARES[None, :, None] * arm_w[:, None, :]                # (R, S, A)
        lam_ok = lam * self.p[None]
        hist = self.rng.poisson(lam_ok[..., None] * self.pb[None, None])          # (R, S, A, B)
        failed = self.rng.poisson(lam * (1.0 - self.p[None]))
        return hist, failed


# ---- results ------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    decision: np.ndarray            # HOLD / PROMOTE / ROLLBACK per run
    canary_samples: np.ndarray      # at the decision (or at the horizon)
    minutes: np.ndarray

    def summary(self) -> dict:
        runs = len(self.decision)
        rb = self.decision == ROLLBACK
        pr = self.decision == PROMOTE

        def med(mask, arr):
            return float(np.median(arr[mask])) if mask.any() else None

        lo, hi = clopper_pearson(int(rb.sum()), runs)
        return {"runs": runs, "rollback_rate": float(rb.mean()), "rollback_ci95": [lo, hi],
                "promote_rate": float(pr.mean()), "hold_rate": float((self.decision == HOLD).mean()),
                "median_canary_samples_to_rollback": med(rb, self.canary_samples),
                "median_minutes_to_rollback": med(rb, self.minutes),
                "median_canary_samples_to_promote": med(pr, self.canary_samples),
                "median_minutes_to_promote": med(pr, self.minutes)}


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    a = (1 - level) / 2
    lo = 0.0 if k == 0 else float(st.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(st.beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


# ---- our judge (and the peeking z-test, which differs only in the boundary) ----------------------------

def run_sequential(scn: Scenario, runs: int, rng: np.random.Generator, boundary, alpha_each: float,
                   single: bool = False) -> Outcome:
    """The service's tests and rule over `runs` rollouts at once.

    single=True is the calibration row: one comparison (overall completion rate) at alpha_each
    with margin 0 (is the candidate worse at all?) and no promotion, watched every batch for the
    whole horizon — the setting in which peeking inflates a fixed-horizon test's error."""
    traffic = Traffic(scn, rng)
    W, S, A = len(STEPS), len(SEGMENTS), 2
    prop = ProportionTest()
    lat = LatencyExceedanceTest(edges=EDGES)
    ids = np.arange(runs)
    # arm first, then segment (overall last), then window: each arm's (segment, window, fields)
    # block is contiguous, the layout the tests take
    n = np.zeros((runs, A, S + 1, W))
    x = np.zeros((runs, A, S + 1, W))
    hist = np.zeros((runs, A, S + 1, W, NB))
    segs = slice(0, S + 1) if not single else slice(S, S + 1)  # all segments and overall, or overall only
    step = np.zeros(runs, dtype=int)
    step_start = np.zeros(runs)
    in_step = np.zeros(runs)
    canary_total = np.zeros(runs)
    out_dec = np.full(runs, HOLD)
    out_samples = np.zeros(runs)
    out_min = np.full(runs, float(HORIZON_MIN))
    need = RO.min_samples_per_step
    batches = int(HORIZON_MIN * 60 / BATCH_S)
    for b in range(1, batches + 1):
        t = b * BATCH_S
        r = np.arange(len(ids))
        h_new, f_new = traffic.draw(STEPS[step])             # (R, S, A, B), (R, S, A)
        h_new = h_new.transpose(0, 2, 1, 3)                    # (R, A, S, B)
        c_new = h_new.sum(axis=-1)
        t_new = c_new + f_new.transpose(0, 2, 1)
        for seg_idx, (c_add, t_add, h_add) in ((slice(0, S), (c_new, t_new, h_new)),
                                               (S, (c_new.sum(2), t_new.sum(2), h_new.sum(2)))):
            n[r, :, seg_idx, step] += t_add
            x[r, :, seg_idx, step] += c_add
            hist[r, :, seg_idx, step] += h_add
        in_step += t_new[:, 1].sum(axis=1)
        canary_total += t_new[:, 1].sum(axis=1)

        # arms as (R, segments, W, fields)
        arm = [np.stack([n[:, a, segs], x[:, a, segs]], axis=-1) for a in range(A)]
        margin = 0.0 if single else RO.margins.completion_rate
        comp = compare(prop, boundary, arm[0], arm[1], alpha_each, -margin, "below")
        verdicts = [comp.verdict]
        gates = [np.minimum(comp.estimate.n_candidate, comp.estimate.n_stable) >= need]
        if not single:
            lc = compare(lat, boundary, hist[:, 0], hist[:, 1], alpha_each, RO.margins.latency_p95_exceedance,
                         "above")
            verdicts.append(lc.verdict)
            gates.append(np.minimum(lc.estimate.n_candidate, lc.estimate.n_stable) >= need)
        v = np.concatenate(verdicts, axis=1)
        g = np.concatenate(gates, axis=1)
        any_worse = (v == WORSE).any(axis=1)
        primary = g[:, S] if not single else g[:, 0]  # overall completion rate
        promote_ok = primary & ((v == WITHIN) | ~g).all(axis=1) & (not single)
        age = t - step_start
        step_ready = (in_step >= need) & (age >= RO.min_step_seconds)
        last = step == len(STEPS) - 1
        past_max = age > RO.max_step_seconds
        code = rule(any_worse, step_ready, last, promote_ok, past_max, RO.on_inconclusive == "rollback")
        stepping = code == STEP
        step[stepping] += 1
        step_start[stepping] = t
        in_step[stepping] = 0
        # on_inconclusive hold past max_step_seconds at the last step: a final hold, stop simulating
        done = (code == ROLLBACK) | (code == PROMOTE) | (last & past_max & (code == HOLD) & (not single))
        if done.any():
            gid = ids[done]
            out_dec[gid] = code[done]
            out_samples[gid] = canary_total[done]
            out_min[gid] = t / 60.0
            keep = ~done
            ids, n, x, hist = ids[keep], n[keep], x[keep], hist[keep]
            step, step_start, in_step, canary_total = step[keep], step_start[keep], in_step[keep], canary_total[keep]
            if len(ids) == 0:
                break
    out_samples[ids] = canary_total
    return Outcome(out_dec, out_samples, out_min)


# ---- Flagger-style -------------------------------------------------------------------------------------

def _settle(decided: np.ndarray, samples: np.ndarray, minutes: np.ndarray, active: np.ndarray,
            canary_total: np.ndarray, minute: int, rollback: np.ndarray, promote: np.ndarray) -> None:
    """Record the runs that rolled back or promoted this minute and retire them (`active` in place)."""
    for mask, code in ((rollback, ROLLBACK), (promote, PROMOTE)):
        decided[mask] = code
        samples[mask] = canary_total[mask]
        minutes[mask] = minute
        active &= ~mask


def run_flagger(scn: Scenario, runs: int, rng: np.random.Generator) -> Outcome:
    traffic = Traffic(scn, rng)
    step = np.zeros(runs, dtype=int)
    failed_checks = np.zeros(runs, dtype=int)
    decided = np.full(runs, HOLD)
    samples = np.zeros(runs)
    minutes = np.full(runs, float(HORIZON_MIN))
    canary_total = np.zeros(runs)
    active = np.ones(runs, dtype=bool)
    for minute in range(1, HORIZON_MIN + 1):
        n_i = np.zeros(runs)
        x_i = np.zeros(runs)
        h_i = np.zeros((runs, NB))
        for _ in range(INTERVAL_BATCHES):
            h, f = traffic.draw(STEPS[np.minimum(step, len(STEPS) - 1)])
            c = h[:, :, 1].sum(axis=1)                  # canary, all segments (R, B)
            n_i += c.sum(axis=1) + f[:, :, 1].sum(axis=1)
            x_i += c.sum(axis=1)
            h_i += c
        canary_total += np.where(active, n_i, 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = x_i / n_i
        p95 = jstats.histogram_quantile(h_i, EDGES, 0.95)
        ok = (n_i > 0) & (rate >= FLAGGER_MIN_COMPLETION) & (p95 <= FLAGGER_MAX_P95)
        fail = active & ~ok
        failed_checks += fail
        rollback = active & (failed_checks >= FLAGGER_THRESHOLD)
        passed = active & ok
        promote = passed & (step == len(STEPS) - 1)
        step = np.where(passed & ~promote, step + 1, step)
        _settle(decided, samples, minutes, active, canary_total, minute, rollback, promote)
        if not active.any():
            break
    samples[active] = canary_total[active]
    return Outcome(decided, samples, minutes)


# ---- Kayenta-style -------------------------------------------------------------------------------------

def run_kayenta(scn: Scenario, runs: int, rng: np.random.Generator) -> Outcome:
    traffic = Traffic(scn, rng)
    max_k = HORIZON_MIN
    step = np.zeros(runs, dtype=int)
    k = np.zeros(runs, dtype=int)                     # intervals in the current step
    in_step = np.zeros(runs)
    series = {key: np.full((runs, max_k), np.nan) for key in ("rate_s", "rate_c", "p95_s", "p95_c")}
    decided = np.full(runs, HOLD)
    samples = np.zeros(runs)
    minutes = np.full(runs, float(HORIZON_MIN))
    canary_total = np.zeros(runs)
    active = np.ones(runs, dtype=bool)
    r = np.arange(runs)
    for minute in range(1, HORIZON_MIN + 1):
        n_i = np.zeros((runs, 2))
        x_i = np.zeros((runs, 2))
        h_i = np.zeros((runs, 2, NB))
        for _ in range(INTERVAL_BATCHES):
            h, f = traffic.draw(STEPS[step])
            c = h.sum(axis=1)                           # (R, A, B)
            n_i += c.sum(axis=-1) + f.sum(axis=1)
            x_i += c.sum(axis=-1)
            h_i += c
        canary_total += np.where(active, n_i[:, 1], 0)
        in_step += n_i[:, 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = x_i / n_i
        p95 = jstats.histogram_quantile(h_i, EDGES, 0.95)
        slot = np.minimum(k, max_k - 1)
        series["rate_s"][r, slot], series["rate_c"][r, slot] = rate[:, 0], rate[:, 1]
        series["p95_s"][r, slot], series["p95_c"][r, slot] = p95[:, 0], p95[:, 1]
        k += 1
        worse = np.zeros(runs, dtype=bool)
        half = (1 - KAYENTA_CONF) / 2
        for kk in np.unique(k[active]):
            if kk < 3:
                continue
            sel = active & (k == kk)
            for key, alt in (("rate", "less"), ("p95", "greater")):
                a = np.nan_to_num(series[f"{key}_c"][sel, :kk], nan=0.0 if key == "rate" else 1e9)
                b = np.nan_to_num(series[f"{key}_s"][sel, :kk], nan=0.0 if key == "rate" else 1e9)
                p = st.mannwhitneyu(a, b, alternative=alt, axis=1).pvalue
                worse[np.flatnonzero(sel)[p < half]] = True
        rollback = active & worse
        ready = active & ~worse & (k >= KAYENTA_MIN_INTERVALS) & (in_step >= RO.min_samples_per_step)
        promote = ready & (step == len(STEPS) - 1)
        advance = ready & ~promote
        step[advance] += 1
        k[advance] = 0
        in_step[advance] = 0
        for key in series:
            series[key][advance] = np.nan
        _settle(decided, samples, minutes, active, canary_total, minute, rollback, promote)
        if not active.any():
            break
    samples[active] = canary_total[active]
    return Outcome(decided, samples, minutes)


# ---- driver --------------------------------------------------------------------------------------------

@dataclass
class Judge:
    name: str
    title: str
    run: object
    scenarios: tuple[str, ...] = field(default_factory=lambda: tuple(s.name for s in SCENARIOS))


def judges(alpha_each: float) -> list[Judge]:
    mix, fixed = MixtureBoundary(), FixedBoundary()
    return [
        Judge("ours", "ours (confidence sequences, per segment)",
              lambda s, n, g: run_sequential(s, n, g, mix, alpha_each)),
        Judge("flagger", "Flagger-style threshold / interval",
              lambda s, n, g: run_flagger(s, n, g)),
        Judge("kayenta", "Kayenta-style Mann–Whitney / interval",
              lambda s, n, g: run_kayenta(s, n, g)),
        Judge("ztest", "fixed-horizon z-test, peeking",
              lambda s, n, g: run_sequential(s, n, g, fixed, alpha_each)),
        Judge("ours_1cmp", "ours, 1 comparison, margin 0, α=0.01",
              lambda s, n, g: run_sequential(s, n, g, mix, RO.alpha, single=True), ("aa",)),
        Judge("ztest_1cmp", "z-test, 1 comparison, margin 0, α=0.01",
              lambda s, n, g: run_sequential(s, n, g, fixed, RO.alpha, single=True), ("aa",)),
    ]


def fmt_rate(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def fmt_num(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def markdown(results: dict) -> str:
    lines = ["| judge | scenario | runs | rollback | promote | hold | median canary samples to rollback "
             "| median min to decision |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        s = row["summary"]
        rb = fmt_rate(s["rollback_rate"])
        if row["scenario"] == "aa":
            lo, hi = s["rollback_ci95"]
            rb += f" [{100 * lo:.2f}–{100 * hi:.2f}]"
        mins = s["median_minutes_to_rollback"] if s["rollback_rate"] >= s["promote_rate"] else s["median_minutes_to_promote"]
        lines.append(f"| {row['judge_title']} | {row['scenario_title']} | {s['runs']} | {rb} | "
                     f"{fmt_rate(s['promote_rate'])} | {fmt_rate(s['hold_rate'])} | "
                     f"{fmt_num(s['median_canary_samples_to_rollback'])} | {fmt_num(mins)} |")
    return "\n".join(lines)


def targets(results: dict) -> list[tuple[str, bool, str]]:
    by = {(r["judge"], r["scenario"]): r["summary"] for r in results["rows"]}
    out = []
    aa = by.get(("ours", "aa"))
    if aa:
        out.append(("false rollback ≤ α=0.01 (A/A)", aa["rollback_rate"] <= RO.alpha,
                    f"{100 * aa['rollback_rate']:.2f}% (95% CI {100 * aa['rollback_ci95'][0]:.2f}–"
                    f"{100 * aa['rollback_ci95'][1]:.2f}%), {aa['runs']} runs"))
    one = by.get(("ours_1cmp", "aa"))
    if one:
        out.append(("one comparison (margin 0) at α=0.01, watched every 15 s for 100 min, stays ≤ α",
                    one["rollback_rate"] <= RO.alpha,
                    f"{100 * one['rollback_rate']:.2f}% (95% CI {100 * one['rollback_ci95'][0]:.2f}–"
                    f"{100 * one['rollback_ci95'][1]:.2f}%)"))
    d5 = by.get(("ours", "drop5"))
    if d5:
        med = d5["median_canary_samples_to_rollback"]
        out.append(("−5 pts caught ≥ 95%, median ≤ 2,000 canary samples",
                    d5["rollback_rate"] >= 0.95 and med is not None and med <= 2000,
                    f"{100 * d5['rollback_rate']:.1f}%, median {fmt_num(med)}"))
    tl = by.get(("ours", "tools"))
    if tl:
        out.append(("tools-only regression caught ≥ 95%", tl["rollback_rate"] >= 0.95,
                    f"{100 * tl['rollback_rate']:.1f}%"))
    bt = by.get(("ours", "better"))
    if bt:
        out.append(("better candidate promoted ≥ 90%", bt["promote_rate"] >= 0.90,
                    f"{100 * bt['promote_rate']:.1f}%"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000, help="runs per judge and scenario (A/A: twice as many)")
    ap.add_argument("--quick", action="store_true", help="200 runs (A/A 400): a smoke run")
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "judge_quality.json"))
    ap.add_argument("--only", default=None, help="comma-separated judges to run (default all)")
    args = ap.parse_args(argv)
    runs = 200 if args.quick else args.runs
    alpha_each = alpha_per_comparison(ROUTE)
    chosen = set(args.only.split(",")) if args.only else None
    rows = []
    started = time.time()
    for j in judges(alpha_each):
        if chosen and j.name not in chosen:
            continue
        for i, scn in enumerate(SCENARIOS):
            if scn.name not in j.scenarios:
                continue
            n = runs * 2 if scn.name == "aa" else runs
            rng = np.random.default_rng([args.seed, i])  # same traffic seed for every judge
            t0 = time.time()
            outcome = j.run(scn, n, rng)
            summary = outcome.summary()
            rows.append({"judge": j.name, "judge_title": j.title, "scenario": scn.name,
                         "scenario_title": scn.title, "truth": scn.truth, "seconds": round(time.time() - t0, 2),
                         "summary": summary})
            print(f"  {j.name:<11} {scn.name:<8} {n:>5} runs  rollback {fmt_rate(summary['rollback_rate']):>6}  "
                  f"promote {fmt_rate(summary['promote_rate']):>6}  ({time.time() - t0:.1f} s)", file=sys.stderr)
    results = {
        "benchmark": "judge_quality",
        "seconds": round(time.time() - started, 1),
        "config": {"rate_per_min": RATE_PER_MIN, "batch_s": BATCH_S, "segments": dict(zip(SEGMENTS, SHARES.tolist())),
                   "stable_completion": STABLE_COMPLETION, "stable_latency_median_p95_s": STABLE_LAT,
                   "rollout": RO.model_dump(), "alpha_per_comparison": alpha_each,
                   "comparisons_budget": comparisons_budget(ROUTE), "horizon_min": HORIZON_MIN,
                   "flagger": {"min_completion": FLAGGER_MIN_COMPLETION, "max_p95_s": FLAGGER_MAX_P95,
                               "threshold": FLAGGER_THRESHOLD, "interval_s": 60},
                   "kayenta": {"confidence": KAYENTA_CONF, "min_intervals_per_step": KAYENTA_MIN_INTERVALS,
                               "interval_s": 60},
                   "seed": args.seed, "runs": runs},
        "scenarios": [s.__dict__ for s in SCENARIOS],
        "rows": rows,
    }
    results["targets"] = [{"target": t, "met": ok, "value": v} for t, ok, v in targets(results)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=float))
    print(markdown(results))
    print()
    for t, ok, v in targets(results):
        print(f"- [{'x' if ok else ' '}] {t}: {v}")
    print(f"\n{results['seconds']} s; JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
