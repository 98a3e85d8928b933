"""`verifiers`: the route's checks on the candidate's answer (JSON, schema, tool-call validity,
finish reason, refusal, empty output). It reports the verdict `classify_chat` already gave the
shadow call (the proxy's own code), so live and shadow answers are judged alike."""

from __future__ import annotations

from collectors.evaluators.base import EvalContext
from service.records import EvaluationResult


class VerifiersEvaluator:
    name = "verifiers"
    version = "1"

    def selected(self, ctx: EvalContext) -> bool:
        return ctx.candidate.answered  # a provider failure left no answer to check

    async def evaluate(self, ctx: EvalContext) -> EvaluationResult:
        verdict = ctx.candidate.verdict
        if verdict.ok:
            return EvaluationResult(name=self.name, version=self.version, passed=True, score=1.0)
        if verdict.blame != "model":
            return EvaluationResult(name=self.name, version=self.version, passed=None,
                                    detail=f"no answer to check: {verdict.cause}")
        detail = verdict.cause if not verdict.detail else f"{verdict.cause}: {verdict.detail}"
        return EvaluationResult(name=self.name, version=self.version, passed=False, score=0.0,
                                detail=detail[:300])
