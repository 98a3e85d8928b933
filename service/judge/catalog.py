"""Which comparisons the judge makes for a route, their margins and how alpha is split.

One `MetricSpec` per metric, with all its evidence: a primary part (its own
fields) and `also`, more evidence of the same quantity from another source
(the paired shadow records of a live metric), combined by stratification.
The judge evaluates every spec in every segment (plus `overall`). On the
rollback side alpha is split evenly (Bonferroni) over all comparisons the route
*can* make — a fixed number known before any data arrives, so the split itself
does not depend on what the data showed; promotion needs every required
comparison, so each takes the full alpha there (docs/judge.md §4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from service.config import BUILTIN_SEGMENTS, RouteConfig
from service.judge.comparisons import (
    CostRatioTest,
    JudgeTest,
    LatencyExceedanceTest,
    PairedCostRatioTest,
    PairedExceedanceTest,
    PairedMeanTest,
    ProportionTest,
)

# DESIGN §6: the causes blamed on the model.
MODEL_CAUSES = ("content_filtered", "refusal", "truncated", "empty_output", "invalid_json",
                "schema_violation", "invalid_tool_call")

Source = Literal["live", "shadow", "pooled"]
Arm = tuple[Source, Literal["stable", "candidate"]]

LIVE_STABLE: Arm = ("live", "stable")
LIVE_CANDIDATE: Arm = ("live", "candidate")
# shadow records: the candidate's answer and what it is paired with (the stable asked again, the live answer)
SHADOW_CANDIDATE: Arm = ("shadow", "candidate")
# live canary outcomes and the candidate's shadow outcomes together (shadow failures without a replay)
POOLED_CANDIDATE: Arm = ("pooled", "candidate")


def replay_available(rc: RouteConfig) -> bool:
    """Shadow records carry the stable's second answer (`stable_again`) when the noise floor is on;
    the shadow failure comparisons then use it."""
    return rc.shadow.noise_floor


PROPORTION = ProportionTest()
LATENCY = LatencyExceedanceTest()
COST = CostRatioTest()
BINARY_PAIRS = PairedMeanTest()                            # McNemar-style: discordant pairs of 0/1 outcomes
LATENCY_PAIRS = PairedExceedanceTest()
COST_PAIRS = PairedCostRatioTest()
SIMILARITY_PAIRS = PairedMeanTest()                        # a difference of two similarities in [0, 1]
PREFERENCE_PAIRS = PairedMeanTest(effect_range=(-2.0, 2.0), prior_sd=2.0)  # two verdicts in {−1, 0, 1}


@dataclass(frozen=True)
class Part:
    """One source of evidence of a metric: a test and where its two arms' fields come from."""

    source: Source
    test: JudgeTest
    stable_arm: Arm
    candidate_arm: Arm
    stable_field: str
    candidate_field: str


@dataclass(frozen=True)
class MetricSpec:
    name: str                      # evidence `metric`, e.g. "completion_rate", "shadow.model_failure_rate:refusal"
    label: str                     # for reasons, e.g. "completion rate (shadow)"
    source: Source
    test: JudgeTest
    stable_arm: Arm
    candidate_arm: Arm
    stable_field: str              # accumulator field set, see evidence.ArmAcc.fields
    candidate_field: str
    bound: float                   # non-inferiority bound in effect units
    worse_if: Literal["above", "below"]
    unit: Literal["pts", "ratio", "score"]
    margin: float                  # the configured margin (for display)
    also: tuple[Part, ...] = ()    # more evidence of the same quantity, another source (stratified)

    @property
    def parts(self) -> tuple[Part, ...]:
        first = Part(self.source, self.test, self.stable_arm, self.candidate_arm, self.stable_field,
                     self.candidate_field)
        return (first, *self.also)


def _live(name: str, label: str, field: str, test: JudgeTest, bound: float, worse_if: Literal["above", "below"],
          unit: Literal["pts", "ratio", "score"], margin: float) -> MetricSpec:
    return MetricSpec(name, label, "live", test, LIVE_STABLE, LIVE_CANDIDATE, field, field, bound, worse_if, unit, margin)


def build_catalog(rc: RouteConfig) -> list[MetricSpec]:
    m = rc.rollout.margins
    specs = [
        _live("completion_rate", "completion rate", "completed", PROPORTION, -m.completion_rate, "below", "pts",
              m.completion_rate),
        _live("model_failure_rate", "model failure rate", "model_failed", PROPORTION, m.model_failure_rate,
              "above", "pts", m.model_failure_rate),
        *[_live(f"model_failure_rate:{c}", f"{c} rate", f"cause:{c}", PROPORTION, m.model_failure_rate,
                "above", "pts", m.model_failure_rate) for c in MODEL_CAUSES],
        _live("client_retry_rate", "client retry rate", "retry", PROPORTION, m.client_retry_rate, "above", "pts",
              m.client_retry_rate),
        # answers cut by the client's own cap: not a failure, but a more verbose candidate reaches it more often
        _live("max_tokens_rate", "max_tokens rate", "max_tokens", PROPORTION, m.model_failure_rate, "above", "pts",
              m.model_failure_rate),
        _live("task_success_rate", "task success", "feedback", PROPORTION, -m.task_success_rate, "below", "pts",
              m.task_success_rate),
        _live("latency_p95_exceedance", "share slower than stable p95", "latency", LATENCY,
              m.latency_p95_exceedance, "above", "pts", m.latency_p95_exceedance),
        _live("cost_per_completion", "cost per completion", "cost", COST, math.log(m.cost_per_completion_ratio),
              "above", "ratio", m.cost_per_completion_ratio),
    ]
    if rc.shadow.sample_rate > 0:
        specs = [_with_shadow(spec, rc) for spec in specs]
        if rc.shadow.noise_floor:
            specs.append(MetricSpec("agreement_gap", "agreement vs noise floor", "shadow", BINARY_PAIRS,
                                    SHADOW_CANDIDATE, SHADOW_CANDIDATE, "agreement", "agreement", -m.agreement_gap,
                                    "below", "pts", m.agreement_gap))
        specs += _paired(rc)
    return specs


# Live metrics that shadow records measure too (the field of the live arms → the shadow part's).
_SHADOWED = {"completed": "replay:completed", "model_failed": "replay:model_failed",
             **{f"cause:{c}": f"replay:cause:{c}" for c in MODEL_CAUSES}}


def _with_shadow(spec: MetricSpec, rc: RouteConfig) -> MetricSpec:
    """The live metric with its shadow evidence (docs/judge.md §2, "one metric, all its evidence").

    Failures: each shadowed request's candidate outcome paired with the stable asked again on it
    (McNemar-style) when records carry that replay; otherwise the candidate's shadow outcomes join
    its live ones against the stable's live outcomes of the same window. Latency and cost: each
    shadow call paired with the live stable answer of the same request.
    """
    if spec.stable_field in _SHADOWED:
        if not replay_available(rc):
            return replace(spec, candidate_arm=POOLED_CANDIDATE)
        field = _SHADOWED[spec.stable_field]
        return replace(spec, also=(Part("shadow", BINARY_PAIRS, SHADOW_CANDIDATE, SHADOW_CANDIDATE, field, field),))
    if spec.stable_field == "latency":
        return replace(spec, also=(Part("shadow", LATENCY_PAIRS, SHADOW_CANDIDATE, SHADOW_CANDIDATE,
                                        "latency_pairs:stable", "latency_pairs"),))
    if spec.stable_field == "cost":
        return replace(spec, also=(Part("shadow", COST_PAIRS, SHADOW_CANDIDATE, SHADOW_CANDIDATE, "cost_pairs:stable",
                                        "cost_pairs"),))
    return spec


def _paired(rc: RouteConfig) -> list[MetricSpec]:
    """Shadow comparisons paired per request (evidence.paired_values): one difference per record."""
    m = rc.rollout.margins

    def paired(name: str, label: str, test: JudgeTest, margin: float) -> MetricSpec:
        field = f"pair:{name}"
        return MetricSpec(name, label, "shadow", test, SHADOW_CANDIDATE, SHADOW_CANDIDATE, field, field,
                          -margin, "below", "score", margin)

    out = []
    if rc.shadow.noise_floor:
        out.append(paired("similarity_gap", "similarity vs noise floor", SIMILARITY_PAIRS, m.similarity_gap))
    if rc.shadow.judge is not None:
        out.append(paired("judge_preference", "judge preference vs its noise floor", PREFERENCE_PAIRS,
                          m.judge_preference))
    if rc.shadow.stability.sample_rate > 0:
        out.append(paired("stability_gap", "stability vs stable", SIMILARITY_PAIRS, m.stability_gap))
    return out


# What one observation of a shadow-only comparison is (its evidence has no live part).
_PAIR_UNITS = {"agreement_gap": "shadow samples", "similarity_gap": "shadow samples",
               "judge_preference": "judged shadow samples", "stability_gap": "stability pairs"}


def sample_unit(spec: MetricSpec) -> str:
    """What a forecast's `needed_n` counts for this metric: the observations its evidence grows by
    (docs/judge.md §5)."""
    if all(p.source == "shadow" for p in spec.parts):
        return _PAIR_UNITS.get(spec.name, "shadow samples")
    if any(p.source == "shadow" or p.candidate_arm == POOLED_CANDIDATE for p in spec.parts):
        return "candidate samples (canary and shadow)"
    return "canary feedback events" if spec.candidate_field == "feedback" else "canary samples"


def route_segments(rc: RouteConfig) -> list[str]:
    """`overall` first, then the route's task types, then the built-in segments."""
    return ["overall", *rc.task_types, *BUILTIN_SEGMENTS]


def comparisons_budget(rc: RouteConfig) -> int:
    """K: every (metric, segment) comparison this route can make; alpha / K each on the rollback side."""
    return len(build_catalog(rc)) * len(route_segments(rc))


def alpha_per_comparison(rc: RouteConfig) -> float:
    return rc.rollout.alpha / comparisons_budget(rc)
