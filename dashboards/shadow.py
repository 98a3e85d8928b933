"""Shadow evaluation dashboard: the candidate replayed on sampled live traffic."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from dashboards.panels import RATE, ROUTE, dashboard, or_zero, rate_sum, ratio, row, sel, stat, timeseries

UID = "modelcanary-shadow"

AGREEMENT = "modelcanary_shadow_agreement_total"
EVALUATIONS = "modelcanary_shadow_evaluations_total"
SHADOW_REQ = "modelcanary_shadow_requests_total"


def build() -> Dashboard:
    d = dashboard(
        UID,
        "modelcanary / Shadow evaluation",
        "Sampled live requests replayed to the candidate (and to the stable model again for the noise floor): "
        "agreement against the noise floor, evaluator pass rates, drops and throughput.",
    )

    d = d.with_row(row("Agreement"))
    d = d.with_panel(timeseries(
        "Agreement with the live stable answer: candidate vs noise floor",
        [(ratio("comparison", AGREEMENT, [ROUTE, 'result="agree"'], [ROUTE]), "{{comparison}}")],
        unit="percentunit", max_val=1, width=16,
        description="candidate: the candidate's answer agrees with the live stable answer. noise_floor: the stable "
                    "model asked again agrees with itself. A candidate is only as different as it trails the "
                    "noise floor.",
    ))
    d = d.with_panel(stat(
        "Agreement over the time range",
        [(ratio("comparison", AGREEMENT, [ROUTE, 'result="agree"'], [ROUTE], window="$__range", fn="increase"),
          "{{comparison}}")],
        unit="percentunit", width=8, height=8,
    ))

    d = d.with_row(row("Evaluators"))
    d = d.with_panel(timeseries(
        "Evaluator pass rate by evaluator",
        [(ratio("evaluator", EVALUATIONS, [ROUTE, 'result="pass"'], [ROUTE]), "{{evaluator}}")],
        unit="percentunit", max_val=1,
        description="Share of shadow evaluations that passed (errors count as not passed). Per-segment pass rates "
                    "are in the capability matrix of `modelcanary report`.",
    ))
    d = d.with_panel(timeseries(
        "Evaluation results by evaluator",
        [(rate_sum("evaluator, result", EVALUATIONS, ROUTE), "{{evaluator}} · {{result}}")],
        unit="ops", stacked=True,
    ))

    d = d.with_row(row("Throughput and drops"))
    d = d.with_panel(timeseries(
        "Shadow calls by model and outcome",
        [(rate_sum("model, outcome", SHADOW_REQ, ROUTE), "{{model}} · {{outcome}}")],
        unit="reqps", stacked=True, width=8,
    ))
    d = d.with_panel(timeseries(
        "Evaluation throughput",
        [(f"sum (rate({sel(EVALUATIONS, ROUTE)}[{RATE}]))", "evaluations/s")],
        unit="ops", width=8,
    ))
    d = d.with_panel(timeseries(
        "Shadow drops by reason",
        [(or_zero(rate_sum("reason", "modelcanary_shadow_dropped_total", ROUTE), "reason"), "{{reason}}")],
        unit="ops", stacked=True, width=8,
        description="Sampled requests not shadowed: budget (max_per_minute / max_usd_per_hour), queue_full, error. "
                    "Reads 0 (reason=none) until the first drop.",
    ))
    return d
