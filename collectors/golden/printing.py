"""What capture, `dataset stats` and replay print: rich tables (the admin CLI's), a progress bar on a
terminal and plain progress lines otherwise (both on stderr, so `--json` output stays clean)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from collectors.golden.replay import RouteRun, latency_evidence, shadow_summary
from collectors.golden.verdicts import WORSE as VERDICT_WORSE
from collectors.golden.verdicts import Agreement
from service.admin.cli import VERDICT_STYLE, _console, _shadow_tables, judge_table
from service.judge.comparisons import WORSE
from service.judge.decide import describe_effect

PLAIN_EVERY = 0.1   # plain progress: a line every tenth of the cases


def console() -> Console:
    return _console()


class Reporter:
    """`progress(step, done, total)`: a rich bar per step when stderr is a terminal, else a line now and
    then. Steps may take turns (replay answers and evaluates window by window): each keeps its own count."""

    def __init__(self, label: str):
        self.label = label
        self.tty = sys.stderr.isatty()
        self._bar: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._next: dict[str, int] = {}

    def __call__(self, step: str, done: int, total: int) -> None:
        if self.tty:
            if self._bar is None:
                self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(stderr=True), transient=True)
                self._bar.start()
                self._tasks = {}
            if step not in self._tasks:
                self._tasks[step] = self._bar.add_task(f"{self.label} {step}", total=total)
            self._bar.update(self._tasks[step], completed=done)
            if all(task.finished for task in self._bar.tasks):
                self.close()
            return
        if done == 0:
            self._next[step] = 0
        if done >= self._next.get(step, 0) or done >= total:
            print(f"{self.label}: {step} {done}/{total} cases", file=sys.stderr, flush=True)
            self._next[step] = done + max(1, int(total * PLAIN_EVERY))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def stats_table(stats: dict) -> Table:
    table = Table(title=f"{stats['cases']} cases, {stats['with_checks']} with checks")
    for col in ("route", "segment", "cases", "with checks", "checks", "feedback ✓/✗", "tags"):
        table.add_column(col, justify="right" if col in ("cases", "with checks") else "left")
    for route, segments in stats["routes"].items():
        for seg, row in segments.items():
            checks = ", ".join(f"{k} {n}" for k, n in sorted(row["checks"].items())) or "–"
            tags = ", ".join(f"{k} {n}" for k, n in sorted(row["tags"].items())) or "–"
            fb = row["feedback"]
            table.add_row(route, seg, str(row["cases"]), str(row["with_checks"]), checks,
                          f"{fb['success']}/{fb['failure']}", tags)
    return table


def verdict_table(rr: RouteRun, verdicts: dict[str, str], agreements: list[Agreement] | None) -> Table:
    title = f"replay verdicts: {rr.candidate} vs {rr.stable} on route {rr.route} (margins: rollout.margins)"
    table = Table(title=title)
    for col in ("segment", "cases", "verdict", *(("live", "agree") if agreements is not None else ()), "why"):
        table.add_column(col, justify="right" if col == "cases" else "left")
    counts: dict[str, int] = {}
    for r in rr.records:
        counts[r.segment] = counts.get(r.segment, 0) + 1
    counts["overall"] = len(rr.records)
    live = {a.segment: a for a in agreements or ()}
    for seg in list(verdicts) + [s for s in live if s not in verdicts]:
        verdict = verdicts.get(seg)
        worse = [c for c in rr.comparisons if c.segment == seg and c.verdict == WORSE and verdict == VERDICT_WORSE]
        why = "; ".join(f"{c.spec.label} {describe_effect(c)}" for c in worse[:3])
        row = [seg, str(counts.get(seg, 0)), Text(verdict or "–", style=VERDICT_STYLE.get(verdict or "", ""))]
        if agreements is not None:
            a = live.get(seg)
            row += [Text(a.live or "–", style=VERDICT_STYLE.get(a.live or "", "")) if a else "–",
                    Text("DIFFERS", style="bold red") if a and a.differs else "yes"]
        table.add_row(*row, why)
    return table


def print_run(out: Console, rr: RouteRun, verdicts: dict[str, str], agreements: list[Agreement] | None) -> None:
    """The capability matrix per segment, the judge's comparisons, the verdicts and their evidence."""
    for table in _shadow_tables(shadow_summary(rr)):
        out.print(table)
    part = {"alpha_per_comparison": rr.alpha_each, "comparisons_budget": rr.budget,
            "comparisons": [c.as_dict() for c in rr.comparisons]}
    table = judge_table(part)
    table.title = (f"replay: candidate vs stable per metric and segment (fixed-horizon intervals, "
                   f"α={rr.alpha_each:.2g} each over {rr.budget} comparisons)")
    out.print(table)
    out.print(verdict_table(rr, verdicts, agreements))
    for reason, n in rr.skipped.items():
        out.print(f"{rr.route}: {n} cases not evaluated: {reason}")
    lat = latency_evidence(rr)
    out.print(f"route {rr.route}: latency pairs {lat.pairs}; latencies discarded (measured while the event loop "
              f"ran late): candidate {lat.discarded['candidate']} of {lat.completed['candidate']}, stable "
              f"{lat.discarded['stable']} of {lat.completed['stable']}")
    worse = [c for c in rr.comparisons if c.verdict == WORSE and verdicts.get(c.segment) == VERDICT_WORSE]
    for c in worse:
        out.print(Text.assemble(("worse ", "bold red"), c.reason()))
    if agreements is not None:
        for a in agreements:
            if a.differs:
                out.print(Text.assemble(("differs from live ", "bold yellow"),
                                        f"segment {a.segment}: offline {a.offline or 'no cases'}, live "
                                        f"{a.live or 'no comparison'} (the dataset may no longer represent this "
                                        f"segment's traffic)"))
