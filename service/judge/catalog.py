"""Which comparisons the judge makes for a route, their margins and how alpha is split.

One `MetricSpec` per metric and evidence source; the judge evaluates every
spec in every segment (plus `overall`). Alpha is split evenly (Bonferroni)
over all comparisons the route *can* make — a fixed number known before any
data arrives, so the split itself does not depend on what the data showed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from service.config import BUILTIN_SEGMENTS, RouteConfig
from service.judge.comparisons import CostRatioTest, JudgeTest, LatencyExceedanceTest, ProportionTest

# DESIGN §6: the causes blamed on the model.
MODEL_CAUSES = ("content_filtered", "refusal", "truncated", "empty_output", "invalid_json",
                "schema_violation", "invalid_tool_call")

Source = Literal["live", "shadow"]
Arm = tuple[Source, Literal["stable", "candidate"]]

LIVE_STABLE: Arm = ("live", "stable")
LIVE_CANDIDATE: Arm = ("live", "candidate")
SHADOW_STABLE: Arm = ("shadow", "stable")  # the live stable answer of each shadowed request
SHADOW_CANDIDATE: Arm = ("shadow", "candidate")
SHADOW_REPLAY: Arm = ("shadow", "replay")  # the stable model asked again on the shadowed request


def replay_available(rc: RouteConfig) -> bool:
    """Shadow records carry the stable's second answer (`stable_again`) when the noise floor is on;
    the shadow failure comparisons then use it."""
    return rc.shadow.noise_floor

PROPORTION = ProportionTest()
LATENCY = LatencyExceedanceTest()
COST = CostRatioTest()


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
    unit: Literal["pts", "ratio"]
    margin: float                  # the configured margin (for display)


def _live(name: str, label: str, field: str, test: JudgeTest, bound: float, worse_if, unit, margin) -> MetricSpec:
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
        _live("task_success_rate", "task success", "feedback", PROPORTION, -m.task_success_rate, "below", "pts",
              m.task_success_rate),
        _live("latency_p95_exceedance", "share slower than stable p95", "latency", LATENCY,
              m.latency_p95_exceedance, "above", "pts", m.latency_p95_exceedance),
        _live("cost_per_completion", "cost per completion", "cost", COST, math.log(m.cost_per_completion_ratio),
              "above", "ratio", m.cost_per_completion_ratio),
    ]
    if rc.shadow.sample_rate > 0:
        def sh(name, label, stable_arm, field, test, bound, worse_if, unit, margin, cfield=None):
            return MetricSpec(f"shadow.{name}", f"{label} (shadow)", "shadow", test, stable_arm, SHADOW_CANDIDATE,
                              field, cfield or field, bound, worse_if, unit, margin)
        # Failures: the candidate on shadowed requests against the stable asked again on the same
        # requests when records carry that replay, else against the stable's live outcomes of the same
        # window (docs/judge.md, "shadow evidence"); latency and cost pair each shadow call with the
        # live stable answer of the same request.
        fail_ref = SHADOW_REPLAY if replay_available(rc) else LIVE_STABLE
        specs += [
            sh("completion_rate", "completion rate", fail_ref, "completed", PROPORTION, -m.completion_rate,
               "below", "pts", m.completion_rate),
            sh("model_failure_rate", "model failure rate", fail_ref, "model_failed", PROPORTION,
               m.model_failure_rate, "above", "pts", m.model_failure_rate),
            *[sh(f"model_failure_rate:{c}", f"{c} rate", fail_ref, f"cause:{c}", PROPORTION,
                 m.model_failure_rate, "above", "pts", m.model_failure_rate) for c in MODEL_CAUSES],
            sh("latency_p95_exceedance", "share slower than stable p95", SHADOW_STABLE, "latency", LATENCY,
               m.latency_p95_exceedance, "above", "pts", m.latency_p95_exceedance),
            sh("cost_per_completion", "cost per completion", SHADOW_STABLE, "cost", COST,
               math.log(m.cost_per_completion_ratio), "above", "ratio", m.cost_per_completion_ratio),
        ]
        if rc.shadow.noise_floor:
            specs.append(MetricSpec("agreement_gap", "agreement vs noise floor", "shadow", PROPORTION,
                                    SHADOW_CANDIDATE, SHADOW_CANDIDATE, "floor", "agree", -m.agreement_gap,
                                    "below", "pts", m.agreement_gap))
    return specs


def route_segments(rc: RouteConfig) -> list[str]:
    """`overall` first, then the route's task types, then the built-in segments."""
    return ["overall", *rc.task_types, *BUILTIN_SEGMENTS]


def comparisons_budget(rc: RouteConfig) -> int:
    """K: every (metric, segment) comparison this route can make; alpha / K each."""
    return len(build_catalog(rc)) * len(route_segments(rc))


def alpha_per_comparison(rc: RouteConfig) -> float:
    return rc.rollout.alpha / comparisons_budget(rc)
