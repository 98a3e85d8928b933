"""`stability` (optional): on `shadow.stability.sample_rate` of the records, the candidate and the
stable model are each asked k times, and each one's stability is the mean pairwise similarity of
its k answers (collectors.similarity), in [0, 1].

The candidate's shadow answer counts as its first; the live answer, and the stable-again answer
when there is one, count as the stable model's first ones. A replay (`count_live=False`) leaves the
recorded live answer out: it is one fixed draw from another time, and a golden set whose live
answers happened to diverge more often than the model does would bias every replay of it against
the stable side. Both sides come from the same request,
so the record's `stability {candidate, stable}` is one paired difference for the judge's
`stability_gap`. The evaluator passes when the candidate's answers agree with each other on average
(stability ≥ `shadow.similarity.agree_at`). Fewer than two readable answers on a side leaves that
side unmeasured (None); on the candidate's side that is an error, never a pass.
"""

from __future__ import annotations

import asyncio

from collectors.evaluators.base import EvalContext, sampled, score_text
from collectors.similarity import EmbeddingError, answer_of_completion, mean_pairwise_similarity, wants_json
from service.records import EvaluationResult, Stability


class StabilityEvaluator:
    name = "stability"
    version = "2"

    def __init__(self, count_live: bool = True):
        self.count_live = count_live

    def selected(self, ctx: EvalContext) -> bool:
        cfg = ctx.route_cfg.shadow.stability
        return ctx.candidate.answered and (ctx.live is not None or not self.count_live) \
            and sampled("stability", ctx.request_id, cfg.sample_rate)

    async def _stable_answers(self, ctx: EvalContext, k: int) -> list[dict | None]:
        stable = [ctx.live] if self.count_live and ctx.live is not None else []
        if ctx.stable_again is not None and ctx.stable_again.answered:
            stable.append(ctx.stable_again.response)
        calls = await asyncio.gather(*(ctx.stable_side.caller.call(ctx.route, ctx.stable_model, ctx.request)
                                       for _ in range(k - len(stable))))
        return stable + [c.response for c in calls]

    async def evaluate(self, ctx: EvalContext) -> EvaluationResult:
        k = ctx.route_cfg.shadow.stability.k
        candidate = ctx.candidate.model  # the candidate of this record (a route may have several)
        calls, stable = await asyncio.gather(  # the stable side once per request, whatever the candidates
            asyncio.gather(*(ctx.caller.call(ctx.route, candidate, ctx.request) for _ in range(k - 1))),
            ctx.stable_side.once("stability", lambda: self._stable_answers(ctx, k)))
        as_json = wants_json(ctx.view)
        replies = {"candidate": [ctx.candidate.response] + [c.response for c in calls], "stable": stable}
        scores: dict[str, float | None] = {}
        try:
            for side, responses in replies.items():
                answers = [a for a in (answer_of_completion(r, as_json) for r in responses) if a is not None]
                scores[side] = await mean_pairwise_similarity(answers, ctx.embedder)
        except EmbeddingError as e:
            return EvaluationResult(name=self.name, version=self.version, passed=None,
                                    detail=f"similarity not measured: {e}"[:300])
        result = Stability(candidate=scores["candidate"], stable=scores["stable"])
        ctx.extra["stability"] = result
        detail = f"mean pairwise similarity of k={k} answers: candidate {score_text(result.candidate)}, " \
                 f"stable {score_text(result.stable)}"
        if result.candidate is None:
            return EvaluationResult(name=self.name, version=self.version, passed=None,
                                    detail="fewer than 2 readable candidate answers; " + detail)
        agree_at = ctx.route_cfg.shadow.similarity.agree_at
        return EvaluationResult(name=self.name, version=self.version, passed=result.candidate >= agree_at,
                                score=result.candidate, detail=detail)
