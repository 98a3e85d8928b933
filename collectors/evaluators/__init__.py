"""Shadow evaluators (issue 3 §4): one Protocol (base.py), implementations side by side."""

from __future__ import annotations

from collectors.evaluators.agreement import AgreementEvaluator
from collectors.evaluators.base import Caller, EvalContext, Evaluator, ShadowCall
from collectors.evaluators.llm_judge import JudgeEvaluator
from collectors.evaluators.stability import StabilityEvaluator
from collectors.evaluators.verifiers import VerifiersEvaluator

__all__ = ["AgreementEvaluator", "Caller", "EvalContext", "Evaluator", "JudgeEvaluator", "ShadowCall",
           "StabilityEvaluator", "VerifiersEvaluator", "default_evaluators"]


def default_evaluators(live_is_recorded: bool = False) -> list[Evaluator]:
    """Every evaluator; each decides per record (and per route config) whether it runs. A replay's
    live answer is recorded, not drawn now: stability then asks the stable model afresh only."""
    return [VerifiersEvaluator(), AgreementEvaluator(), StabilityEvaluator(count_live=not live_is_recorded),
            JudgeEvaluator()]
