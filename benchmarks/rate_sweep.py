"""Rate sweep: added p99 at fixed request rates, open loop.

benchmarks/loadgen.py runs in its own process and sends request i at t0 + i/rate whatever
happened before, measuring each latency from that scheduled time: queueing anywhere counts,
so a saturated server shows as growing latency instead of hiding behind a slower send rate
(coordinated omission; wrk and hey are closed-loop, and wrk2 isn't available).

Direct (the simulator alone) and modelcanary (one worker, everything on) at each rate, taking
turns for a few rounds (a burst of other work on the machine then spoils one round, not the
result: each figure is the median over the rounds, and added = the median of each round's
modelcanary − direct); then LiteLLM (one worker) at the rates it can still keep up with: once a
rate saturates a target (answers fall behind the schedule), higher rates are skipped for it.

    python benchmarks/rate_sweep.py [--quick] [--no-litellm] [--rates 100,500,1000,2000] [--rounds N]
                                    [--baseline-tree DIR]

`--rounds N` sets the rounds per rate (3; 1 in a quick run). `--baseline-tree DIR` adds a target,
modelcanary@baseline: the proxy run from another source tree (`git archive <commit> | tar -x -C DIR`,
see `harness.proxy`) with the same config, in the same turns as modelcanary (the two swap places
every other round), and reports current ÷ baseline for added p99 at 500 req/s, to be within 5%;
results in results/rate_sweep_vs_<baseline>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as h

PATH = "/v1/chat/completions"
RATES = (100, 500, 1000, 2000)
TARGET_ADDED_P99_AT_500_MS = 2.0
BASELINE = h.BASELINE


def saturated(r: dict) -> bool:
    """Answers fell behind the schedule: some never came, errors, or the queue kept growing."""
    return r["unanswered"] > 0 or r["errors"] > 0.01 * max(1, r["sent"]) or (r["p50_ms"] or 0) > 100.0


def _one(proc: h.Proc, body: dict, rate: float, duration: float) -> dict:
    cpu0 = proc.cpu_s()
    load0 = h.loadavg()
    r = h.loadgen(proc.url + PATH, body, rate=rate, duration_s=duration)
    r["cpu_us_per_req"] = round((proc.cpu_s() - cpu0) / r["completed"] * 1e6, 1) if r["completed"] else None
    r["loadavg_1m"] = max(load0, h.loadavg())
    r["saturated"] = saturated(r)
    return r


def _median(values: list[float]) -> float | None:
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def _combine(rounds: list[dict]) -> dict:
    """One figure per rate: medians over the rounds (each round kept under `rounds`)."""
    out = {k: _median([r[k] for r in rounds]) for k in ("p50_ms", "p90_ms", "p99_ms", "achieved_rps", "cpu_us_per_req")}
    out.update({"p99_ms_max": max(r["p99_ms"] or 0 for r in rounds), "max_ms": max(r["max_ms"] or 0 for r in rounds),
                "errors": sum(r["errors"] for r in rounds), "sent": sum(r["sent"] for r in rounds),
                "unanswered": sum(r["unanswered"] for r in rounds), "saturated": any(r["saturated"] for r in rounds),
                "rounds": rounds})
    return out


def run(quick: bool = False, with_litellm: bool = True, rates: tuple[int, ...] = RATES, rounds: int | None = None,
        baseline_tree: Path | None = None) -> dict:
    duration, n_rounds = (2.0, 1) if quick else (5.0, 3)
    n_rounds = rounds or n_rounds
    runs: dict[str, dict[int, dict]] = {"direct": {}, "modelcanary": {}}
    added_rounds: dict[str, dict[int, dict[str, list[float]]]] = {}   # proxy → rate → per-round added
    notes: list[str] = []
    with h.Stack("rate-sweep") as st:
        sim = h.simulator(st)
        procs = {"modelcanary": h.proxy(st, h.proxy_config(st.tmp, sim.url, shadow_rate=0.1))}
        if baseline_tree is not None:
            procs[BASELINE] = h.baseline_proxy(st, sim.url, baseline_tree)
            runs[BASELINE] = {}
        for proc in procs.values():
            h.check_ok(proc.url + PATH)
            h.loadgen(proc.url + PATH, h.CHAT_BODY, rate=500, duration_s=1)  # warm up
        done: set[str] = set()   # saturated: higher rates are skipped for it
        turn = 0
        for rate in rates:
            d_rounds: list[dict] = []
            p_rounds: dict[str, list[dict]] = {n: [] for n in procs}
            for _ in range(n_rounds):
                d_rounds.append(_one(sim, h.DIRECT_BODY, rate, duration))
                order = list(procs) if turn % 2 == 0 else list(procs)[::-1]   # ABBA: neither tree always first
                turn += 1
                for name in order:
                    if name not in done:
                        p_rounds[name].append(_one(procs[name], h.CHAT_BODY, rate, duration))
                        if p_rounds[name][-1]["saturated"]:
                            done.add(name)
                if done.issuperset(procs) and any(p_rounds.values()):
                    break
            runs["direct"][rate] = _combine(d_rounds)
            for name, rs in p_rounds.items():
                if rs:   # round i of a proxy pairs with round i of direct
                    runs[name][rate] = _combine(rs)
                    added_rounds.setdefault(name, {})[rate] = {q: [m[q] - d[q] for m, d in zip(rs, d_rounds)]
                                                               for q in ("p50_ms", "p99_ms")}
        for proc in procs.values():
            proc.stop()
        if with_litellm and quick:
            notes.append("quick run: LiteLLM is left out of the rate sweep (it is in the overhead and streaming runs)")
        elif with_litellm:
            why = h.ensure_litellm()
            if why is None:
                ll = h.litellm(st, {"support-bot": sim.url})
                h.check_ok(ll.url + PATH)
                h.loadgen(ll.url + PATH, h.CHAT_BODY, rate=20, duration_s=2)  # warm up
                runs["litellm"] = {}
                for rate in rates:
                    runs["litellm"][rate] = r = _one(ll, h.CHAT_BODY, rate, duration)
                    if r["saturated"]:
                        break
                ll.stop()
            else:
                notes.append(why)

    def added(name: str, rate: int, q: str) -> float | None:
        if rate in added_rounds.get(name, {}):
            v = _median(added_rounds[name][rate][q])
            return round(v, 4) if v is not None else None
        r, d = runs.get(name, {}).get(rate), runs["direct"].get(rate)
        if not r or not d or r.get(q) is None or d.get(q) is None:
            return None
        return round(r[q] - d[q], 4)

    rows = []
    for rate in rates:
        row: list[object] = [rate, runs["direct"][rate]["p50_ms"], runs["direct"][rate]["p99_ms"]]
        for name in ("modelcanary", BASELINE, "litellm"):
            r = runs.get(name, {}).get(rate)
            if name not in runs:
                continue
            if r is None:
                row += ["not reachable", "–", "–"]
            else:
                mark = " (saturated)" if r["saturated"] else ""
                row += [f"{h.fmt(added(name, rate, 'p50_ms'), 3)}{mark}", h.fmt(added(name, rate, "p99_ms"), 3),
                        h.fmt(r["achieved_rps"], 1)]
        rows.append(row)
    headers = ["req/s", "direct p50 ms", "direct p99 ms", "modelcanary added p50 ms", "modelcanary added p99 ms",
               "modelcanary answered/s"]
    if BASELINE in runs:
        headers += ["baseline added p50 ms", "baseline added p99 ms", "baseline answered/s"]
    if "litellm" in runs:
        headers += ["LiteLLM added p50 ms", "LiteLLM added p99 ms", "LiteLLM answered/s"]
    mc500 = added("modelcanary", 500, "p99_ms")
    checks = {f"added p99 at 500 req/s ≤ {TARGET_ADDED_P99_AT_500_MS:g} ms":
              mc500 is not None and mc500 <= TARGET_ADDED_P99_AT_500_MS}
    baseline: dict | None = None
    if baseline_tree is not None:
        label = h.tree_label(baseline_tree)
        b500 = added(BASELINE, 500, "p99_ms")
        ok = h.within_baseline(mc500, b500)
        baseline = {"tree": str(baseline_tree), "commit": label,
                    "ratios": {"added_p99_ms_at_500 (current÷baseline)": h.ratio(mc500, b500)},
                    "within_5pct": {"added_p99_ms_at_500": ok}}
        checks[f"added p99 at 500 req/s ≤ 1.05× {label}'s"] = ok
    md = [f"### Rate sweep: open loop, latency from the scheduled send time ({n_rounds}× {duration:g} s per rate "
          "and target, medians)", "",
          h.table(headers, rows, digits=3), "",
          "A target is *saturated* when answers fall behind the schedule (unanswered requests, >1% errors or "
          "p50 > 100 ms); higher rates are then skipped for it."]
    if baseline is not None:
        md += ["", h.table(["metric", "current", f"baseline ({baseline['commit']})", "current ÷ baseline",
                            "within 5%"],
                           [["added p99 ms at 500 req/s", mc500, added(BASELINE, 500, "p99_ms"),
                             baseline["ratios"]["added_p99_ms_at_500 (current÷baseline)"],
                             baseline["within_5pct"]["added_p99_ms_at_500"]]], digits=3)]
    md += ["", "Target: " + "; ".join(f"{k}: **{'met' if v else 'NOT met'}**" for k, v in checks.items()) + "."]
    md += [f"> {n}" for n in notes]
    data = {"duration_s": duration, "rounds": n_rounds, "rates": list(rates),
            "runs": {n: {str(k): v for k, v in rs.items()} for n, rs in runs.items()},
            "added_p99_ms": {n: {str(k): added(n, k, "p99_ms") for k in rs} for n, rs in runs.items() if n != "direct"},
            "added_p50_ms": {n: {str(k): added(n, k, "p50_ms") for k in rs} for n, rs in runs.items() if n != "direct"},
            "checks": checks, "notes": notes, "baseline": baseline}
    h.write_result("rate_sweep" if baseline is None else h.vs_name("rate_sweep", baseline["commit"]), data)
    return {"name": "rate_sweep", "markdown": "\n".join(md), "data": data}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="open-loop rate sweep")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-litellm", action="store_true")
    p.add_argument("--rates", default=",".join(map(str, RATES)))
    p.add_argument("--rounds", type=int, default=None, help="rounds per rate and target (3; 1 in a quick run)")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="also run the proxy from this source tree (e.g. `git archive <commit> | tar -x -C DIR`) "
                        "and report current ÷ baseline; results in rate_sweep_vs_<baseline>.json")
    args = p.parse_args(argv)
    rates = tuple(int(r) for r in args.rates.split(","))
    tree = args.baseline_tree.resolve() if args.baseline_tree else None
    print(run(args.quick, not args.no_litellm, rates, args.rounds, tree)["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
