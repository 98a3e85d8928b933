"""Records carried on the event bus (DESIGN §8). Field names are the contract."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["stable", "canary", "shadow"]
# the segment of a call the proxy passes through (embeddings, files...): always the stable model's,
# never the chat-format traffic the judge compares
PASSTHROUGH_SEGMENT = "other"
Outcome = Literal["completed", "failed"]
Blame = Literal["model", "provider", "client", "proxy"]
# partial: rollout.scope segment only, every segment finished but not all the same way
Phase = Literal["shadow", "canary", "paused", "promoted", "rolled_back", "partial"]
Decision = Literal["step", "hold", "promote", "rollback"]


class Record(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Conversation(Record):
    """How long a Responses-API conversation was once an answer was stored: what the upstream holds for
    a follow-up naming it (`previous_response_id`)."""

    tokens: int
    user_turns: int


class OutcomeEvent(Record):
    schema_: Literal["modelcanary.outcome/v1"] = Field("modelcanary.outcome/v1", alias="schema")
    request_id: str
    ts: float
    # None only on feedback that the receiving replica could not resolve (Kafka mode, kind=feedback):
    # the controller resolves it against the request's own outcome
    route: str | None = None
    model: str | None = None
    role: Role | None = None
    segment: str | None = None
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
    # the HTTP status the client got (a stream's 200 stays, even when the stream then failed)
    status: int | None = None
    kind: Literal["request", "feedback"] = "request"
    # feedback only: the application's verdict on the task
    success: bool | None = None
    reason: str | None = None
    # unresolved feedback only: the routes its client key may give feedback on (None: any); never the key
    allowed_routes: list[str] | None = None
    # Responses API: the id the upstream stored the answer under (replicas route follow-ups by it)
    response_id: str | None = None
    # with response_id: the conversation's length by then, so that a follow-up on any replica falls in
    # its segment (absent from older records: the follow-up is segmented from its own turn)
    conversation: Conversation | None = None


class PrimaryResult(Record):
    model: str
    status: int
    body: dict | None = None
    latency_s: float
    ttft_s: float | None = None
    usage: dict | None = None
    # `usage` was estimated from the text: the upstream told none (a stream it does not count)
    usage_estimated: bool = False
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
    headers: dict[str, str] | None = None  # the client's headers a shadow call repeats (anthropic-version, -beta)


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


class Similarity(Record):
    """Similarity in [0, 1] of the candidate's answer (and of the stable-again one, the noise floor)
    to the live stable answer; null when not measured."""

    candidate_vs_stable: float | None = None
    stable_vs_stable: float | None = None


JudgeResult = Literal["win", "tie", "loss"]
# A verdict as a number, so that (wins − losses) / n is a mean.
JUDGE_SCORES: dict[str, float] = {"win": 1.0, "tie": 0.0, "loss": -1.0}


class PairwiseJudgement(Record):
    """The pairwise judge's verdict for the candidate against the live answer (`result`), and for the
    stable-again answer against it (`noise`, the judge's own noise floor); null when not judged.
    `noise_failed`: the judge was asked about the stable-again answer and gave no verdict (an error;
    a candidate's error shows as its judge evaluation without a `result`)."""

    result: JudgeResult | None = None
    noise: JudgeResult | None = None
    noise_failed: bool = False


class Stability(Record):
    """Mean pairwise similarity of each model's k answers to the request; null when not measured."""

    candidate: float | None = None
    stable: float | None = None


class Repro(Record):
    modelcanary_version: str
    config_version: str
    evaluator_versions: dict[str, str] = {}
    params: dict[str, Any] = {}
    # per model key: the upstream name and the request settings each shadow call had
    # (`system_prompt`, `params`), so a prompt or parameter candidate can be replayed as it ran
    model_settings: dict[str, dict[str, Any]] = {}
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
    similarity: Similarity = Similarity()
    judge: PairwiseJudgement = PairwiseJudgement()
    stability: Stability = Stability()
    repro: Repro
    # the stable model asked again (noise_floor): the fair reference for shadow failure rates
    stable_again: CandidateResult | None = None
    # the stable side of the candidate's latency pair: stable_again's when the noise floor is on (the
    # same worker's path and time as the candidate's call), else the live answer's
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
    # a comparison that blocks promotion: more candidate samples it needs at the current effect and
    # variance (None: not reachable at this effect), and how long that takes at this step's average traffic
    needed_n: int | None = None
    eta_s: float | None = None


class LastDecision(Record):
    decision: Decision
    reasons: list[str] = []
    evidence: list[Evidence] = []
    ts: float | None = None
    by: str = "controller"


class SegmentState(Record):
    """One segment's own rollout (rollout.scope: segment): shadow → steps → promoted or rolled_back."""

    phase: Phase
    canary_weight: float = 0.0
    step_index: int = -1
    since: float
    last_decision: LastDecision | None = None
    recommendation: LastDecision | None = None
    paused_from: Phase | None = None
    # the candidate canaried (or promoted) here; None while the segment's candidates are in shadow
    candidate: str | None = None
    # why `candidate` was picked (rollout.select among those that passed shadow here)
    selected: str | None = None
    # candidates that passed shadow here and are not ruled out, in rollout.select's order
    passed: list[str] = []
    # candidates ruled out here, each with the decision that did it
    rejected: dict[str, LastDecision] = {}


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
    # the controller's latest capability matrix (shadow + live, per segment); served by /report.
    # Kafka mode: on {prefix}.reports (RolloutReport), never on {prefix}.rollouts
    report: dict | None = None
    # the controller leadership epoch that wrote this state (or the state it derives from): a state
    # of an older epoch than one already seen is a deposed controller's, and ignored
    epoch: int = 0
    # (phase, step_index, since) of every evidence window this rollout opened, oldest first, so a
    # new controller rebuilds them from the latest state alone
    windows: list[tuple[Phase, int, float]] = []
    # rollout.scope; with segment, `phase`, `canary_weight` and `last_decision` summarise `segments`
    scope: Literal["route", "segment"] = "route"
    # every candidate of this rollout (`candidate` is the first)
    candidates: list[str] = []
    # scope segment: each segment that has seen traffic, with its own phase, weight and step
    segments: dict[str, SegmentState] = {}


class RolloutReport(Record):
    """The controller's capability matrix of one route ({prefix}.reports, keyed by route)."""

    schema_: Literal["modelcanary.report/v1"] = Field("modelcanary.report/v1", alias="schema")
    route: str
    ts: float
    epoch: int = 0
    report: dict


class LeaderRecord(Record):
    """A controller took the lead ({prefix}.control): epochs only grow."""

    schema_: Literal["modelcanary.leader/v1"] = Field("modelcanary.leader/v1", alias="schema")
    instance: str
    epoch: int
    ts: float


def dump(record: Record) -> dict:
    """The JSON-ready dict of a record, with its `schema` tag."""
    return record.model_dump(mode="json", by_alias=True)


SCHEMAS: dict[str, type[Record]] = {
    "modelcanary.outcome/v1": OutcomeEvent,
    "modelcanary.traffic/v1": TrafficEvent,
    "modelcanary.evaluation/v1": EvaluationRecord,
    "modelcanary.rollout/v1": RolloutState,
    "modelcanary.report/v1": RolloutReport,
    "modelcanary.leader/v1": LeaderRecord,
}


def load(data: dict) -> Record:
    """Parse a record dict by its `schema` tag."""
    kind = SCHEMAS.get(data.get("schema", ""))
    if kind is None:
        raise ValueError(f"unknown record schema {data.get('schema')!r}")
    return kind.model_validate(data)
