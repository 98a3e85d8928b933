"""`agreement`: how similar the candidate's answer is to the live stable answer, and (the noise
floor) the stable model's second answer to its own live one, in [0, 1] (collectors.similarity:
embeddings for text, structural scores for JSON and tool calls, 0 for a refusal against content).

The record's `similarity` holds both scores; its `agreement` booleans say whether each reaches
`shadow.similarity.agree_at`. An embeddings backend that fails leaves both unmeasured (None), with
the reason in the evaluator's detail: never an agreement by default.
"""

from __future__ import annotations

from dataclasses import dataclass

from collectors.evaluators.base import EvalContext, score_text
from collectors.similarity import EmbeddingError, RecordSimilarity, answer_of_completion, score_record, wants_json
from service.records import Agreement, EvaluationResult


@dataclass(frozen=True, slots=True)
class Measured:
    similarity: RecordSimilarity
    agreement: Agreement
    problem: str | None = None      # why nothing could be measured


def _at_least(score: float | None, agree_at: float) -> bool | None:
    return None if score is None else score >= agree_at


async def measure(ctx: EvalContext) -> Measured:
    """Both similarities of the record (one batched embed call), computed once per context: the
    worker and this evaluator share them."""
    known = ctx.extra.get("similarity")
    if known is not None:
        return known
    as_json = wants_json(ctx.view)
    live = answer_of_completion(ctx.live, as_json)
    candidate = answer_of_completion(ctx.candidate.response, as_json)
    again = answer_of_completion(ctx.stable_again.response, as_json) if ctx.stable_again is not None else None
    problem = None
    try:
        sim = await score_record(live, candidate, again, ctx.embedder)
    except EmbeddingError as e:
        sim, problem = RecordSimilarity(None, None), str(e)
    agree_at = ctx.route_cfg.shadow.similarity.agree_at
    result = Measured(sim, Agreement(candidate_vs_stable=_at_least(sim.candidate_vs_stable, agree_at),
                                     stable_vs_stable=_at_least(sim.stable_vs_stable, agree_at)), problem)
    ctx.extra["similarity"] = result
    return result


class AgreementEvaluator:
    name = "agreement"
    version = "2"

    def selected(self, ctx: EvalContext) -> bool:
        return ctx.candidate.answered and ctx.live is not None

    async def evaluate(self, ctx: EvalContext) -> EvaluationResult:
        m = await measure(ctx)
        if m.problem is not None:
            return EvaluationResult(name=self.name, version=self.version, passed=None,
                                    detail=f"similarity not measured: {m.problem}"[:300])
        sim = m.similarity
        detail = (f"similarity to the live answer {score_text(sim.candidate_vs_stable)}, stable-again "
                  f"{score_text(sim.stable_vs_stable)} (agree at {ctx.route_cfg.shadow.similarity.agree_at:g})")
        return EvaluationResult(name=self.name, version=self.version, passed=m.agreement.candidate_vs_stable,
                                score=sim.candidate_vs_stable, detail=detail)
