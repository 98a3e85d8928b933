"""Answer quality on the shadow sample, per segment, for the report (`report["shadow"]`).

From each EvaluationRecord's `similarity`, `judge` and `stability`:

- similarity: the candidate's answer to the live stable answer, against the noise floor (the stable
  model asked again, to the same live answer); the gap is the mean of one difference per request;
- judge: the pairwise judge's verdicts for the candidate (win / tie / loss / error) and for the
  stable asked again (its noise floor); preference = (wins − losses) / n, and the gap is the mean of
  the per-request difference of the two verdicts (win 1, tie 0, loss −1);
- stability: the mean pairwise similarity of each model's k answers to the same request, and the gap.

Every mean comes with a 95% normal-approximation interval (fixed horizon, for display: decisions
use the judge's anytime-valid intervals), clipped to the range its values lie in.

summary() format, `report["shadow"]["segments"][<segment>]["quality"]`:

    {"similarity": {"candidate_vs_stable": M, "noise_floor": M, "gap": M},
     "judge": {"candidate": V, "noise_floor": V, "gap": M},
     "stability": {"candidate": M, "stable": M, "gap": M}}
    M = {"value", "n", "interval": [lo, hi] | None}
    V = {"win": int, "tie": int, "loss": int, "error": int, "preference": M}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.records import JUDGE_SCORES, EvaluationRecord

if TYPE_CHECKING:
    from rich.table import Table

Z = 1.959963984540054
VERDICTS = ("win", "tie", "loss", "error")


@dataclass(slots=True)
class Mean:
    """A running mean of values that lie in [low, high]; its interval is clipped to that range."""

    low: float
    high: float
    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        self.squares += x * x

    def summary(self) -> dict:
        if not self.n:
            return {"value": None, "n": 0, "interval": None}
        mean = self.total / self.n
        interval = None
        if self.n >= 2:
            var = max(0.0, (self.squares - self.n * mean * mean) / (self.n - 1))
            half = Z * math.sqrt(var / self.n)
            interval = [max(self.low, mean - half), min(self.high, mean + half)]
        return {"value": mean, "n": self.n, "interval": interval}


@dataclass
class Verdicts:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VERDICTS, 0))
    preference: Mean = field(default_factory=lambda: Mean(-1.0, 1.0))

    def add(self, verdict: str) -> None:
        self.counts[verdict] += 1
        if verdict in JUDGE_SCORES:
            self.preference.add(JUDGE_SCORES[verdict])

    def summary(self) -> dict:
        return {**self.counts, "preference": self.preference.summary()}


@dataclass
class Paired:
    """Two sides of one request and their per-request difference."""

    candidate: Mean = field(default_factory=lambda: Mean(0.0, 1.0))  # similarities
    stable: Mean = field(default_factory=lambda: Mean(0.0, 1.0))
    gap: Mean = field(default_factory=lambda: Mean(-1.0, 1.0))

    def add(self, candidate: float | None, stable: float | None) -> None:
        if candidate is not None:
            self.candidate.add(candidate)
        if stable is not None:
            self.stable.add(stable)
        if candidate is not None and stable is not None:
            self.gap.add(candidate - stable)


@dataclass
class Quality:
    similarity: Paired = field(default_factory=Paired)
    judge_candidate: Verdicts = field(default_factory=Verdicts)
    judge_noise: Verdicts = field(default_factory=Verdicts)
    judge_gap: Mean = field(default_factory=lambda: Mean(-2.0, 2.0))  # two verdicts' scores apart
    stability: Paired = field(default_factory=Paired)

    def add(self, r: EvaluationRecord) -> None:
        self.similarity.add(r.similarity.candidate_vs_stable, r.similarity.stable_vs_stable)
        self.stability.add(r.stability.candidate, r.stability.stable)
        verdict = r.judge
        if verdict.result is not None:
            self.judge_candidate.add(verdict.result)
        elif any(e.name == "judge" for e in r.evaluations):
            self.judge_candidate.add("error")
        if verdict.noise is not None:
            self.judge_noise.add(verdict.noise)
        elif verdict.noise_failed:
            self.judge_noise.add("error")
        if verdict.result is not None and verdict.noise is not None:
            self.judge_gap.add(JUDGE_SCORES[verdict.result] - JUDGE_SCORES[verdict.noise])

    def summary(self) -> dict:
        return {
            "similarity": {"candidate_vs_stable": self.similarity.candidate.summary(),
                           "noise_floor": self.similarity.stable.summary(), "gap": self.similarity.gap.summary()},
            "judge": {"candidate": self.judge_candidate.summary(), "noise_floor": self.judge_noise.summary(),
                      "gap": self.judge_gap.summary()},
            "stability": {"candidate": self.stability.candidate.summary(), "stable": self.stability.stable.summary(),
                          "gap": self.stability.gap.summary()},
        }


def _mean(m: dict | None) -> str:
    if not m or m.get("value") is None:
        return "–"
    iv = m.get("interval")
    return f"{m['value']:.3f}" + (f" [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else "")


def _verdicts(v: dict) -> str:
    return f"{v['win']}/{v['tie']}/{v['loss']}" + (f" ({v['error']} errors)" if v["error"] else "")


def quality_table(summary: dict) -> Table:
    """A rich Table: one row per segment with any quality data, candidate against its reference."""
    from rich.table import Table

    table = Table(title="shadow answer quality: similarity to the live answer, pairwise judge (win/tie/loss), "
                        "stability of k answers (95% intervals)")
    for col in ("segment", "similarity candidate", "noise floor", "gap", "judge candidate", "preference",
                "judge noise floor", "preference gap", "stability candidate", "stable", "stability gap"):
        table.add_column(col, justify="left" if col == "segment" else "right")
    for name, row in (summary.get("segments") or {}).items():
        q = row.get("quality")
        if not q:
            continue
        sim, judge, stab = q["similarity"], q["judge"], q["stability"]
        if not (sim["candidate_vs_stable"]["n"] or stab["candidate"]["n"] or any(judge["candidate"][v] for v in VERDICTS)):
            continue
        table.add_row(name, _mean(sim["candidate_vs_stable"]), _mean(sim["noise_floor"]), _mean(sim["gap"]),
                      _verdicts(judge["candidate"]), _mean(judge["candidate"]["preference"]),
                      _verdicts(judge["noise_floor"]), _mean(judge["gap"]),
                      _mean(stab["candidate"]), _mean(stab["stable"]), _mean(stab["gap"]))
    return table
