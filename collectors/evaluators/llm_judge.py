"""`judge` (optional): an LLM from `models:` (`shadow.judge.model`) scores the candidate's answer.

The judge gets the rubric, the request (its messages and tool definitions) and the candidate's
answer, and must reply with JSON matching {"score": number 0..1, "reason": string}
(asked for with `response_format: json_schema`). The answer passes at score >= 0.5. A judge
that fails, or answers anything that is not exactly that shape, gives `passed=None` (an error,
counted as such, never a pass). Tool calls in the answer are shown to the judge, never run.
"""

from __future__ import annotations

import json

from collectors.evaluators.base import EvalContext, sampled
from service.config import Checks
from service.proxy.verifiers import fits_schema
from service.records import EvaluationResult

PASS_SCORE = 0.5
MAX_PROMPT_CHARS = 24_000

JUDGEMENT_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "reason": {"type": "string"},
    },
    "required": ["score", "reason"],
    "additionalProperties": False,
}

SYSTEM = (
    "You are an impartial evaluator of an AI assistant's answer.\n"
    "Rubric: {rubric}\n"
    "You get the conversation the assistant saw (and the tools it was offered) and its answer. "
    "Tool calls in the answer were not executed. Reply only with a JSON object: "
    '{{"score": <number from 0 to 1>, "reason": "<one sentence>"}}.'
)


def _clip(text: str) -> str:
    if len(text) <= MAX_PROMPT_CHARS:
        return text
    half = MAX_PROMPT_CHARS // 2
    return text[:half] + f"\n…[{len(text) - MAX_PROMPT_CHARS} characters cut]…\n" + text[-half:]


def judge_request(rubric: str, request: dict, answer: dict | None) -> dict:
    """The chat request sent to the judge model (its `model` is filled in by the caller)."""
    shown = {"messages": request.get("messages")}
    if request.get("tools"):
        shown["tools"] = request["tools"]
    if request.get("response_format"):
        shown["response_format"] = request["response_format"]
    user = ("Conversation:\n" + _clip(json.dumps(shown, ensure_ascii=False)) +
            "\n\nAnswer to evaluate:\n" + _clip(json.dumps(answer, ensure_ascii=False)))
    return {
        "messages": [{"role": "system", "content": SYSTEM.format(rubric=rubric)}, {"role": "user", "content": user}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "judgement", "strict": True, "schema": JUDGEMENT_SCHEMA}},
        "temperature": 0,
    }


def parse_judgement(response: dict | None) -> tuple[float, str] | str:
    """(score, reason) from the judge's chat completion, or a string saying what is wrong with it."""
    if not isinstance(response, dict):
        return "no answer"
    try:
        message = response["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return "no message in the answer"
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str) or not content.strip():
        return "empty answer" if not (isinstance(message, dict) and message.get("refusal")) else "judge refused"
    try:
        value = json.loads(content)
    except ValueError:
        return "answer is not JSON"
    ok, problem = fits_schema(value, JUDGEMENT_SCHEMA)
    if not ok:
        return f"answer does not fit the schema: {problem}"
    score = value["score"]
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0.0 <= float(score) <= 1.0:
        return f"score {score!r} is not a number from 0 to 1"
    return float(score), value["reason"]


def _answer(ctx: EvalContext) -> dict | None:
    response = ctx.candidate.response
    try:
        return response["choices"][0]["message"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return None


class JudgeEvaluator:
    name = "judge"
    version = "1"

    def selected(self, ctx: EvalContext) -> bool:
        judge = ctx.route_cfg.shadow.judge
        return judge is not None and ctx.candidate.answered and sampled("judge", ctx.request_id, judge.sample_rate)

    async def evaluate(self, ctx: EvalContext) -> EvaluationResult:
        judge = ctx.route_cfg.shadow.judge
        assert judge is not None
        body = judge_request(judge.rubric, ctx.request, _answer(ctx))
        call = await ctx.caller.call(ctx.route, judge.model, body, checks=Checks())
        if call.response is None:
            return EvaluationResult(name=self.name, version=self.version, passed=None,
                                    detail=f"judge call failed: {call.verdict.cause}")
        parsed = parse_judgement(call.response)
        if isinstance(parsed, str):
            return EvaluationResult(name=self.name, version=self.version, passed=None,
                                    detail=f"malformed judge answer: {parsed}"[:300])
        score, reason = parsed
        return EvaluationResult(name=self.name, version=self.version, passed=score >= PASS_SCORE, score=score,
                                detail=reason[:300])
