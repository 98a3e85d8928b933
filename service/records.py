"""Records carried on the event bus (DESIGN §8). Field names are the contract."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["stable", "canary", "shadow"]
Outcome = Literal["completed", "failed"]
Blame = Literal["model", "provider", "client", "proxy"]
Phase = Literal["shadow", "canary", "paused", "promoted", "rolled_back"]
Decision = Literal["step", "hold", "promote", "rollback"]


class Record(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class OutcomeEvent(Record):
    schema_: Literal["modelcanary.outcome/v1"] = Field("modelcanary.outcome/v1", alias="schema")
    request_id: str
    ts: float
    route: str
    model: str
    role: Role
    segment: str
    session_id_hash: str | None = None
    outcome: Outcome | None = None
    cause: str | None = None
    blame: Blame | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    client_retry: bool = False
    upstream_retries: int = 0
    kind: Literal["request", "feedback"] = "request"
    # feedback only: the application's verdict on the task
    success: bool | None = None
    reason: str | None = None


class PrimaryResult(Record):
    model: str
    status: int
    body: dict | None = None
    latency_s: float
    ttft_s: float | None = None
    usage: dict | None = None
    outcome: Outcome
    cause: str | None = None


class TrafficEvent(Record):
    schema_: Literal["modelcanary.traffic/v1"] = Field("modelcanary.traffic/v1", alias="schema")
    request_id: str
    ts: float
    route: str
    segment: str
    request: dict
    primary: PrimaryResult
    config_version: str
    traceparent: str | None = None


class CandidateResult(Record):
    outcome: Outcome
    cause: str | None = None
    blame: Blame | None = None
    latency_s: float | None = None
    usage: dict | None = None
    cost_usd: float = 0.0


class EvaluationResult(Record):
    name: str
    version: str
    passed: bool | None
    score: float | None = None
    detail: str | None = None


class Agreement(Record):
    candidate_vs_stable: bool | None = None
    stable_vs_stable: bool | None = None


class Repro(Record):
    modelcanary_version: str
    config_version: str
    evaluator_versions: dict[str, str] = {}
    params: dict[str, Any] = {}
    seed: int | None = None


class EvaluationRecord(Record):
    schema_: Literal["modelcanary.evaluation/v1"] = Field("modelcanary.evaluation/v1", alias="schema")
    request_id: str
    ts: float
    route: str
    segment: str
    stable_model: str
    candidate_model: str
    candidate: CandidateResult
    evaluations: list[EvaluationResult] = []
    agreement: Agreement = Agreement()
    repro: Repro
    # the stable model asked again (noise_floor): the fair reference for shadow failure rates
    stable_again: CandidateResult | None = None
    # the live (stable) answer's latency, so shadow latency can be compared pairwise
    stable_latency_s: float | None = None
    stable_cost_usd: float | None = None


class Evidence(Record):
    metric: str
    segment: str
    stable: float | None
    candidate: float | None
    effect: float | None
    interval: tuple[float, float] | None
    n: int
    verdict: str | None = None


class LastDecision(Record):
    decision: Decision
    reasons: list[str] = []
    evidence: list[Evidence] = []
    ts: float | None = None
    by: str = "controller"


class RolloutState(Record):
    schema_: Literal["modelcanary.rollout/v1"] = Field("modelcanary.rollout/v1", alias="schema")
    route: str
    stable: str
    candidate: str | None = None
    phase: Phase
    canary_weight: float = 0.0
    step_index: int = -1
    since: float
    version: int = 0
    last_decision: LastDecision | None = None
    paused_from: Phase | None = None
    # the judge's latest verdict when it did not change the phase (hold, or advisory mode)
    recommendation: LastDecision | None = None
    # the controller's latest capability matrix (shadow + live, per segment); served by /report
    report: dict | None = None


def dump(record: Record) -> dict:
    """The JSON-ready dict of a record, with its `schema` tag."""
    return record.model_dump(mode="json", by_alias=True)


SCHEMAS: dict[str, type[Record]] = {
    "modelcanary.outcome/v1": OutcomeEvent,
    "modelcanary.traffic/v1": TrafficEvent,
    "modelcanary.evaluation/v1": EvaluationRecord,
    "modelcanary.rollout/v1": RolloutState,
}


def load(data: dict) -> Record:
    """Parse a record dict by its `schema` tag."""
    kind = SCHEMAS.get(data.get("schema", ""))
    if kind is None:
        raise ValueError(f"unknown record schema {data.get('schema')!r}")
    return kind.model_validate(data)
