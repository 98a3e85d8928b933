"""The config file (DESIGN §4): pydantic models, loading and clear errors."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BUILTIN_SEGMENTS = ("tools", "json", "long_context", "multi_turn", "chat")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
PositiveFloat = Annotated[float, Field(gt=0.0)]


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    admin_token_env: str = "MODELCANARY_ADMIN_TOKEN"
    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0)
    drain_seconds: float = Field(30.0, ge=0)
    client_keys_env: str | None = None


class ProviderConfig(Strict):
    base_url: str
    api_key_env: str | None = None
    timeout_s: PositiveFloat = 60.0
    connect_timeout_s: PositiveFloat = 5.0
    max_retries: int = Field(2, ge=0, le=10)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"must be an http(s) URL, got {v!r}")
        return v.rstrip("/")


class Price(Strict):
    input_per_mtok: float = Field(0.0, ge=0)
    output_per_mtok: float = Field(0.0, ge=0)

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6


class ModelConfig(Strict):
    provider: str
    name: str
    price: Price = Price()


class Checks(Strict):
    json_schema: dict | None = None
    require_tool_args_valid: bool = True


class StabilityConfig(Strict):
    sample_rate: Probability = 0.0
    k: int = Field(3, ge=2, le=10)


class JudgeModelConfig(Strict):
    model: str
    rubric: str = (
        "Score how well the answer serves the user's request, from 0 (useless or wrong) "
        "to 1 (fully correct and helpful)."
    )
    sample_rate: Probability = 1.0


# `shadow.redact` entries: a regex, or one of these names for a built-in pattern.
BUILTIN_PREFIX = "builtin:"
REDACT_BUILTINS: dict[str, str] = {
    "builtin:email": r"[\w.+-]+@[\w-]+\.[\w.-]+",
    "builtin:phone": r"(?<!\w)\+?\d[\d\s().-]{7,}\d(?!\w)",
}


def redaction_patterns(entries: list[str]) -> list[str]:
    """The regexes of `shadow.redact`, built-in names resolved."""
    return [REDACT_BUILTINS.get(e, e) for e in entries]


class ShadowConfig(Strict):
    sample_rate: Probability = 0.2
    max_per_minute: int = Field(600, ge=0)
    max_usd_per_hour: float | None = Field(None, ge=0)
    noise_floor: bool = True
    redact: list[str] = []
    stability: StabilityConfig = StabilityConfig()
    judge: JudgeModelConfig | None = None

    @field_validator("redact")
    @classmethod
    def _regexes_compile(cls, v: list[str]) -> list[str]:
        for pattern in v:
            if pattern.startswith(BUILTIN_PREFIX):
                if pattern not in REDACT_BUILTINS:
                    raise ValueError(f"unknown built-in pattern {pattern!r}; use one of {', '.join(REDACT_BUILTINS)}")
                continue
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"invalid regex {pattern!r}: {e}") from None
        return v


class Margins(Strict):
    completion_rate: float = Field(0.01, ge=0)
    model_failure_rate: float = Field(0.01, ge=0)
    client_retry_rate: float = Field(0.01, ge=0)
    task_success_rate: float = Field(0.02, ge=0)
    latency_p95_exceedance: float = Field(0.05, ge=0)
    cost_per_completion_ratio: float = Field(1.25, ge=1.0)
    agreement_gap: float = Field(0.05, ge=0)


class RolloutConfig(Strict):
    steps: list[Annotated[float, Field(gt=0, le=100)]] = [1, 5, 25, 50]
    min_shadow_samples: int = Field(300, ge=0)
    min_samples_per_step: int = Field(300, ge=1)
    min_step_seconds: float = Field(60.0, ge=0)
    max_step_seconds: float = Field(3600.0, gt=0)
    on_inconclusive: Literal["hold", "rollback"] = "hold"
    alpha: float = Field(0.01, gt=0, lt=0.5)
    margins: Margins = Margins()
    mode: Literal["auto", "advisory"] = "auto"

    @field_validator("steps")
    @classmethod
    def _increasing(cls, v: list[float]) -> list[float]:
        if not v:
            raise ValueError("needs at least one step")
        if any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"must be strictly increasing percentages, got {v}")
        return v

    @model_validator(mode="after")
    def _step_window(self) -> RolloutConfig:
        if self.max_step_seconds < self.min_step_seconds:
            raise ValueError("max_step_seconds must be >= min_step_seconds")
        return self


class RouteConfig(Strict):
    stable: str
    candidate: str | None = None
    checks: Checks = Checks()
    shadow: ShadowConfig = ShadowConfig()
    rollout: RolloutConfig = RolloutConfig()
    task_types: list[str] = []

    @field_validator("task_types")
    @classmethod
    def _task_type_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise ValueError(f"task type {name!r} must be 1-64 chars of letters, digits, '_', '.', '-'")
            if name in BUILTIN_SEGMENTS or name == "overall":
                raise ValueError(f"task type {name!r} clashes with a built-in segment name")
        if len(v) > 50:
            raise ValueError("at most 50 task types per route (metric labels stay bounded)")
        return v


class KafkaConfig(Strict):
    bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = "modelcanary"
    security: dict | None = None
    partitions: int = Field(6, ge=1)
    linger_ms: int = Field(5, ge=0)
    compression_type: Literal["gzip", "lz4", "snappy", "zstd"] | None = "gzip"


class SpoolConfig(Strict):
    dir: str = ".modelcanary/spool"
    max_bytes: int = Field(256 * 1024 * 1024, gt=0)


class EventsConfig(Strict):
    backend: Literal["memory", "kafka"] = "memory"
    kafka: KafkaConfig = KafkaConfig()
    spool: SpoolConfig = SpoolConfig()
    queue_size: int = Field(65536, ge=16)


class CollectConfig(Strict):
    concurrency: int = Field(32, ge=1, le=1024)
    metrics_port: int = Field(9464, ge=0, le=65535)


class ControlConfig(Strict):
    metrics_port: int = Field(9465, ge=0, le=65535)
    interval_s: float | None = Field(None, gt=0)


class TracingConfig(Strict):
    otlp_endpoint: str | None = None
    capture_content: bool = False


class NotifyConfig(Strict):
    webhook_url: str | None = None


class Config(Strict):
    server: ServerConfig = ServerConfig()
    providers: dict[str, ProviderConfig]
    models: dict[str, ModelConfig]
    routes: dict[str, RouteConfig]
    events: EventsConfig = EventsConfig()
    collect: CollectConfig = CollectConfig()
    control: ControlConfig = ControlConfig()
    state_dir: str = ".modelcanary/state"
    tracing: TracingConfig = TracingConfig()
    notify: NotifyConfig = NotifyConfig()

    @model_validator(mode="after")
    def _references(self) -> Config:
        problems: list[tuple[tuple, str]] = []
        for name, model in self.models.items():
            if model.provider not in self.providers:
                problems.append((("models", name, "provider"), f"unknown provider {model.provider!r}"))
        for name, route in self.routes.items():
            if name in self.models:
                problems.append((("routes", name), "a route and a model cannot share a name"))
            if route.stable not in self.models:
                problems.append((("routes", name, "stable"), f"unknown model {route.stable!r}"))
            if route.candidate is not None:
                if route.candidate not in self.models:
                    problems.append((("routes", name, "candidate"), f"unknown model {route.candidate!r}"))
                elif route.candidate == route.stable:
                    problems.append((("routes", name, "candidate"), "must differ from stable"))
            judge = route.shadow.judge
            if judge is not None and judge.model not in self.models:
                problems.append((("routes", name, "shadow", "judge", "model"), f"unknown model {judge.model!r}"))
        if problems:
            raise ConfigProblems(problems)
        return self

    def version(self) -> str:
        """A short, stable hash of the effective config (records carry it as config_version)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:12]


class ConfigProblems(ValueError):
    def __init__(self, problems: list[tuple[tuple, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{_path(loc)}: {msg}" for loc, msg in problems))


class ConfigError(Exception):
    """A config that can't be used; `problems` are 'path: reason' lines."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))

    def explain(self, what: str = "config") -> str:
        """What the CLI prints: the file, then one problem per line."""
        return "\n".join([f"error: {what} {self.source} is not valid:", *(f"  {p}" for p in self.problems)])


_PLAIN_KEY = re.compile(r"[\w@:/+*-]+")


def _path(loc: tuple) -> str:
    """Dotted field path; a key that is empty or has spaces, dots or control characters is quoted."""
    return ".".join(p if isinstance(p, str) and _PLAIN_KEY.fullmatch(p) else repr(p) if isinstance(p, str)
                    else str(p) for p in loc) or "(top level)"


def _describe(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, ConfigProblems):
            lines.extend(f"{_path(loc)}: {msg}" for loc, msg in ctx_err.problems)
            continue
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        kind = e["type"]
        if kind == "extra_forbidden":
            msg = "unknown key"
        elif kind == "missing":
            msg = "required field is missing"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if "input" in e and kind not in ("model_type", "dict_type") and not isinstance(e["input"], (dict, list)):
                msg += f" (got {e['input']!r})"
        lines.append(f"{_path(loc)}: {msg}")
    return lines


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], data: object, source: str) -> M:
    """`data` as a `model`, or ConfigError with 'field.path: reason' lines."""
    if not isinstance(data, dict):
        raise ConfigError(source, [f"(top level): must be a mapping of keys, got {type(data).__name__}"])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, _describe(e)) from None


def read_yaml(path: str | os.PathLike) -> object:
    """The YAML document in a file, or ConfigError naming the line and column of a syntax error."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(p), ["file not found"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(p), [f"cannot read file: {e}"]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(str(p), [f"(yaml) {where}{problem}"]) from None


def parse_config(data: object, source: str = "config") -> Config:
    return validated(Config, data, source)


def load_config(path: str | os.PathLike) -> Config:
    return validated(Config, read_yaml(path), str(path))
