"""Shadow evaluation dashboard: the candidate replayed on sampled live traffic."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from dashboards.panels import (
    RATE,
    ROUTE,
    dashboard,
    or_zero,
    quantile,
    rate_sum,
    ratio,
    row,
    sel,
    stat,
    timeseries,
)

UID = "modelcanary-shadow"

AGREEMENT = "modelcanary_shadow_agreement_total"
EVALUATIONS = "modelcanary_shadow_evaluations_total"
SHADOW_REQ = "modelcanary_shadow_requests_total"
SIMILARITY = "modelcanary_shadow_similarity"
JUDGE = "modelcanary_shadow_judge_total"


def mean_similarity(window: str = RATE, fn: str = "rate") -> str:
    """Mean similarity per comparison: Σ / count of the histogram."""
    return (f"{rate_sum('comparison', SIMILARITY + '_sum', ROUTE, window=window, fn=fn)} / "
            f"{rate_sum('comparison', SIMILARITY + '_count', ROUTE, window=window, fn=fn)}")


def judge_preference(window: str = RATE, fn: str = "rate") -> str:
    """(wins − losses) / verdicts per comparison; errors are not verdicts."""
    wins, losses, verdicts = (rate_sum("comparison", JUDGE, ROUTE, f'result=~"{r}"', window=window, fn=fn)
                              for r in ("win", "loss", "win|tie|loss"))
    return f"(({wins} or {verdicts} * 0) - ({losses} or {verdicts} * 0)) / {verdicts}"


def build() -> Dashboard:
    d = dashboard(
        UID,
        "modelcanary / Shadow evaluation",
        "Sampled live requests replayed to the candidate (and to the stable model again for the noise floor): "
        "agreement and similarity against the noise floor, the pairwise judge's preference against its own "
        "noise floor, evaluator pass rates, drops and throughput.",
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

    d = d.with_row(row("Similarity and the pairwise judge"))
    d = d.with_panel(timeseries(
        "Mean similarity to the live stable answer: candidate vs noise floor",
        [(mean_similarity(), "{{comparison}}")],
        unit="percentunit", max_val=1, width=16,
        description="Similarity in [0, 1] (text: sentence embeddings; JSON and tool calls: matching leaves). "
                    "candidate: its answer against the live stable answer; noise_floor: the stable model asked "
                    "again against the same live answer. The judge's similarity_gap compares them per request and "
                    "per segment (`modelcanary report`).",
    ))
    d = d.with_panel(stat(
        "Mean similarity over the time range",
        [(mean_similarity(window="$__range", fn="increase"), "{{comparison}}")],
        unit="percentunit", width=8, height=8,
    ))
    d = d.with_panel(timeseries(
        "Similarity p10 and median",
        [(quantile(0.1, SIMILARITY, "comparison", ROUTE), "p10 {{comparison}}"),
         (quantile(0.5, SIMILARITY, "comparison", ROUTE), "p50 {{comparison}}")],
        unit="percentunit", max_val=1, width=8,
        description="A low tail on the candidate that the noise floor does not have: answers that say something else.",
    ))
    d = d.with_panel(timeseries(
        "Judge preference: (wins − losses) / verdicts, candidate vs noise floor",
        [(judge_preference(), "{{comparison}}")],
        unit="percentunit", min_val=-1, max_val=1, width=8,
        description="The pairwise judge compares each answer with the live stable answer in both orders (a "
                    "preference that flips with the order is a tie). noise_floor: the stable model asked again, "
                    "judged the same way; an unbiased judge balances there. The judge's judge_preference compares "
                    "the two per request and per segment.",
    ))
    d = d.with_panel(timeseries(
        "Judge verdicts by comparison and result",
        [(rate_sum("comparison, result", JUDGE, ROUTE), "{{comparison}} · {{result}}")],
        unit="ops", stacked=True, width=8,
        description="result=error: the judge's answer could not be parsed or the call failed (never a win).",
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
        description="The candidates' calls, and the stable model's when asked again for the noise floor "
                    "(once per evaluation).",
    ))
    d = d.with_panel(timeseries(
        "Evaluation throughput",
        [(f"sum (max by (route, model) (sum by (route, model, evaluator) (rate({sel(EVALUATIONS, ROUTE)}[{RATE}]))))",
          "evaluations/s")],
        unit="ops", width=8,
        description="Shadow answers evaluated a second (EvaluationRecords), not evaluator results: each "
                    "evaluation is counted once, by the evaluator that runs on the most of them.",
    ))
    d = d.with_panel(timeseries(
        "Shadow drops by reason",
        [(or_zero(rate_sum("reason", "modelcanary_shadow_dropped_total", ROUTE), "reason"), "{{reason}}")],
        unit="ops", stacked=True, width=8,
        description="Sampled requests not shadowed: budget (max_per_minute / max_usd_per_hour), queue_full, error, "
                    "stateful, stopped (a reload replaced the shadow child). Reads 0 (reason=none) until the first drop.",
    ))
    return d
