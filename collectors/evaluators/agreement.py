"""`agreement`: does the candidate's answer agree with the live stable answer, and (the noise
floor) does the stable model asked again agree with its own live answer? Answers compare by
normalised text, canonical JSON, or tool name plus canonical arguments (collectors.evaluators.answers)."""

from __future__ import annotations

from collectors.evaluators.answers import answer_key
from collectors.evaluators.base import EvalContext
from service.records import Agreement, EvaluationResult


def compare(ctx: EvalContext) -> Agreement:
    """The record's `agreement`: None where an answer is missing or the noise floor is off.
    Computed once per context (the worker and this evaluator share it)."""
    known = ctx.extra.get("agreement")
    if known is not None:
        return known
    live = answer_key(ctx.live)

    def versus(answer: dict | None) -> bool | None:
        key = answer_key(answer)
        return None if key is None or live is None else key == live

    result = Agreement(candidate_vs_stable=versus(ctx.candidate.response),
                       stable_vs_stable=versus(ctx.stable_again.response) if ctx.stable_again is not None else None)
    ctx.extra["agreement"] = result
    return result


class AgreementEvaluator:
    name = "agreement"
    version = "1"

    def selected(self, ctx: EvalContext) -> bool:
        return ctx.candidate.answered and ctx.live is not None

    async def evaluate(self, ctx: EvalContext) -> EvaluationResult:
        result = compare(ctx)
        agree = result.candidate_vs_stable
        floor = {True: "stable-again agrees", False: "stable-again disagrees", None: "noise floor not measured"}
        detail = f"{'agrees' if agree else 'disagrees' if agree is False else 'not comparable'} with the live answer; " \
                 f"{floor[result.stable_vs_stable]}"
        return EvaluationResult(name=self.name, version=self.version, passed=agree,
                                score=None if agree is None else float(agree), detail=detail)
