"""`stability` (optional): on `shadow.stability.sample_rate` of the records, ask the candidate
k times in all (its shadow answer counts as the first) and report the share of the k answers
that match the most common one (1/k … 1) as the score; it passes when a strict majority agree.
Fewer than two readable answers is an error, not a pass."""

from __future__ import annotations

import asyncio
from collections import Counter

from collectors.evaluators.answers import answer_key
from collectors.evaluators.base import EvalContext, sampled
from service.records import EvaluationResult


class StabilityEvaluator:
    name = "stability"
    version = "1"

    def selected(self, ctx: EvalContext) -> bool:
        cfg = ctx.route_cfg.shadow.stability
        return ctx.candidate.answered and sampled("stability", ctx.request_id, cfg.sample_rate)

    async def evaluate(self, ctx: EvalContext) -> EvaluationResult:
        k = ctx.route_cfg.shadow.stability.k
        candidate = ctx.route_cfg.candidate
        assert candidate is not None
        more = await asyncio.gather(*(ctx.caller.call(ctx.route, candidate, ctx.request) for _ in range(k - 1)))
        keys = [answer_key(ctx.candidate.response)] + [answer_key(c.response) for c in more]
        readable = [key for key in keys if key is not None]
        if len(readable) < 2:
            return EvaluationResult(name=self.name, version=self.version, passed=None,
                                    detail=f"only {len(readable)} of {k} answers readable")
        top = Counter(readable).most_common(1)[0][1]
        share = top / len(readable)
        return EvaluationResult(name=self.name, version=self.version, passed=share > 0.5, score=share,
                                detail=f"{top} of {len(readable)} answers agree (k={k})")
