"""Render the Rollout dashboard's key panels to docs/rollout-dashboard.png from a real demo run.

What it does, with real components only (loopback):
  1. starts the simulator with service/demo/configs/simulator.yaml and `modelcanary serve` with
     service/demo/configs/modelcanary.yaml (ports and state directories rewritten into a temporary
     directory, as `modelcanary demo` does);
  2. starts the Debian `prometheus` scraping the proxy every second, with the recording rules
     of dashboards/prometheus/rules.yaml loaded;
  3. drives the demo's mixed traffic (chat, tools, JSON, multi-turn, streaming, billing) for
     `--duration` seconds;
  4. asks Prometheus's range API for the Rollout dashboard's panels, using the panel
     expressions of the committed dashboard JSON (`dashboards.queries`, $route=support-bot),
     and draws them with matplotlib into a 2×2 grid.

    .venv/bin/python docs/render_dashboard.py [--duration 75] [--good-candidate] [--out docs/rollout-dashboard.png]

Needs /usr/bin/prometheus (apt-get install prometheus).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from dashboards.queries import annotation_queries, default_variables, panel_queries, substitute  # noqa: E402
from service.demo.runner import ROUTE, DemoStack, _traffic  # noqa: E402
from tests.fixtures.prometheus import PromServer, start_prometheus  # noqa: E402

DASHBOARD = ROOT / "dashboards" / "json" / "modelcanary-rollout.json"
RULES = ROOT / "dashboards" / "prometheus" / "rules.yaml"
OUT = Path(__file__).resolve().parent / "rollout-dashboard.png"
RATE_INTERVAL = "15s"     # $__rate_interval: short, because the whole run is about a minute
STEP_S = 1.0              # query_range resolution = the scrape interval
ANNOTATION_INTERVAL = "5s"  # $__interval for the decision annotations

ROLE_COLORS = {"stable": "#1f77b4", "canary": "#ff7f0e", "shadow": "#7f7f7f"}
PHASE_COLORS = {"shadow": "#d9d9d9", "canary": "#fdd0a2", "promoted": "#c7e9c0", "rolled_back": "#fcbba1",
                "paused": "#fff7bc"}
DECISION_COLORS = {"step": "#2171b5", "promote": "#238b45", "rollback": "#cb181d"}


# --- services ---------------------------------------------------------------------------------


async def drive(url: str, duration_s: float, rate: float) -> int:
    """The demo's traffic mix at `rate` requests/s for `duration_s`; returns the number sent."""
    stop = asyncio.Event()
    sent = [0]
    task = asyncio.create_task(_traffic(url, stop, rate=rate, sent=sent))
    started = time.monotonic()
    while time.monotonic() - started < duration_s:
        await asyncio.sleep(1)
        if int(time.monotonic() - started) % 10 == 0:
            print(f"  {time.monotonic() - started:4.0f} s  {sent[0]} requests sent", flush=True)
    stop.set()
    await task
    return sent[0]


# --- Prometheus queries -------------------------------------------------------------------------


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_targets(model: dict, title: str) -> list[tuple[str, str, str]]:
    """(refId, expr, legendFormat) of a panel, expressions as `dashboards.queries` extracts them."""
    legends = {}
    for panel in model["panels"]:
        if panel.get("title") == title:
            legends = {t["refId"]: t.get("legendFormat", "") for t in panel.get("targets", [])}
    targets = [(q.ref_id, q.expr, legends.get(q.ref_id, "")) for q in panel_queries(model) if q.panel == title]
    if not targets:
        raise KeyError(f"no panel {title!r} in {DASHBOARD}")
    return targets


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels)


Series = tuple[str, dict[str, str], list[float], list[float]]   # legend, labels, times, values


def fetch(prom: PromServer, expr: str, fmt: str, variables: dict[str, str], start: float, end: float,
          step: float = STEP_S) -> list[Series]:
    out = []
    for s in prom.query_range(substitute(expr, variables), start, end, step):
        ts = [float(t) for t, _ in s["values"]]
        vs = [float(v) for _, v in s["values"]]
        out.append((legend(fmt, s["metric"]), s["metric"], ts, vs))
    return out


def onsets(series: list[Series], step: float) -> list[float]:
    """Start times of each run of consecutive samples (annotation regions → one marker each)."""
    times: list[float] = []
    for _, _, ts, _ in series:
        prev = None
        for t in ts:
            if prev is None or t - prev > step * 1.5:
                times.append(t)
            prev = t
    return sorted(times)


# --- drawing ------------------------------------------------------------------------------------


def _role_order(name: str) -> tuple[int, str]:
    return ({"stable": 0, "canary": 1}.get(name.split()[0], 2), name)


def _time_axis(ax, t0: float) -> None:
    ax.set_xlabel("seconds since traffic started")
    ax.grid(True, alpha=0.3)


def draw_completion(ax, series: list[Series], t0: float, title: str) -> None:
    for name, labels, ts, vs in sorted(series, key=lambda s: _role_order(s[0])):
        ax.plot([t - t0 for t in ts], [v * 100 for v in vs], label=name, color=ROLE_COLORS.get(labels.get("role")),
                linewidth=1.8)
    ax.set_title(title, loc="left", fontweight="bold")
    ax.set_ylabel("% of live requests completed")
    lows = [v * 100 for _, _, _, vs in series for v in vs if v == v]
    ax.set_ylim(max(0.0, min(lows, default=0) - 5), 100.5)
    _time_axis(ax, t0)
    ax.legend(loc="lower left", title="role")


def draw_latency(ax, series: list[Series], t0: float, title: str) -> None:
    for name, labels, ts, vs in sorted(series, key=lambda s: _role_order(s[0])):
        pts = [(t - t0, v * 1000) for t, v in zip(ts, vs, strict=True) if v == v]   # NaN: no requests yet
        if pts:
            ax.plot(*zip(*pts, strict=True), label=name, color=ROLE_COLORS.get(labels.get("role")), linewidth=1.8)
    ax.set_title(title, loc="left", fontweight="bold")
    ax.set_ylabel("milliseconds")
    ax.set_ylim(bottom=0)
    _time_axis(ax, t0)
    ax.legend(loc="best", title="role")


def draw_failures(ax, series: list[Series], t0: float, title: str) -> None:
    """Stacked, as the panel is: one band per role · cause; a cause keeps its hue, canary is the darker shade."""
    if not series:
        ax.text(0.5, 0.5, "no failures", ha="center", transform=ax.transAxes)
        return
    grid = sorted({t for _, _, ts, _ in series for t in ts})
    causes = sorted({s[1].get("cause", "") for s in series})
    pairs = plt.get_cmap("tab20").colors     # (dark, light) pairs
    ordered = sorted(series, key=lambda s: (_role_order(s[1].get("role", ""))[0], s[1].get("cause", "")))
    ys, labels, colors = [], [], []
    for name, lab, ts, vs in ordered:
        by_t = dict(zip(ts, vs, strict=True))
        ys.append([by_t.get(t, 0.0) for t in grid])
        labels.append(name)
        hue = causes.index(lab.get("cause", "")) % 10
        colors.append(pairs[2 * hue] if lab.get("role") == "canary" else pairs[2 * hue + 1])
    ax.stackplot([t - t0 for t in grid], ys, labels=labels, colors=colors, alpha=0.9, linewidth=0)
    ax.set_title(title, loc="left", fontweight="bold")
    ax.set_ylabel("failed requests / s (stacked)")
    top = max((sum(col) for col in zip(*ys, strict=True)), default=1.0)
    ax.set_ylim(0, top * (1.25 + 0.09 * ((len(labels) + 2) // 3)))    # headroom for the legend
    _time_axis(ax, t0)
    ax.legend(loc="upper left", fontsize=8, ncol=3, title="role · cause (canary = darker shade)", title_fontsize=8)


def draw_rollout(ax, weight: list[Series], phases: list[Series], decisions: dict[str, list[float]], t0: float,
                 end: float, title: str) -> None:
    """Canary weight as a line, the phase as background bands, the judge's decisions as markers."""
    seen_phases: dict[str, float] = {}
    for name, _, ts, vs in phases:
        run_start = None
        for t, v in [*zip(ts, vs, strict=True), (float("inf"), 0.0)]:
            if v >= 0.5 and run_start is None:
                run_start = t
            elif v < 0.5 and run_start is not None:
                stop = min(t, end) if t != float("inf") else ts[-1] + STEP_S
                ax.axvspan(run_start - t0, stop - t0, color=PHASE_COLORS.get(name, "#eeeeee"), alpha=0.8, lw=0)
                seen_phases.setdefault(name, run_start)
                run_start = None
    for name, _, ts, vs in weight:
        ax.step([t - t0 for t in ts], [v * 100 for v in vs], where="post", color="black", linewidth=2,
                label=f"canary weight ({name})")
    for decision, times in decisions.items():
        for i, t in enumerate(times):
            ax.axvline(t - t0, color=DECISION_COLORS[decision], linestyle="--", linewidth=1.4,
                       label=f"judge: {decision}" if i == 0 else None)
    ax.set_title(title, loc="left", fontweight="bold")
    ax.set_ylabel("% of live traffic to the candidate")
    ax.set_ylim(-2, 102)
    _time_axis(ax, t0)
    handles, labels = ax.get_legend_handles_labels()
    handles += [Patch(color=PHASE_COLORS.get(p, "#eeeeee"), label=f"phase: {p}")
                for p in sorted(seen_phases, key=seen_phases.__getitem__)]
    ax.legend(handles=handles, loc="upper left", fontsize=8)


def collect(prom: PromServer, start: float, end: float) -> dict:
    """Range-query the panels drawn here, with the dashboard's own expressions; JSON-serialisable."""
    model = load_dashboard()
    variables = default_variables(ROUTE, rate_interval=RATE_INTERVAL, interval=ANNOTATION_INTERVAL,
                                  range_=f"{int(end - start)}s")

    def one(title: str, ref: str = "A") -> list[Series]:
        for ref_id, expr, fmt in panel_targets(model, title):
            if ref_id == ref:
                return fetch(prom, expr, fmt, variables, start, end)
        raise KeyError((title, ref))

    decisions = {}
    for name, expr in annotation_queries(model):
        series = fetch(prom, expr, "{{decision}}", variables, start, end)
        if series:
            decisions[name.removeprefix("decision: ")] = onsets(series, STEP_S)
    raw = prom.query_range(f'modelcanary_rollout_decisions_total{{route="{ROUTE}"}}', start, end, STEP_S)
    return {
        "start": start, "end": end,
        "completion": one("Completion rate by role"),
        "p95": one("Request latency p50 / p95 / p99 by role", "B"),    # B = the p95 target
        "failures": one("Failures by cause"),
        "weight": one("Canary weight"),
        "phases": one("Phase"),
        "decisions": decisions,
        # diagnostics: a decision counter whose first sample is already > 0 is invisible to increase()
        "decision_counters": {s["metric"]["decision"]: (float(s["values"][0][1]), float(s["values"][-1][1]))
                              for s in raw},
    }


def render(data: dict, out: Path, subtitle: str) -> None:
    start, end = data["start"], data["end"]
    fig, axes = plt.subplots(2, 2, figsize=(15, 9.5), dpi=110)
    draw_completion(axes[0][0], data["completion"], start, "Completion rate by role")
    draw_latency(axes[0][1], data["p95"], start, "Request latency p95 by role")
    draw_failures(axes[1][0], data["failures"], start, "Failures by cause")
    draw_rollout(axes[1][1], data["weight"], data["phases"], data["decisions"], start, end,
                 "Canary weight and phase, with the judge's decisions")
    for ax in axes.flat:
        ax.set_xlim(0, end - start)
    fig.suptitle(f"modelcanary / Rollout — route {ROUTE}", fontsize=15, fontweight="bold", x=0.01, ha="left")
    fig.text(0.01, 0.945, subtitle, fontsize=9, color="#555555", ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def summarize(data: dict) -> None:
    def last(series: list[Series]) -> dict[str, float]:
        out = {}
        for name, _, _, vs in series:
            finite = [v for v in vs if v == v]
            if finite:
                out[name] = finite[-1]
        return out

    print("completion (last):", {k: f"{v:.1%}" for k, v in last(data["completion"]).items()})
    print("p95 (last):", {k: f"{v * 1000:.0f} ms" for k, v in last(data["p95"]).items()})
    totals: dict[str, int] = defaultdict(int)
    for name, _, _, vs in data["failures"]:
        totals[name] += len(vs)
    print("failure series:", sorted(totals))
    print("weight (last):", last(data["weight"]))
    print("phases seen:", sorted({n for n, _, _, vs in data["phases"] if any(v >= 0.5 for v in vs)}))
    print("decision annotations:", {k: len(v) for k, v in data["decisions"].items()})
    print("decision counters (first, last sample):", data["decision_counters"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=75.0, help="seconds of traffic (default 75)")
    ap.add_argument("--rate", type=float, default=150.0, help="requests per second (default 150, as the demo)")
    ap.add_argument("--good-candidate", action="store_true", help="candidate better-model instead of new-model")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, TSDB)")
    ap.add_argument("--save-data", type=Path, help="also write the query results (JSON) here")
    ap.add_argument("--replot", type=Path, help="draw from query results saved by --save-data; no run")
    args = ap.parse_args(argv)

    if args.replot:
        data = json.loads(args.replot.read_text())
        render(data, args.out, data["subtitle"])
        summarize(data)
        print(f"wrote {args.out}")
        return 0

    workdir = Path(tempfile.mkdtemp(prefix="modelcanary-render-"))
    services = DemoStack(workdir, args.good_candidate)
    prom = None
    ok = False
    try:
        if not services.ready():
            raise RuntimeError(f"services did not start:\n{services.log_path.read_text(errors='replace')[-3000:]}")
        prom = start_prometheus(workdir / "prometheus", [f"127.0.0.1:{services.proxy_port}"], [RULES], "1s")
        prom.wait_targets_up(timeout=30)
        print(f"proxy {services.url}, prometheus {prom.url}, workdir {workdir}", flush=True)
        start = time.time()
        sent = asyncio.run(drive(services.url, args.duration, args.rate))
        time.sleep(3)     # two more scrapes and rule evaluations
        end = time.time()
        candidate = "better-model" if args.good_candidate else "new-model"
        subtitle = (f"Rendered by docs/render_dashboard.py from Prometheus range queries (step {STEP_S:.0f} s, "
                    f"$__rate_interval={RATE_INTERVAL}) after {args.duration:.0f} s of `modelcanary demo` traffic "
                    f"({sent} requests); stable good-model vs candidate {candidate}; "
                    f"{datetime.fromtimestamp(start).strftime('%Y-%m-%d')}.")
        data = collect(prom, start, end)
        data["subtitle"] = subtitle
        if args.save_data:
            args.save_data.write_text(json.dumps(data))
        render(data, args.out, subtitle)
        summarize(data)
        print(f"wrote {args.out}")
        ok = True
        return 0
    finally:
        if prom is not None:
            prom.stop()
        services.stop()
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
