"""The simulator's config file (DESIGN §8b): pydantic models, loading, clear errors.

A model's behaviour is its base settings, overridden per segment (`segments:`) and,
as time passes, per phase (`phases:`). Every combination is resolved once at load
time into an `Effective` (plain floats, ready for the hot path).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.config import read_yaml, validated

Probability = Annotated[float, Field(ge=0.0, le=1.0)]

# Order in which failures are drawn and checked: the first one that fires (and applies
# to the request) wins. Changing this order changes every seeded run, so only append.
FailureKind = Literal[
    "auth_error",
    "quota_exceeded",
    "rate_limited",
    "provider_5xx",
    "timeout",
    "bad_response",
    "content_filtered",
    "refusal",
    "empty_output",
    "truncated",
    "invalid_json",
    "invalid_tool_call",
]
FAILURE_KINDS: tuple[FailureKind, ...] = get_args(FailureKind)

# z-score of the 95th percentile of a standard normal
Z95 = 1.6448536269514722


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Dist(Strict):
    """A log-normal given by its median and 95th percentile."""

    median: float = Field(ge=0.0)
    p95: float = Field(ge=0.0)

    @model_validator(mode="after")
    def _ordered(self) -> Dist:
        if self.p95 < self.median:
            raise ValueError(f"p95 ({self.p95}) must be >= median ({self.median})")
        return self

    @property
    def mu_sigma(self) -> tuple[float, float]:
        """(mu, sigma) of the underlying normal; mu is -inf for a median of 0 (always 0)."""
        if self.median <= 0.0:
            return -math.inf, 0.0
        return math.log(self.median), math.log(self.p95 / self.median) / Z95


class Overrides(Strict):
    """Settings a segment or phase may override; distributions are replaced whole."""

    latency_s: Dist | None = None
    ttft_s: Dist | None = None
    output_tokens: Dist | None = None
    context_tokens: int | None = Field(None, gt=0)
    divergence: Probability | None = None
    wrong_content: Probability | None = None
    failures: dict[FailureKind, Probability | None] | None = None  # a null one is not given

    @field_validator("output_tokens")
    @classmethod
    def _at_least_one_token(cls, v: Dist | None) -> Dist | None:
        if v is not None and v.median < 1:
            raise ValueError(f"median must be >= 1 token, got {v.median}")
        return v


class Phase(Overrides):
    """Overrides that apply once `after_s` seconds (wall clock since start) have passed."""

    after_s: float = Field(ge=0.0)
    segments: dict[str, Overrides] = {}


class SimModel(Strict):
    latency_s: Dist = Dist(median=0.3, p95=0.8)
    ttft_s: Dist = Dist(median=0.08, p95=0.2)
    output_tokens: Dist = Dist(median=60, p95=200)
    context_tokens: int = Field(128000, gt=0)
    divergence: Probability = 0.0
    wrong_content: Probability = 0.0              # fluent answers with a wrong fact (for the pairwise judge)
    failures: dict[FailureKind, Probability] = {}  # probability per request (DESIGN §6 causes); 0 unless given
    segments: dict[str, Overrides] = {}
    phases: list[Phase] = []
    embedding_dims: int = Field(256, gt=0, le=8192)
    judge: bool = False                           # answer pairwise-judge prompts from the planted facts
    judge_error: Probability = 0.0                # chance of a random verdict instead

    @field_validator("output_tokens")
    @classmethod
    def _at_least_one_token(cls, v: Dist) -> Dist:
        if v.median < 1:
            raise ValueError(f"median must be >= 1 token, got {v.median}")
        return v

    @field_validator("phases")
    @classmethod
    def _by_time(cls, v: list[Phase]) -> list[Phase]:
        return sorted(v, key=lambda p: p.after_s)  # stable: equal after_s keep file order


class SimulatorConfig(Strict):
    seed: int = 42
    time_scale: float = Field(1.0, ge=0.0)
    api_key: str | None = None
    models: dict[str, SimModel]

    @field_validator("models")
    @classmethod
    def _non_empty(cls, v: dict[str, SimModel]) -> dict[str, SimModel]:
        if not v:
            raise ValueError("needs at least one model")
        return v


@dataclass(frozen=True, slots=True)
class Effective:
    """A model's resolved behaviour for one (segment, phase): what the engine reads."""

    latency: tuple[float, float]        # (mu, sigma)
    ttft: tuple[float, float]
    output_tokens: tuple[float, float]
    context_tokens: int
    divergence: float
    wrong_content: float
    failures: tuple[float, ...]         # probabilities in FAILURE_KINDS order


def _apply(state: dict, o: Overrides) -> None:
    for name in ("latency_s", "ttft_s", "output_tokens", "context_tokens", "divergence", "wrong_content"):
        value = getattr(o, name)
        if value is not None:
            state[name] = value
    if o.failures is not None:
        state["failures"].update((kind, p) for kind, p in o.failures.items() if p is not None)


def resolve(model: SimModel, segment: str | None, phases_passed: int) -> Effective:
    """Base, then the segment's overrides, then each passed phase (and its segment overrides)."""
    state: dict = {
        "latency_s": model.latency_s,
        "ttft_s": model.ttft_s,
        "output_tokens": model.output_tokens,
        "context_tokens": model.context_tokens,
        "divergence": model.divergence,
        "wrong_content": model.wrong_content,
        "failures": dict(model.failures),
    }
    if segment is not None and segment in model.segments:
        _apply(state, model.segments[segment])
    for phase in model.phases[:phases_passed]:
        _apply(state, phase)
        if segment is not None and segment in phase.segments:
            _apply(state, phase.segments[segment])
    return Effective(
        latency=state["latency_s"].mu_sigma,
        ttft=state["ttft_s"].mu_sigma,
        output_tokens=state["output_tokens"].mu_sigma,
        context_tokens=state["context_tokens"],
        divergence=state["divergence"],
        wrong_content=state["wrong_content"],
        failures=tuple(state["failures"].get(kind, 0.0) for kind in FAILURE_KINDS),
    )


def parse_simulator_config(data: object, source: str = "simulator config") -> SimulatorConfig:
    return validated(SimulatorConfig, data, source)


def load_simulator_config(path: str | os.PathLike) -> SimulatorConfig:
    """Read and validate a simulator YAML file; raise ConfigError with 'field.path: reason' lines."""
    return validated(SimulatorConfig, read_yaml(path), str(path))
