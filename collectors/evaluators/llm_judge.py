"""`judge` (optional): a pairwise LLM judge from `models:` (`shadow.judge.model`).

The judge sees the request (its messages, tools and response format) and two answers, A and B,
and must reply with JSON matching {"winner": "A" | "B" | "tie", "reason": string} (asked for with
`response_format: json_schema`). Each comparison is made in both orders, so a judge that favours a
position cannot make a winner: an answer wins only when it is preferred in both orders, loses
when the other is, and anything else (a flip with the order, a tie) is a tie.

- `result`: the candidate's answer against the live stable answer (win / tie / loss);
- `noise`: the stable model's second answer against the same live answer, the judge's own noise
  floor: for an unbiased judge its wins and losses balance.

A judge call that fails, or an answer that is not exactly that shape, is an error (None), never a
win. A server that does not take `json_schema` (llama-cpp-python 0.3 takes `{"type": "json_object",
"schema": ...}`) gets its own form from the judge model's `params: {response_format: ...}`. Tool calls in the answers are shown to the judge, never run. The prompt layout below
(`PROMPT_VERSION`) is what `service.simulator` answers as a judge model (`judge: true`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass

from collectors.evaluators.base import Caller, EvalContext, sampled
from service.config import Checks, JudgeModelConfig
from service.proxy.verifiers import fits_schema
from service.records import EvaluationResult, JudgeResult, PairwiseJudgement

PROMPT_VERSION = "pairwise-1"
JUDGE_PARAMS: dict = {"temperature": 0}
MAX_PROMPT_CHARS = 24_000
SCORES: dict[str, float] = {"win": 1.0, "tie": 0.5, "loss": 0.0}

VERDICT_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "winner": {"type": "string", "enum": ["A", "B", "tie"]},
        "reason": {"type": "string"},
    },
    "required": ["winner", "reason"],
    "additionalProperties": False,
}

SYSTEM = (
    "You are an impartial judge. Two AI assistants, A and B, answered the same conversation.\n"
    "Rubric: {rubric}\n"
    "You get the conversation (and the tools the assistants were offered) and both answers. Tool calls "
    "in the answers were not executed. The order of the answers means nothing. Reply only with a JSON "
    'object: {{"winner": "A" or "B" or "tie", "reason": "<one sentence>"}}.'
)


class MalformedVerdict(ValueError):
    """The judge's answer is not a verdict (the message says what is wrong with it)."""


def _clip(text: str) -> str:
    if len(text) <= MAX_PROMPT_CHARS:
        return text
    half = MAX_PROMPT_CHARS // 2
    return text[:half] + f"\n…[{len(text) - MAX_PROMPT_CHARS} characters cut]…\n" + text[-half:]


def shown_answer(response: dict | None) -> dict | None:
    """What the judge sees of a chat completion: its first message's content, refusal and calls."""
    try:
        message = response["choices"][0]["message"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(message, dict):
        return None
    out: dict = {"content": message.get("content")}
    if message.get("refusal"):
        out["refusal"] = message["refusal"]
    calls = message.get("tool_calls") or ([message["function_call"]] if message.get("function_call") else [])
    if calls:
        out["tool_calls"] = [
            {"name": (c.get("function") or c).get("name"), "arguments": (c.get("function") or c).get("arguments")}
            for c in calls if isinstance(c, dict)]
    return out


def pairwise_request(rubric: str, request: dict, a: dict | None, b: dict | None) -> dict:
    """The chat request sent to the judge model (its `model` is filled in by the caller)."""
    shown = {"messages": request.get("messages")}
    if request.get("tools"):
        shown["tools"] = request["tools"]
    if request.get("response_format"):
        shown["response_format"] = request["response_format"]
    user = ("Conversation:\n" + _clip(json.dumps(shown, ensure_ascii=False))
            + "\n\nAnswer A:\n" + _clip(json.dumps(a, ensure_ascii=False))
            + "\n\nAnswer B:\n" + _clip(json.dumps(b, ensure_ascii=False)))
    return {
        "messages": [{"role": "system", "content": SYSTEM.format(rubric=rubric)}, {"role": "user", "content": user}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "verdict", "strict": True, "schema": VERDICT_SCHEMA}},
        **JUDGE_PARAMS,
    }


def parse_verdict(response: dict | None) -> str:
    """"A", "B" or "tie" from the judge's chat completion; MalformedVerdict otherwise."""
    if not isinstance(response, dict):
        raise MalformedVerdict("no answer")
    try:
        message = response["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise MalformedVerdict("no message in the answer") from None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str) or not content.strip():
        refused = isinstance(message, dict) and message.get("refusal")
        raise MalformedVerdict("judge refused" if refused else "empty answer")
    try:
        value = json.loads(content)
    except ValueError:
        raise MalformedVerdict("answer is not JSON") from None
    ok, problem = fits_schema(value, VERDICT_SCHEMA)
    if not ok:
        raise MalformedVerdict(f"answer does not fit the schema: {problem}")
    return value["winner"]


def rubric_digest(rubric: str) -> str:
    return hashlib.sha256(rubric.encode()).hexdigest()[:12]


def repro_params(judge: JudgeModelConfig) -> dict:
    """What a record's `repro.params` says about the judge behind its verdicts."""
    return {"judge_model": judge.model, "judge_mode": judge.mode, "judge_prompt_version": PROMPT_VERSION,
            "judge_params": dict(JUDGE_PARAMS), "judge_rubric_sha256": rubric_digest(judge.rubric)}


@dataclass(frozen=True, slots=True)
class Verdicts:
    """One record's pairwise verdicts: a result, or why there is none ("judge call failed: ...")."""

    candidate: JudgeResult | str
    noise_floor: JudgeResult | str | None     # None: no stable-again answer to judge

    def record(self) -> PairwiseJudgement:
        def known(v: str | None) -> JudgeResult | None:
            return v if v in SCORES else None  # type: ignore[return-value]
        return PairwiseJudgement(result=known(self.candidate), noise=known(self.noise_floor),
                                 noise_failed=self.noise_floor is not None and self.noise_floor not in SCORES)


class JudgeEvaluator:
    name = "judge"
    version = "2"

    def selected(self, ctx: EvalContext) -> bool:
        judge = ctx.route_cfg.shadow.judge
        return (judge is not None and ctx.candidate.answered and ctx.live is not None
                and sampled("judge", ctx.request_id, judge.sample_rate))

    async def _one_order(self, ctx: EvalContext, caller: Caller, judge: JudgeModelConfig, a: dict | None,
                         b: dict | None) -> str:
        call = await caller.call(ctx.route, judge.model, pairwise_request(judge.rubric, ctx.view, a, b),
                                 checks=Checks())
        if call.response is None:
            raise MalformedVerdict(f"judge call failed: {call.verdict.cause}")
        return parse_verdict(call.response)

    async def compare(self, ctx: EvalContext, caller: Caller, judge: JudgeModelConfig, reference: dict | None,
                      other: dict | None) -> JudgeResult | str:
        """`other` against `reference`, in both orders: win / tie / loss for `other`, or the problem."""
        try:
            first, second = await asyncio.gather(self._one_order(ctx, caller, judge, reference, other),
                                                 self._one_order(ctx, caller, judge, other, reference))
        except MalformedVerdict as e:
            text = str(e)
            return text if text.startswith("judge call failed") else f"malformed judge answer: {text}"
        if first == "B" and second == "A":
            return "win"
        if first == "A" and second == "B":
            return "loss"
        return "tie"

    async def evaluate(self, ctx: EvalContext) -> EvaluationResult:
        judge = ctx.route_cfg.shadow.judge
        assert judge is not None
        live = shown_answer(ctx.live)
        again = ctx.stable_again.response if ctx.stable_again is not None else None
        pending = [self.compare(ctx, ctx.caller, judge, live, shown_answer(ctx.candidate.response))]
        if again is not None:  # the noise floor: once per request, whatever the candidates
            side = ctx.stable_side
            pending.append(side.once("judge", lambda: self.compare(ctx, side.caller, judge, live, shown_answer(again))))
        outcomes = await asyncio.gather(*pending)
        verdicts = Verdicts(outcomes[0], outcomes[1] if again is not None else None)
        ctx.extra["judge"] = verdicts
        noise = "not judged" if verdicts.noise_floor is None else verdicts.noise_floor
        if verdicts.candidate not in SCORES:
            return EvaluationResult(name=self.name, version=self.version, passed=None,
                                    detail=str(verdicts.candidate)[:300])
        return EvaluationResult(name=self.name, version=self.version, passed=verdicts.candidate != "loss",
                                score=SCORES[verdicts.candidate],
                                detail=f"candidate {verdicts.candidate} against the live answer; "
                                       f"stable-again: {noise}"[:300])
