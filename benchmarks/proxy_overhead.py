"""Proxy overhead and throughput: the same wrk load against the simulator directly, through
modelcanary (one worker, everything on: metrics, outcome events, 10% shadow sampling, memory
bus, the embedded controller judging), through the LiteLLM proxy (one worker) and through
Portkey's open-source gateway (Node, one process), all in front of the same simulator answering
at once (`time_scale: 0`), one after the other in one run.

Added latency = the proxy's percentile − the direct percentile, at concurrency 1 and 16.
Max req/s = the best of the closed-loop runs (concurrency 16 and, in the full run, 64).
Also the proxy process's CPU time per request, which is what bounds its throughput.
Portkey is reached with `x-portkey-provider: openai` and `x-portkey-custom-host: <simulator>/v1`
on every request. It is warmed up longer than the others (20 s, 5 s in a quick run): its JIT needs
thousands of requests (in a check on a 2-core VM its req/s rose from ~150-250 to ~800 over its
first ~16 s of load).

    python benchmarks/proxy_overhead.py [--quick] [--no-litellm] [--no-portkey] [--rounds N] [--baseline-tree DIR]

With `--rounds N` the targets take turns, N rounds of 1/N of the time each, and each number is the
median over the rounds: on a machine whose load moves during the run, every target then sees the
same conditions. By default (one round) each target runs its full time in one go, as in the
reference results.

`--baseline-tree DIR` adds a target, modelcanary@baseline: the proxy run from another source tree
(`git archive <commit> | tar -x -C DIR`, see `harness.proxy`) with the same config, in the same
turns (the two trees swap places every other round), and reports current ÷ baseline for added p50
at c=1 and max req/s, each to be within 5%; results in results/proxy_overhead_vs_<baseline>.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as h

PATH = "/v1/chat/completions"
TARGET_ADDED_P50_MS = 0.6
TARGET_RPS = 3000
TARGET_RATIO = 15.0
TARGET_RATIO_PORTKEY = 5.0
PEERS = {"litellm": "LiteLLM", "portkey": "Portkey"}
BASELINE = h.BASELINE


def _measure(proc: h.Proc, body: dict, concurrency: int, duration_s: float, tmp: Path,
             headers: dict[str, str] | None = None) -> dict:
    cpu0, t0, load0 = proc.cpu_s(), time.monotonic(), h.loadavg()
    r = h.wrk(proc.url + PATH, body, concurrency, duration_s, tmp=tmp, headers=headers)
    cpu = proc.cpu_s() - cpu0
    r["cpu_us_per_req"] = round(cpu / r["requests"] * 1e6, 1) if r["requests"] else None
    r["cpu_util"] = round(cpu / (time.monotonic() - t0), 3)
    r["loadavg_1m"] = max(load0, h.loadavg())
    return r


def _combine(rs: list[dict]) -> dict:
    """One target's runs at one concurrency over the rounds: medians, with the rounds kept."""
    if len(rs) == 1:
        return rs[0]

    def med(k: str) -> float | None:
        vals = [r[k] for r in rs if r.get(k) is not None]
        return round(statistics.median(vals), 4) if vals else None

    out: dict = {"tool": "wrk", "concurrency": rs[0]["concurrency"], "rounds": len(rs),
                 "duration_s": round(sum(r["duration_s"] for r in rs), 2), "requests": sum(r["requests"] for r in rs),
                 "errors": sum(r["errors"] for r in rs)}
    for k in ("rps", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "mean_ms", "cpu_us_per_req", "cpu_util"):
        out[k] = med(k)
    out["max_ms"] = max(r["max_ms"] for r in rs)
    out["loadavg_1m"] = max(r["loadavg_1m"] for r in rs)
    out["per_round"] = [{k: r[k] for k in ("rps", "p50_ms", "p99_ms", "errors", "cpu_us_per_req", "loadavg_1m")}
                        for r in rs]
    return out


def _start_portkey(st: h.Stack, sim: h.Proc) -> tuple[h.Proc | None, str | None]:
    """Portkey's gateway in front of the simulator, or None and why not when it can't be installed or
    started, or doesn't answer through the simulator: reported, never raised, never replaced by other
    numbers."""
    why = h.ensure_portkey()
    if why is not None:
        return None, f"Portkey unavailable, its side is skipped: {why}"
    try:
        pk = h.portkey(st)
    except Exception as e:  # any failure to start is reported, not raised
        return None, (f"Portkey {h.PORTKEY_VERSION} did not start, its side is skipped: {type(e).__name__}: "
                      f"{str(e)[-300:]}")
    try:
        h.check_ok(pk.url + PATH, h.DIRECT_BODY, h.portkey_headers(sim.url))
    except Exception as e:
        pk.stop()
        return None, (f"Portkey {h.PORTKEY_VERSION} started but did not answer through the simulator, its side is "
                      f"skipped: {str(e)[:300]} {h.tail(pk.log, 300)}")
    return pk, None


def run(quick: bool = False, with_litellm: bool = True, with_portkey: bool = True, rounds: int = 1,
        baseline_tree: Path | None = None) -> dict:
    duration = 2.0 if quick else 10.0   # of load per target and concurrency, split over the rounds
    rounds = max(1, min(rounds, int(duration)))   # wrk runs whole seconds
    per_run = duration / rounds
    concurrencies = [1, 16] if quick else [1, 16, 64]
    measured: dict[str, dict[int, list[dict]]] = {}
    notes: list[str] = []
    portkey_why = None
    with h.Stack("overhead") as st:
        sim = h.simulator(st)
        h.check_ok(sim.url + PATH, h.DIRECT_BODY)
        mc = h.proxy(st, h.proxy_config(st.tmp, sim.url, shadow_rate=0.1))
        h.check_ok(mc.url + PATH)
        # name → (process, body, extra headers, warm-up seconds); all started before any load, each
        # warmed up just before its first run, then measured in turns (one turn unless --rounds)
        targets: dict[str, tuple[h.Proc, dict, dict | None, float]] = {
            "direct": (sim, h.DIRECT_BODY, None, 1 if quick else 3),
            "modelcanary": (mc, h.CHAT_BODY, None, 1 if quick else 3)}
        if baseline_tree is not None:
            mcb = h.baseline_proxy(st, sim.url, baseline_tree)
            h.check_ok(mcb.url + PATH)
            targets[BASELINE] = (mcb, h.CHAT_BODY, None, 1 if quick else 3)
        if with_litellm:
            why = h.ensure_litellm()
            if why is None:
                ll = h.litellm(st, {"support-bot": sim.url})
                h.check_ok(ll.url + PATH)
                targets["litellm"] = (ll, h.CHAT_BODY, None, 2 if quick else 5)
            else:
                notes.append(why)
        if with_portkey:
            pk, portkey_why = _start_portkey(st, sim)
            if pk is not None:   # its JIT needs thousands of requests: a longer warm-up
                targets["portkey"] = (pk, h.DIRECT_BODY, h.portkey_headers(sim.url), 5 if quick else 20)
        for r in range(rounds):
            order = list(targets)
            if r % 2 and BASELINE in targets:   # ABBA: neither tree always goes first
                i, j = order.index("modelcanary"), order.index(BASELINE)
                order[i], order[j] = order[j], order[i]
            for name in order:
                proc, body, headers, warm_s = targets[name]
                try:
                    if r == 0:
                        h.wrk(proc.url + PATH, body, 16, warm_s, tmp=st.tmp, headers=headers)
                    for c in concurrencies:
                        measured.setdefault(name, {}).setdefault(c, []).append(
                            _measure(proc, body, c, per_run, st.tmp, headers))
                except Exception as e:
                    if name != "portkey":
                        raise
                    portkey_why = (f"Portkey {h.PORTKEY_VERSION} failed under load, its side is skipped: "
                                   f"{str(e)[:300]} {h.tail(proc.log, 300)}")
                    measured.pop(name, None)
                    del targets[name]
        if rounds == 1:  # the direct runs again, last: the simulator's own latency moves with the machine's load
            measured["direct (after)"] = {c: [_measure(sim, h.DIRECT_BODY, c, duration, st.tmp)]
                                          for c in (1, 16)[:1 if quick else 2]}
        mc_scrape = h.scrape(mc.url)
    if portkey_why:
        notes.append(portkey_why)
    runs = {name: {c: _combine(rs) for c, rs in by_c.items()} for name, by_c in measured.items()}

    after = runs.get("direct (after)", {})
    direct = {c: min((runs["direct"][c], after.get(c) or runs["direct"][c]), key=lambda r: r["p50_ms"])
              for c in concurrencies}
    shadowed = h.metric_sum(mc_scrape, "modelcanary_shadow_requests_total")
    sampled_dropped = h.metric_sum(mc_scrape, "modelcanary_shadow_dropped_total")

    def added(name: str, c: int, q: str) -> float | None:
        r = runs.get(name, {}).get(c)
        return round(r[q] - direct[c][q], 4) if r and r.get(q) is not None else None

    proxies = [n for n in ("modelcanary", BASELINE, "litellm", "portkey") if n in runs]
    summary: dict[str, dict] = {}
    for name in proxies:
        s: dict = {}
        for c in (1, 16):
            for q in ("p50_ms", "p90_ms", "p99_ms"):
                s[f"added_{q}_c{c}"] = added(name, c, q)
        s["max_rps"] = max(r["rps"] for r in runs[name].values())
        s["rps_c16"] = runs[name][16]["rps"]
        s["cpu_us_per_req_c16"] = runs[name][16]["cpu_us_per_req"]
        summary[name] = s
    ratios: dict = {}
    for peer in PEERS:
        if peer in summary:
            mc_s, peer_s = summary["modelcanary"], summary[peer]
            for key in ("added_p50_ms_c1", "added_p99_ms_c1", "added_p50_ms_c16", "added_p99_ms_c16"):
                ratios[f"{key} (mc÷{peer})"] = h.ratio(mc_s[key], peer_s[key])
            ratios[f"max_rps (mc÷{peer})"] = h.ratio(mc_s["max_rps"], peer_s["max_rps"])
    sim_ratio = h.ratio(runs["direct"][16]["rps"], runs["modelcanary"][16]["rps"])
    mc_s = summary["modelcanary"]
    checks = {
        f"added p50 at c=1 ≤ {TARGET_ADDED_P50_MS} ms": (mc_s["added_p50_ms_c1"] or 1e9) <= TARGET_ADDED_P50_MS,
        f"≥ {TARGET_RPS:,} req/s, one worker": mc_s["max_rps"] >= TARGET_RPS,
        "simulator ≥ 3× the proxy's rate": (sim_ratio or 0) >= 3,
    }
    for peer, target in (("litellm", TARGET_RATIO), ("portkey", TARGET_RATIO_PORTKEY)):
        if peer in summary:
            lat_ratio = ratios[f"added_p50_ms_c1 (mc÷{peer})"]
            checks[f"≥ {target:g}× less added latency than {PEERS[peer]} (p50, c=1)"] = \
                lat_ratio is not None and lat_ratio > 0 and 1 / lat_ratio >= target
            checks[f"≥ {target:g}× {PEERS[peer]}'s throughput"] = (ratios[f"max_rps (mc÷{peer})"] or 0) >= target
    baseline: dict | None = None
    if BASELINE in summary and baseline_tree is not None:
        label = h.tree_label(baseline_tree)
        cur, base = summary["modelcanary"], summary[BASELINE]
        lat_ok = h.within_baseline(cur["added_p50_ms_c1"], base["added_p50_ms_c1"])
        rps_ok = h.within_baseline(cur["max_rps"], base["max_rps"], higher_is_better=True)
        baseline = {"tree": str(baseline_tree), "commit": label,
                    "ratios": {"added_p50_ms_c1 (current÷baseline)": h.ratio(cur["added_p50_ms_c1"],
                                                                             base["added_p50_ms_c1"]),
                               "max_rps (current÷baseline)": h.ratio(cur["max_rps"], base["max_rps"])},
                    "within_5pct": {"added_p50_ms_c1": lat_ok, "max_rps": rps_ok}}
        checks[f"added p50 at c=1 ≤ 1.05× {label}'s"] = lat_ok
        checks[f"max req/s ≥ 0.95× {label}'s"] = rps_ok

    rows = []
    for name in ["direct", *proxies]:
        for c in concurrencies:
            r = runs[name][c]
            rows.append([name, c, r["p50_ms"], r["p90_ms"], r["p99_ms"], r["rps"], r["errors"], r["cpu_us_per_req"]])
    how = f"{duration:g} s per run" if rounds == 1 else \
        f"{rounds} rounds × {per_run:g} s per target and concurrency, taking turns; medians"
    md = [f"### Proxy overhead and throughput (wrk -t1, {how}, simulator time_scale 0)", "",
          h.table(["target", "concurrency", "p50 ms", "p90 ms", "p99 ms", "req/s", "errors", "CPU µs/req"], rows,
                  digits=3), "",
          h.table(["proxy", "added p50 c=1", "added p90 c=1", "added p99 c=1", "added p50 c=16", "added p90 c=16",
                   "added p99 c=16", "max req/s"],
                  [[n, s["added_p50_ms_c1"], s["added_p90_ms_c1"], s["added_p99_ms_c1"], s["added_p50_ms_c16"],
                    s["added_p90_ms_c16"], s["added_p99_ms_c16"], s["max_rps"]] for n, s in summary.items()],
                  digits=3)]

    def times(a: float | None, b: float | None) -> str:
        if not a or b is None or a <= 0:
            return "–"
        return f"{b / a:.0f}× less" if b / a >= 10 else f"{b / a:.1f}× less"

    for peer, label in PEERS.items():
        if peer not in summary:
            continue
        mc_s, peer_s = summary["modelcanary"], summary[peer]
        rps = ratios[f"max_rps (mc÷{peer})"]
        md += ["", h.table(["ratio", f"modelcanary ÷ {label}", "i.e."], [
            ["added p50, c=1", ratios[f"added_p50_ms_c1 (mc÷{peer})"],
             times(mc_s["added_p50_ms_c1"], peer_s["added_p50_ms_c1"])],
            ["added p99, c=1", ratios[f"added_p99_ms_c1 (mc÷{peer})"],
             times(mc_s["added_p99_ms_c1"], peer_s["added_p99_ms_c1"])],
            ["added p50, c=16", ratios[f"added_p50_ms_c16 (mc÷{peer})"],
             times(mc_s["added_p50_ms_c16"], peer_s["added_p50_ms_c16"])],
            ["max req/s", rps, (f"{rps:.0f}× the throughput" if rps >= 10 else f"{rps:.1f}× the throughput")
             if rps else "–"],
        ], digits=3)]
    if baseline is not None:
        cur, base = summary["modelcanary"], summary[BASELINE]
        md += ["", h.table(["metric", "current", f"baseline ({baseline['commit']})", "current ÷ baseline",
                            "within 5%"], [
            ["added p50 ms, c=1", cur["added_p50_ms_c1"], base["added_p50_ms_c1"],
             baseline["ratios"]["added_p50_ms_c1 (current÷baseline)"], baseline["within_5pct"]["added_p50_ms_c1"]],
            ["max req/s", cur["max_rps"], base["max_rps"], baseline["ratios"]["max_rps (current÷baseline)"],
             baseline["within_5pct"]["max_rps"]],
        ], digits=3)]
    md += ["", ("Added latency is measured against the better of two direct runs (before and after the proxies). "
                if rounds == 1 else "Added latency is measured against the direct runs of the same rounds. ") +
           f"modelcanary shadowed {shadowed:,.0f} requests in this run (10% sampled, "
           f"{sampled_dropped:,.0f} over the default shadow.max_per_minute cap of 600 and dropped).",
           "", "Targets: " + "; ".join(f"{k}: **{'met' if v else 'NOT met'}**" for k, v in checks.items()) + "."]
    if "portkey" in runs:
        md += ["", f"Portkey: `@portkey-ai/gateway` {h.PORTKEY_VERSION} on Node {_node_version()}, `--headless`, "
               "reached with `x-portkey-provider: openai` and `x-portkey-custom-host: <simulator>/v1` "
               "(benchmarks/portkey/)."]
    md += [f"> {n}" for n in notes]
    data = {"duration_s": duration, "rounds": rounds,
            "runs": {n: {str(c): r for c, r in rs.items()} for n, rs in runs.items()},
            "summary": summary, "ratios": ratios, "simulator_vs_proxy_rps": sim_ratio, "checks": checks,
            "shadowed": shadowed, "shadow_dropped": sampled_dropped, "notes": notes,
            "peers": {"litellm": {"version": h.LITELLM_VERSION, "measured": "litellm" in runs},
                      "portkey": {"version": h.PORTKEY_VERSION, "measured": "portkey" in runs,
                                  "node": _node_version() if "portkey" in runs else None,
                                  "skipped_because": portkey_why}},
            "baseline": baseline}
    h.write_result("proxy_overhead" if baseline is None else h.vs_name("proxy_overhead", baseline["commit"]), data)
    return {"name": "proxy_overhead", "markdown": "\n".join(md), "data": data}


def _node_version() -> str | None:
    try:
        return subprocess.run(["node", "--version"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="proxy overhead and throughput")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-litellm", action="store_true")
    p.add_argument("--no-portkey", action="store_true")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the targets in turns, N rounds of 1/N of the time each, and report medians "
                        "(for a machine whose load moves during the run)")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="also run the proxy from this source tree (e.g. `git archive <commit> | tar -x -C DIR`) "
                        "and report current ÷ baseline; results in proxy_overhead_vs_<baseline>.json")
    args = p.parse_args(argv if argv is not None else sys.argv[1:])
    tree = args.baseline_tree.resolve() if args.baseline_tree else None
    print(run(args.quick, not args.no_litellm, not args.no_portkey, args.rounds, tree)["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
