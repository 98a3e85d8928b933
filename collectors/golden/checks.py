"""A case's own checks on one answer (dataset.CaseChecks): the terminal-state verdict of a
verifiable case.

`verdict(checks, request, response, embedder, agree_at)` passes when every check the case carries
passes; a missing answer (a failed call) fails. `CaseChecksEvaluator` is the evaluator replay adds
to the shadow evaluators: it judges the candidate's answer (the record's evaluation `checks`) and
keeps the stable-again answer's verdict beside it (`stable`), so that the two can be compared per
case.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from collectors.evaluators.base import EvalContext
from collectors.golden.dataset import CaseChecks, ToolCallCheck
from collectors.similarity import Answer, Embedder, answer_of_completion, similarities, wants_json
from service.proxy.verifiers import fits_schema
from service.records import EvaluationResult


@dataclass(frozen=True, slots=True)
class CheckVerdict:
    passed: bool
    detail: str


def _tool_call(check: ToolCallCheck, answer: Answer) -> str | None:
    """Why the answer does not make the call, or None."""
    calls = [c for c in answer.tool_calls if c.name == check.name]
    if not calls:
        made = ", ".join(c.name for c in answer.tool_calls) or "none"
        return f"no call to {check.name!r} (calls: {made})"
    problems = []
    for call in calls:
        try:
            args = json.loads(call.arguments or "{}")
        except ValueError:
            problems.append(f"arguments of {check.name!r} are not JSON")
            continue
        if not isinstance(args, dict):
            problems.append(f"arguments of {check.name!r} are not an object")
            continue
        wrong = [key for key, want in check.arguments.items() if not _matches(args.get(key, _MISSING), want)]
        if not wrong:
            return None
        problems.append(f"{check.name}({', '.join(f'{k}={args.get(k, _MISSING)!r}' for k in wrong)}) does not "
                        f"match {', '.join(f'{k}={check.arguments[k]!r}' for k in wrong)}")
    return problems[0]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _matches(value: object, want: object) -> bool:
    if value is _MISSING:
        return False
    if isinstance(want, str):
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return re.fullmatch(want, text) is not None
    return value == want


async def verdict(checks: CaseChecks, request: dict, response: dict | None, embedder: Embedder,
                  agree_at: float) -> CheckVerdict:
    """Every check of the case on one answer (a chat completion, or None for a failed call)."""
    as_json = wants_json(request)
    answer = answer_of_completion(response, as_json)
    if answer is None:
        return CheckVerdict(False, "no answer")
    failed: list[str] = []
    if checks.tool_call is not None and (problem := _tool_call(checks.tool_call, answer)):
        failed.append(f"tool_call: {problem}")
    if checks.json_schema is not None:
        try:
            value = json.loads(answer.text)
        except ValueError:
            failed.append("json_schema: the answer is not JSON")
        else:
            ok, problem = fits_schema(value, checks.json_schema)
            if not ok:
                failed.append(f"json_schema: {problem}")
    if checks.expected is not None:
        expected = checks.expected
        text = expected if isinstance(expected, str) and not as_json else json.dumps(expected, ensure_ascii=False)
        (score,) = await similarities([(answer, Answer("json" if as_json else "text", text=text))], embedder)
        at = checks.min_similarity if checks.min_similarity is not None else agree_at
        if score is None or score < at:
            failed.append(f"expected: similarity {0.0 if score is None else score:.3f} < {at:g}")
    if failed:
        return CheckVerdict(False, "; ".join(failed)[:300])
    return CheckVerdict(True, f"{', '.join(checks.kinds)} passed")


class CaseChecksEvaluator:
    """The cases' checks, by request id, on the candidate's answer and on the stable-again one."""

    name = "checks"
    version = "1"

    def __init__(self, checks: dict[str, CaseChecks]):
        self.checks = checks
        self.stable: dict[str, bool] = {}   # request id -> did the stable-again answer pass

    def selected(self, ctx: EvalContext) -> bool:
        return ctx.request_id in self.checks

    async def evaluate(self, ctx: EvalContext) -> EvaluationResult:
        checks = self.checks[ctx.request_id]
        agree_at = ctx.route_cfg.shadow.similarity.agree_at
        mine = await verdict(checks, ctx.view, ctx.candidate.response, ctx.embedder, agree_at)
        if ctx.stable_again is not None:
            theirs = await verdict(checks, ctx.view, ctx.stable_again.response, ctx.embedder, agree_at)
            self.stable[ctx.request_id] = theirs.passed
        return EvaluationResult(name=self.name, version=self.version, passed=mine.passed, detail=mine.detail)
