"""`make bench`: every benchmark in one go, on this machine, side by side.

Prints markdown tables (each benchmark's as it finishes, then the headline numbers against the
targets), writes each benchmark's JSON into benchmarks/results/, plus summary.json and report.md.

    python benchmarks/run_all.py                 # the full run (~25 min on 2 cores)
    python benchmarks/run_all.py --quick         # a short smoke run (< 3 min)
    python benchmarks/run_all.py --only streaming,rate_sweep
    python benchmarks/run_all.py --no-litellm    # skip the LiteLLM side (no install)
    python benchmarks/run_all.py --no-portkey    # skip the Portkey side (no install)
    python benchmarks/run_all.py --rounds 5      # proxy_overhead's targets take turns (a busy machine)

LiteLLM (the peer in the side-by-side runs) is installed on first use into
benchmarks/.litellm-venv by benchmarks/litellm/setup.sh, pinned, never a project dependency.
Portkey's gateway (the second peer, in proxy_overhead) likewise into benchmarks/.portkey by
benchmarks/portkey/setup.sh (npm, needs Node >= 18).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as h

# name → (kind, runner). Mine run in-process; the others' scripts run as they are, with --quick.
BENCHMARKS = ("proxy_overhead", "python_floor", "streaming", "rate_sweep", "shadow_impact", "pipeline", "memory",
              "scaling", "judge_quality")
EXTERNAL = {"shadow_impact": 900, "judge_quality": 900}   # script → time limit (s)


def run_internal(name: str, quick: bool, litellm: bool, portkey: bool = True, rounds: int = 1) -> dict:
    module = __import__(f"benchmarks.{name}", fromlist=["run"])
    if name == "proxy_overhead":
        return module.run(quick, litellm, with_portkey=portkey, rounds=rounds)
    if name == "python_floor":
        return module.run(quick, with_portkey=portkey)
    if name in ("streaming", "rate_sweep"):
        return module.run(quick, litellm)
    return module.run(quick)


def run_external(name: str, quick: bool) -> dict:
    script = h.BENCH / f"{name}.py"
    if not script.exists():
        return {"name": name, "markdown": f"### {name}\n\n> {script.name} is not there yet: skipped", "data": None,
                "skipped": True}
    args = [sys.executable, str(script)] + (["--quick"] if quick else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=EXTERNAL[name], cwd=h.ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(shlex.quote(a) for a in args)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    out = r.stdout.strip()
    result = h.RESULTS / f"{name}.json"
    data = json.loads(result.read_text()) if result.exists() else None
    return {"name": name, "markdown": out, "data": data}


# ---- the headline table ----------------------------------------------------------------------

def _get(results: dict, path: str):
    obj = results
    for part in path.split("/"):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def headline(results: dict[str, dict]) -> str:
    rows: list[list[object]] = []

    def add(metric: str, target: str, value, ok: bool | None, unit: str = "", digits: int = 2) -> None:
        if value is None:
            return
        shown = f"{h.fmt(value, digits)}{unit}"
        rows.append([metric, target, shown, "–" if ok is None else ("met" if ok else "**NOT met**")])

    po = results.get("proxy_overhead") or {}
    mc = _get(po, "summary/modelcanary") or {}
    ll = _get(po, "summary/litellm") or {}
    if mc:
        add("added p50, c=1", "≤ 0.6 ms (stretch 0.5)", mc.get("added_p50_ms_c1"),
            (mc.get("added_p50_ms_c1") or 9) <= 0.6, " ms", 3)
        add("added p99, c=1", "–", mc.get("added_p99_ms_c1"), None, " ms", 3)
        add("added p50, c=16", "–", mc.get("added_p50_ms_c16"), None, " ms", 3)
        add("max req/s, one worker, everything on", "≥ 3,000", mc.get("max_rps"), (mc.get("max_rps") or 0) >= 3000)
    if mc and ll:
        lat = h.ratio(ll.get("added_p50_ms_c1"), mc.get("added_p50_ms_c1"))
        thr = h.ratio(mc.get("max_rps"), ll.get("max_rps"))
        add("LiteLLM added p50 c=1 ÷ modelcanary's", "≥ 15×", lat, (lat or 0) >= 15, "×", 1)
        add("modelcanary max req/s ÷ LiteLLM's", "≥ 15×", thr, (thr or 0) >= 15, "×", 1)
        add("LiteLLM: added p50 c=1 / max req/s", "(peer)", f"{h.fmt(ll.get('added_p50_ms_c1'), 2)} ms / "
            f"{h.fmt(ll.get('max_rps'), 0)} req/s", None)
    pk = _get(po, "summary/portkey") or {}
    if mc and pk:
        lat = h.ratio(pk.get("added_p50_ms_c1"), mc.get("added_p50_ms_c1"))
        thr = h.ratio(mc.get("max_rps"), pk.get("max_rps"))
        add("Portkey added p50 c=1 ÷ modelcanary's", "≥ 5×", lat, (lat or 0) >= 5, "×", 1)
        add("modelcanary max req/s ÷ Portkey's", "≥ 5×", thr, (thr or 0) >= 5, "×", 1)
        add("Portkey: added p50 c=1 / max req/s", "(peer)", f"{h.fmt(pk.get('added_p50_ms_c1'), 2)} ms / "
            f"{h.fmt(pk.get('max_rps'), 0)} req/s", None)
    elif mc and _get(po, "peers/portkey/skipped_because"):
        add("Portkey (second peer)", "≥ 5× on both", "**not measured**: " + _get(po, "peers/portkey/skipped_because"),
            None)
    floor = _get(results.get("python_floor") or {}, "added_p50_ms") or {}
    if "floor" in floor and "floor+json" in floor:
        budget = _get(results["python_floor"], "budget_ms")
        add("Python floor, c=1: added p50 of a bare forwarder / + JSON / 5× less than Portkey's", "(bound)",
            f"{h.fmt(floor['floor'], 3)} / {h.fmt(floor['floor+json'], 3)} / {h.fmt(budget, 3)} ms", None)
    rs = results.get("rate_sweep") or {}
    v = _get(rs, "added_p99_ms/modelcanary/500")
    add("added p99 at 500 req/s (open loop)", "≤ 2 ms", v, v is not None and v <= 2.0, " ms", 3)
    st = _get(results.get("streaming") or {}, "summary/modelcanary") or {}
    add("streaming (200 req/s alongside): added TTFB p50", "≤ 0.5 ms", st.get("added_ttfb_p50_ms"),
        st.get("added_ttfb_p50_ms") is not None and st["added_ttfb_p50_ms"] <= 0.5, " ms", 3)
    add("streaming (200 req/s alongside): chunk gap p99", "< 1 ms", st.get("gap_p99_ms"),
        st.get("gap_p99_ms") is not None and st["gap_p99_ms"] < 1.0, " ms", 3)
    idle = _get(results.get("streaming") or {}, "idle_added") or {}
    if idle:
        add("streaming, no other traffic: added TTFB p50 / gap p99", "–",
            f"{h.fmt(idle.get('ttfb'), 3)} / {h.fmt(idle.get('gap_p99'), 3)} ms", None)
    rows_si = {r["target"]: r for r in _get(results.get("shadow_impact") or {}, "latency/rows") or []}
    s0, s10, s100 = (rows_si.get(f"shadow {p}%") or {} for p in (0, 10, 100))
    if "added_p50_vs_0pct" in s10 and "added_p50_vs_0pct" in s100:
        a, b = 100 * s10["added_p50_vs_0pct"], 100 * s100["added_p50_vs_0pct"]
        da, db = (1000 * (r["added_p50_ms"] - s0["added_p50_ms"]) for r in (s10, s100))
        add("shadow at 200 req/s: added p50 at 10% / 100% vs 0%", "+5% / +20%",
            f"{a:+.1f}% / {b:+.1f}% ({da:+.0f} / {db:+.0f} µs)", a <= 5 and b <= 20)
    pl = results.get("pipeline") or {}
    v = _get(pl, "bus/events_per_s")
    add("events/s, one process → Tansu (KafkaBus)", "≥ 10,000", v, v is not None and v >= 10_000)
    v = _get(pl, "evaluations/per_s")
    add("evaluations/s, one collect process", "≥ 1,000", v, v is not None and v >= 1000)
    v = _get(pl, "judge/judge_decisions_per_s")
    add("judge decisions/s over 100k outcomes", "–", v, None)
    mem = results.get("memory") or {}
    n = _get(mem, "steady/requests_per_phase") or 0
    v = _get(mem, "steady/growth_second")
    add(f"RSS growth over the second {n:,} requests", "< 5% (200k, memories full)", None if v is None else v * 100,
        (v is not None and v < 0.05) if n >= 150_000 else None, "%", 1)
    v = _get(mem, "steady/growth_first")
    add(f"RSS growth over the first {n:,} requests (bounded memories filling)", "–", None if v is None else v * 100, None,
        "%", 1)
    v = _get(mem, "broker_down/spool_bytes_max")
    if v is not None:
        cap = _get(mem, "broker_down/spool_max_bytes") or 1
        add(f"broker down {_get(mem, 'broker_down/outage_s'):g} s: spool max / spool.max_bytes", "bounded",
            f"{v / 2**20:.1f} / {cap / 2**20:.1f} MiB", v <= cap * 1.02)
    sc = results.get("scaling") or {}
    v = _get(sc, "speedup")
    checks = _get(sc, "checks") or {}
    add("--workers 2 ÷ 1 worker (req/s)", "–", v, None, "×")
    if checks:
        add("Prometheus multiprocess: /metrics sums both workers", "works", "yes" if all(checks.values()) else "no",
            all(checks.values()))
    if not rows:
        return ""
    return "## Headline numbers\n\n" + h.table(["metric", "target", "measured", ""], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run every benchmark (make bench)")
    p.add_argument("--quick", action="store_true", help="short runs: a smoke test in under 3 minutes")
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (no install)")
    p.add_argument("--no-portkey", action="store_true", help="skip Portkey's gateway (no install)")
    p.add_argument("--rounds", type=int, default=1,
                   help="proxy_overhead: the targets take turns, N rounds of 1/N of the time each, medians reported "
                        "(for a machine whose load moves during the run)")
    args = p.parse_args(argv)
    names = list(BENCHMARKS)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in BENCHMARKS]
        if unknown:
            p.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
        names = [n for n in BENCHMARKS if n in wanted]
    litellm = not args.no_litellm
    m = h.machine()
    command = "python benchmarks/run_all.py" + (" --quick" if args.quick else "") + \
        (f" --only {args.only}" if args.only else "") + (" --no-litellm" if args.no_litellm else "") + \
        (" --no-portkey" if args.no_portkey else "") + (f" --rounds {args.rounds}" if args.rounds != 1 else "")
    head = [f"# modelcanary benchmarks ({'quick' if args.quick else 'full'} run)", "",
            f"- machine: {m['nproc']} cores, {m['cpu']}, {m['memory_gib']} GiB; Linux {m['kernel']}; "
            f"Python {m['python']}",
            f"- command: `{command}`",
            f"- started: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, 1-min load average {h.loadavg():.2f}",
            "- everything on loopback; simulator at time_scale 0; one proxy worker unless stated", ""]
    print("\n".join(head), flush=True)
    if litellm and any(n in names for n in ("proxy_overhead", "streaming", "rate_sweep")):
        why = h.ensure_litellm()
        if why:
            print(f"> LiteLLM unavailable, its side is skipped: {why}\n", flush=True)
            litellm = False
    results: dict[str, dict] = {}
    sections: list[str] = []
    timings: dict[str, float] = {}
    failed: list[str] = []
    t_all = time.monotonic()
    for name in names:
        t0 = time.monotonic()
        print(f"_running {name} …_", file=sys.stderr, flush=True)
        try:
            out = run_external(name, args.quick) if name in EXTERNAL else \
                run_internal(name, args.quick, litellm, not args.no_portkey, args.rounds)
        except Exception as e:
            failed.append(name)
            traceback.print_exc()
            out = {"name": name, "markdown": f"### {name}\n\n> FAILED: {type(e).__name__}: {str(e)[:500]}",
                   "data": None}
        timings[name] = round(time.monotonic() - t0, 1)
        results[name] = out.get("data") or {}
        section = out["markdown"] + f"\n\n_({name}: {timings[name]:.0f} s)_\n"
        sections.append(section)
        print(section, flush=True)
    top = headline(results)
    total = time.monotonic() - t_all
    tail = [top, "", f"Total: {total / 60:.1f} min; 1-min load average at the end {h.loadavg():.2f}."]
    print("\n".join(tail), flush=True)
    h.RESULTS.mkdir(parents=True, exist_ok=True)
    (h.RESULTS / "report.md").write_text("\n".join(head) + "\n" + top + "\n\n" + "\n".join(sections) + "\n" +
                                         tail[-1] + "\n")
    summary = {"command": command, "quick": args.quick, "machine": m, "timings_s": timings, "failed": failed,
               "total_s": round(total, 1), "headline": top}
    h.write_result("summary", summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
