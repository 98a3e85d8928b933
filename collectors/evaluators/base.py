"""The evaluator extension point: one small Protocol, one file per implementation beside it.

An evaluator looks at one shadow evaluation (the live request, the live stable answer, the
candidate's answer and, when measured, the stable model's second answer) and returns an
EvaluationResult: `passed` True/False, or None when it could not decide (an error, never a
pass). `selected(ctx)` says whether it runs on this record (optional evaluators sample
deterministically by request id, so a replayed record gets the same evaluators).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from collectors.similarity import Embedder
from service.config import Checks, Config, RouteConfig
from service.proxy.outcome import Verdict
from service.proxy.routing import unit_hash
from service.records import EvaluationResult, TrafficEvent


@dataclass(slots=True)
class ShadowCall:
    """One shadow call's result. `response` is the parsed 2xx chat completion, None without one."""

    model: str                      # the key in `models:`
    verdict: Verdict
    response: dict | None = None
    status: int = 0
    latency_s: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    retries: int = 0
    span: object | None = None        # the call's trace span, when tracing is on

    @property
    def answered(self) -> bool:
        return self.response is not None

    @property
    def usage(self) -> dict | None:
        if self.response is None and not (self.input_tokens or self.output_tokens):
            return None
        return {"prompt_tokens": self.input_tokens, "completion_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens}


class Caller(Protocol):
    async def call(self, route: str, model_key: str, body: dict, checks: Checks | None = None) -> ShadowCall:
        """Send a chat request (non-streamed) to a model from `models:`, with the shadow retry rules;
        classify the answer with `checks` (default: the route's). Raises `collectors.spend.OverBudget`
        instead of calling when the route's `shadow.max_usd_per_hour` is spent."""


class StableSide:
    """The stable model's side of one request, shared by the records of its candidates: work on it
    (the judge's noise floor, the stable model's stability answers) is done once, whatever the
    number of candidates, and paid from the route's budget, not from a candidate's share."""

    def __init__(self, caller: Caller):
        self.caller = caller
        self._work: dict[str, asyncio.Future[Any]] = {}

    async def once(self, name: str, work: Callable[[], Awaitable[Any]]) -> Any:
        """`work()`'s result, the first caller starting it; one record leaving does not cancel it."""
        task = self._work.get(name)
        if task is None:
            task = self._work[name] = asyncio.ensure_future(work())
        return await asyncio.shield(task)

    def close(self) -> None:
        """Cancel what no record waits for any more."""
        for task in self._work.values():
            task.cancel()


@dataclass(slots=True)
class EvalContext:
    config: Config
    route: str
    route_cfg: RouteConfig
    event: TrafficEvent
    request: dict                   # the live request body (as the client sent it, credentials never included)
    view: dict                      # the request shaped like a chat request (ApiFormat.view): what evaluators read
    live: dict | None               # the live stable answer
    candidate: ShadowCall
    stable_again: ShadowCall | None
    caller: Caller
    stable_side: StableSide
    embedder: Embedder              # the route's `shadow.similarity` backend
    extra: dict = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.event.request_id

    @property
    def stable_model(self) -> str:
        """The stable model that served the live answer (its key in `models:`)."""
        served = self.event.primary.model
        return served if served in self.config.models else self.route_cfg.stable


def score_text(value: float | None) -> str:
    """A similarity score for an evaluator's detail."""
    return "not measured" if value is None else f"{value:.3f}"


def sampled(kind: str, request_id: str, rate: float) -> bool:
    """Deterministic sub-sampling by request id (replicas and replays agree)."""
    return rate > 0.0 and (rate >= 1.0 or unit_hash(kind, request_id) < rate)


class Evaluator(Protocol):
    name: str
    version: str

    def selected(self, ctx: EvalContext) -> bool:
        """Whether this evaluator runs on this record."""

    async def evaluate(self, ctx: EvalContext) -> EvaluationResult:
        """The verdict on the candidate's answer. Must not raise for a bad answer: return passed=None."""
