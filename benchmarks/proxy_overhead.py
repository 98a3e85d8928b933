"""Proxy overhead and throughput: the same wrk load against the simulator directly, through
modelcanary (one worker, everything on: metrics, outcome events, 10% shadow sampling, memory
bus, the embedded controller judging) and through the LiteLLM proxy (one worker), all in front
of the same simulator answering at once (`time_scale: 0`).

Added latency = the proxy's percentile − the direct percentile, at concurrency 1 and 16.
Max req/s = the best of the closed-loop runs (concurrency 16 and, in the full run, 64).
Also the proxy process's CPU time per request, which is what bounds its throughput.

    python benchmarks/proxy_overhead.py [--quick] [--no-litellm]
"""

from __future__ import annotations

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


def _measure(proc: h.Proc, body: dict, concurrency: int, duration_s: float, tmp: Path) -> dict:
    cpu0, t0, load0 = proc.cpu_s(), time.monotonic(), h.loadavg()
    r = h.wrk(proc.url + PATH, body, concurrency, duration_s, tmp=tmp)
    cpu = proc.cpu_s() - cpu0
    r["cpu_us_per_req"] = round(cpu / r["requests"] * 1e6, 1) if r["requests"] else None
    r["cpu_util"] = round(cpu / (time.monotonic() - t0), 3)
    r["loadavg_1m"] = max(load0, h.loadavg())
    return r


def run(quick: bool = False, with_litellm: bool = True) -> dict:
    duration = 2.0 if quick else 10.0
    concurrencies = [1, 16] if quick else [1, 16, 64]
    runs: dict[str, dict[int, dict]] = {}
    notes: list[str] = []
    with h.Stack("overhead") as st:
        sim = h.simulator(st)
        h.check_ok(sim.url + PATH, h.DIRECT_BODY)
        mc = h.proxy(st, h.proxy_config(st.tmp, sim.url, shadow_rate=0.1))
        h.check_ok(mc.url + PATH)
        for name, proc, body in (("direct", sim, h.DIRECT_BODY), ("modelcanary", mc, h.CHAT_BODY)):
            h.wrk(proc.url + PATH, body, 16, 1 if quick else 3, tmp=st.tmp)  # warm up pools and caches
            runs[name] = {c: _measure(proc, body, c, duration, st.tmp) for c in concurrencies}
        mc_scrape = h.scrape(mc.url)
        mc.stop()
        if with_litellm:
            why = h.ensure_litellm()
            if why is None:
                ll = h.litellm(st, {"support-bot": sim.url})
                h.check_ok(ll.url + PATH)
                h.wrk(ll.url + PATH, h.CHAT_BODY, 16, 2 if quick else 5, tmp=st.tmp)
                runs["litellm"] = {c: _measure(ll, h.CHAT_BODY, c, duration, st.tmp) for c in concurrencies}
                ll.stop()
            else:
                notes.append(why)
        # the direct runs again, last: the simulator's own latency moves with the machine's load
        runs["direct (after)"] = {c: _measure(sim, h.DIRECT_BODY, c, duration, st.tmp) for c in (1, 16)[:1 if quick else 2]}

    direct = {c: min((runs["direct"][c], runs["direct (after)"].get(c) or runs["direct"][c]),
                     key=lambda r: r["p50_ms"]) for c in concurrencies}
    shadowed = h.metric_sum(mc_scrape, "modelcanary_shadow_requests_total")
    sampled_dropped = h.metric_sum(mc_scrape, "modelcanary_shadow_dropped_total")

    def added(name: str, c: int, q: str) -> float | None:
        r = runs.get(name, {}).get(c)
        return round(r[q] - direct[c][q], 4) if r and r.get(q) is not None else None

    proxies = [n for n in ("modelcanary", "litellm") if n in runs]
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
    if "litellm" in summary:
        mc_s, ll_s = summary["modelcanary"], summary["litellm"]
        for key in ("added_p50_ms_c1", "added_p99_ms_c1", "added_p50_ms_c16", "added_p99_ms_c16"):
            ratios[key + " (mc÷litellm)"] = h.ratio(mc_s[key], ll_s[key])
        ratios["max_rps (mc÷litellm)"] = h.ratio(mc_s["max_rps"], ll_s["max_rps"])
    sim_ratio = h.ratio(runs["direct"][16]["rps"], runs["modelcanary"][16]["rps"])
    mc_s = summary["modelcanary"]
    checks = {
        f"added p50 at c=1 ≤ {TARGET_ADDED_P50_MS} ms": (mc_s["added_p50_ms_c1"] or 1e9) <= TARGET_ADDED_P50_MS,
        f"≥ {TARGET_RPS:,} req/s, one worker": mc_s["max_rps"] >= TARGET_RPS,
        "simulator ≥ 3× the proxy's rate": (sim_ratio or 0) >= 3,
    }
    if ratios:
        lat_ratio = ratios["added_p50_ms_c1 (mc÷litellm)"]
        checks[f"≥ {TARGET_RATIO:g}× less added latency than LiteLLM (p50, c=1)"] = \
            lat_ratio is not None and lat_ratio > 0 and 1 / lat_ratio >= TARGET_RATIO
        checks[f"≥ {TARGET_RATIO:g}× LiteLLM's throughput"] = (ratios["max_rps (mc÷litellm)"] or 0) >= TARGET_RATIO

    rows = []
    for name in ["direct", *proxies]:
        for c in concurrencies:
            r = runs[name][c]
            rows.append([name, c, r["p50_ms"], r["p90_ms"], r["p99_ms"], r["rps"], r["errors"], r["cpu_us_per_req"]])
    md = [f"### Proxy overhead and throughput (wrk -t1, {duration:g} s per run, simulator time_scale 0)", "",
          h.table(["target", "concurrency", "p50 ms", "p90 ms", "p99 ms", "req/s", "errors", "CPU µs/req"], rows,
                  digits=3), "",
          h.table(["proxy", "added p50 c=1", "added p90 c=1", "added p99 c=1", "added p50 c=16", "added p90 c=16",
                   "added p99 c=16", "max req/s"],
                  [[n, s["added_p50_ms_c1"], s["added_p90_ms_c1"], s["added_p99_ms_c1"], s["added_p50_ms_c16"],
                    s["added_p90_ms_c16"], s["added_p99_ms_c16"], s["max_rps"]] for n, s in summary.items()],
                  digits=3)]
    if ratios:
        mc_s, ll_s = summary["modelcanary"], summary["litellm"]

        def times(a: float | None, b: float | None) -> str:
            return f"{b / a:.0f}× less" if a and b and a > 0 else "–"

        md += ["", h.table(["ratio", "modelcanary ÷ LiteLLM", "i.e."], [
            ["added p50, c=1", ratios["added_p50_ms_c1 (mc÷litellm)"],
             times(mc_s["added_p50_ms_c1"], ll_s["added_p50_ms_c1"])],
            ["added p99, c=1", ratios["added_p99_ms_c1 (mc÷litellm)"],
             times(mc_s["added_p99_ms_c1"], ll_s["added_p99_ms_c1"])],
            ["added p50, c=16", ratios["added_p50_ms_c16 (mc÷litellm)"],
             times(mc_s["added_p50_ms_c16"], ll_s["added_p50_ms_c16"])],
            ["max req/s", ratios["max_rps (mc÷litellm)"], f"{ratios['max_rps (mc÷litellm)']:.0f}× the throughput"
             if ratios["max_rps (mc÷litellm)"] else "–"],
        ], digits=3)]
    md += ["", "Added latency is measured against the better of two direct runs (before and after the proxies). "
           f"modelcanary shadowed {shadowed:,.0f} requests in this run (10% sampled, "
           f"{sampled_dropped:,.0f} over the default shadow.max_per_minute cap of 600 and dropped).",
           "", "Targets: " + "; ".join(f"{k}: **{'met' if v else 'NOT met'}**" for k, v in checks.items()) + "."]
    md += [f"> {n}" for n in notes]
    data = {"duration_s": duration, "runs": {n: {str(c): r for c, r in rs.items()} for n, rs in runs.items()},
            "summary": summary, "ratios": ratios, "simulator_vs_proxy_rps": sim_ratio, "checks": checks,
            "shadowed": shadowed, "shadow_dropped": sampled_dropped, "notes": notes}
    h.write_result("proxy_overhead", data)
    return {"name": "proxy_overhead", "markdown": "\n".join(md), "data": data}


def main(argv: list[str] | None = None) -> int:
    return h.cli(run, "proxy overhead and throughput", argv, litellm=True)


if __name__ == "__main__":
    sys.exit(main())
