"""The config file (DESIGN §4): pydantic models, loading and clear errors."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

BUILTIN_SEGMENTS = ("tools", "json", "long_context", "multi_turn", "chat")


def _variable_name(v: str) -> str:
    """An environment variable's name; a key pasted in its place is refused without being shown."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
        raise ValueError("must name an environment variable (letters, digits and _), got something else "
                         "(not shown: it may be the secret itself)")
    return v


EnvName = Annotated[str, AfterValidator(_variable_name)]


def check_regex(pattern: str, where: str = "") -> None:
    """Raise ValueError naming the pattern (and `where`) when it does not compile."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{where}invalid regex {pattern!r}: {e}") from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
PositiveFloat = Annotated[float, Field(gt=0.0)]


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    admin_token_env: EnvName = "MODELCANARY_ADMIN_TOKEN"
    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0)
    drain_seconds: float = Field(30.0, ge=0)
    client_keys_env: EnvName | None = None


def client_keys_problem(config: Config) -> str | None:
    """Why `server.client_keys_env` gives the proxy no usable client key, or names a route that is
    none of the config's (its client would get 403 on every call), or None. Read like the proxy reads
    it (`key1=route-a,route-b;key2=*`); the message never carries a key."""
    variable = config.server.client_keys_env
    if not variable:
        return None
    spec = os.environ.get(variable)
    if spec is None:
        return f"server.client_keys_env: environment variable {variable!r} is not set"
    entries = [entry.partition("=") for entry in spec.split(";") if entry.strip()]
    if not entries:
        return (f"server.client_keys_env: environment variable {variable!r} holds no keys "
                "(expected key1=route-a,route-b;key2=*)")
    for n, (key, _, routes) in enumerate(entries, 1):
        entry = f"server.client_keys_env: entry {n} of environment variable {variable!r}"
        if not key.strip():  # a request with no Authorization header would match it
            return f"{entry} has no key before '='"
        names = (r.strip() for r in routes.split(","))
        unknown = next((r for r in names if r and r != "*" and r not in config.routes and r not in config.models),
                       None)
        if unknown is not None:
            return (f"{entry} names {unknown[:100]!r}, which is neither a route nor a model of this config "
                    f"(routes: {', '.join(config.routes)})")
    return None


class ProviderConfig(Strict):
    base_url: str
    api: Literal["openai", "anthropic"] = "openai"  # the wire format it speaks: OpenAI's, or Anthropic Messages
    api_key_env: EnvName | None = None
    timeout_s: PositiveFloat = 60.0
    connect_timeout_s: PositiveFloat = 5.0
    max_retries: int = Field(2, ge=0, le=10)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if _http_url_problem(v) is not None:  # quoted without user:password@ or the query (`?api-key=`)
            path, query, _ = v.partition("?")
            raise ValueError(f"must be an http(s) URL with a host and a valid port, got "
                             f"{redacted_url(path) + ('?…' if query else '')!r}")
        return v.rstrip("/")

    def forwards_client_key(self) -> str | None:
        """Why calls to this provider carry the client's own Authorization header instead of a key of
        ours (users rely on that), or None when the provider has its key."""
        if self.api_key_env is None:
            return "has no api_key_env"
        if not os.environ.get(self.api_key_env):
            return f"has api_key_env {self.api_key_env}, which is not set"
        return None


class Price(Strict):
    input_per_mtok: float = Field(0.0, ge=0)
    output_per_mtok: float = Field(0.0, ge=0)

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6


# Chat Completions request fields a model's `params` may set (OpenAI's API reference). The call's
# own shape (`model`, `messages`, `stream`, `stream_options`) is the client's, never a setting.
CHAT_PARAMS = frozenset({
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
})


class ModelConfig(Strict):
    provider: str
    name: str = Field(min_length=1)
    price: Price = Price()
    # the model's own request settings, so a prompt or sampling change can be a candidate
    system_prompt: str | None = None   # a system message put before the client's messages
    params: dict[str, object] = {}     # request fields that override the client's

    @field_validator("params")
    @classmethod
    def _chat_params(cls, v: dict[str, object]) -> dict[str, object]:
        for key in v:
            if key not in CHAT_PARAMS:
                raise ValueError(f"{key!r} is not a Chat Completions request field a model can set "
                                 f"(one of: {', '.join(sorted(CHAT_PARAMS))})")
        return v


def port_number(text: str) -> int:
    """A `--port` flag's value: 0 (any free port) to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give a number from 0 to 65535")
    return int(text)


# Checking a schema costs ~0.2 ms per property, on the proxy's loop: larger ones are not checked
# (service.proxy.verifiers), so a configured check may not be larger. 32 KiB is some 400 properties.
MAX_SCHEMA_CHARS = 32 * 1024


def valid_schema(v: dict | None) -> dict | None:
    """A JSON schema field's value, or ValueError saying why it is not a schema (a check with an
    unusable schema would pass everything)."""
    if v is not None:
        text = json.dumps(v, default=str)  # YAML's keys and values as JSON has them (strings, numbers)
        if len(text) > MAX_SCHEMA_CHARS:
            raise ValueError(f"a JSON schema over {MAX_SCHEMA_CHARS // 1024} KiB is not checked (its cost is "
                             "the proxy's); split the check or make it smaller")
        v = json.loads(text)
        try:
            Draft202012Validator.check_schema(v)
        except SchemaError as e:
            raise ValueError(f"not a valid JSON schema: {e.message}") from None
    return v


class Checks(Strict):
    json_schema: dict | None = None
    require_tool_args_valid: bool = True

    _schema_is_valid = field_validator("json_schema")(valid_schema)


class StabilityConfig(Strict):
    """`shadow.stability`: on `sample_rate` of the records, candidate and stable are each asked k times."""

    sample_rate: Probability = 0.05
    k: int = Field(3, ge=2, le=10)


class SimilarityConfig(Strict):
    """`shadow.similarity`: how answers are compared (local embeddings, or an embeddings model from
    `models:`); two answers agree when their similarity is at least `agree_at`."""

    backend: Literal["local", "model"] = "local"
    model: str | None = None
    agree_at: Probability = 0.8

    @model_validator(mode="after")
    def _model_with_its_backend(self) -> SimilarityConfig:
        if self.backend == "model" and not self.model:
            raise ValueError("backend 'model' needs `model`: an embeddings model key from `models:`")
        if self.backend == "local" and self.model is not None:
            raise ValueError("`model` is only used with backend: model (the local backend has its own model)")
        return self


class JudgeModelConfig(Strict):
    """`shadow.judge`: an LLM from `models:` compares the candidate's answer with the live stable one."""

    model: str
    mode: Literal["pairwise"] = "pairwise"
    rubric: str = (
        "Prefer the answer that serves the user's request better: correct facts first, then "
        "completeness, then clarity. Length and style alone are no reason to prefer an answer."
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
    similarity: SimilarityConfig = SimilarityConfig()

    @field_validator("redact")
    @classmethod
    def _regexes_compile(cls, v: list[str]) -> list[str]:
        problems = []
        for i, pattern in enumerate(v, start=1):
            if pattern.startswith(BUILTIN_PREFIX):
                if pattern not in REDACT_BUILTINS:
                    problems.append(f"entry {i}: unknown built-in pattern {pattern!r}; use one of "
                                    f"{', '.join(REDACT_BUILTINS)}")
                continue
            try:
                check_regex(pattern)
            except ValueError as e:
                problems.append(f"entry {i}: {e}")
        if problems:
            raise ValueError("; ".join(problems))
        return v


# A number, never a boolean (YAML's `true` would otherwise read as 1) or a numeric string.
StrictFloat = Annotated[float, Field(strict=True)]
# Margins of rates, shares and [0, 1] scores: a margin of the whole range would pass anything.
FractionMargin = Annotated[StrictFloat, Field(ge=0, le=1)]


class Margins(Strict):
    completion_rate: FractionMargin = 0.01
    model_failure_rate: FractionMargin = 0.01
    client_retry_rate: FractionMargin = 0.01
    task_success_rate: FractionMargin = 0.02
    latency_p95_exceedance: FractionMargin = 0.05
    cost_per_completion_ratio: StrictFloat = Field(1.25, ge=1.0)
    agreement_gap: FractionMargin = 0.05
    similarity_gap: FractionMargin = 0.05
    judge_preference: FractionMargin = 0.05
    stability_gap: FractionMargin = 0.05


class RolloutConfig(Strict):
    steps: list[Annotated[StrictFloat, Field(gt=0, le=100)]] = [1, 5, 25, 50]
    min_shadow_samples: int = Field(300, ge=0)
    min_samples_per_step: int = Field(300, ge=1)
    min_step_seconds: float = Field(60.0, ge=0)
    max_step_seconds: float = Field(3600.0, gt=0)
    on_inconclusive: Literal["hold", "rollback"] = "hold"
    alpha: float = Field(0.01, gt=0, lt=0.5)
    margins: Margins = Margins()
    mode: Literal["auto", "advisory"] = "auto"
    # route: one phase for the whole route; segment: each segment its own phase, weight and step
    scope: Literal["route", "segment"] = "route"
    # which of several candidates that passed shadow in a segment is canaried there
    select: Literal["first", "cheapest", "best"] = "first"

    @field_validator("steps")
    @classmethod
    def _increasing(cls, v: list[float]) -> list[float]:
        if not v:
            raise ValueError("needs at least one step")
        if any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"must be strictly increasing percentages, got {v}")
        if v[-1] == 100:
            raise ValueError("a step of 100% leaves no stable traffic to judge the candidate against; "
                             "promotion, after the last step, sends it all the traffic")
        return v

    @model_validator(mode="after")
    def _step_window(self) -> RolloutConfig:
        if self.max_step_seconds < self.min_step_seconds:
            raise ValueError("max_step_seconds must be >= min_step_seconds")
        return self


class RouteConfig(Strict):
    stable: str
    candidate: str | None = None
    # several candidates (rollout.scope: segment); `candidate: x` is the one-element form, and
    # after validation `candidate` is the first of `candidates`
    candidates: list[str] = []
    checks: Checks = Checks()
    shadow: ShadowConfig = ShadowConfig()
    rollout: RolloutConfig = RolloutConfig()
    task_types: list[str] = []

    @field_validator("task_types")
    @classmethod
    def _task_type_names(cls, v: list[str]) -> list[str]:
        problems = []
        for i, name in enumerate(v, start=1):
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                problems.append(f"entry {i}: task type {name!r} must be 1-64 chars of letters, digits, '_', '.', '-'")
            elif name in BUILTIN_SEGMENTS or name == "overall":
                problems.append(f"entry {i}: task type {name!r} clashes with a built-in segment name")
        if problems:
            raise ValueError("; ".join(problems))
        if len(v) > 50:
            raise ValueError("at most 50 task types per route (metric labels stay bounded)")
        if len(set(v)) < len(v):
            raise ValueError(f"task type {next(t for t in v if v.count(t) > 1)!r} is listed twice")
        return v

    @model_validator(mode="after")
    def _one_candidate_form(self) -> RouteConfig:
        """Fill whichever of `candidate` / `candidates` was left out (Config reports conflicts).
        Set past pydantic's record of given fields, so that Config can tell which form was written."""
        if self.candidates and self.candidate is None:
            object.__setattr__(self, "candidate", self.candidates[0])
        elif self.candidate is not None and not self.candidates:
            object.__setattr__(self, "candidates", [self.candidate])
        return self


class KafkaSecurity(Strict):
    """`events.kafka.security`: kafka-python's SASL/TLS settings, passed on under these names.
    Each `<key>_env` names an environment variable that holds the value instead (how secrets are given)."""

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] | None = None
    sasl_mechanism: Literal["PLAIN", "GSSAPI", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "AWS_MSK_IAM"] | None \
        = None  # what kafka-python 3.0 speaks
    sasl_plain_username: str | None = None
    sasl_plain_password: SecretStr | None = None
    sasl_kerberos_name: str | None = None
    sasl_kerberos_service_name: str | None = None
    sasl_kerberos_domain_name: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_crlfile: str | None = None
    ssl_password: SecretStr | None = None
    ssl_ciphers: str | None = None
    ssl_check_hostname: bool | None = None
    security_protocol_env: EnvName | None = None
    sasl_mechanism_env: EnvName | None = None
    sasl_plain_username_env: EnvName | None = None
    sasl_plain_password_env: EnvName | None = None
    sasl_kerberos_name_env: EnvName | None = None
    sasl_kerberos_service_name_env: EnvName | None = None
    sasl_kerberos_domain_name_env: EnvName | None = None
    ssl_cafile_env: EnvName | None = None
    ssl_certfile_env: EnvName | None = None
    ssl_keyfile_env: EnvName | None = None
    ssl_crlfile_env: EnvName | None = None
    ssl_password_env: EnvName | None = None
    ssl_ciphers_env: EnvName | None = None
    ssl_check_hostname_env: EnvName | None = None

    @classmethod
    def keys(cls) -> list[str]:
        """The kafka-python settings (the fields that are not `<key>_env`)."""
        return [k for k in cls.model_fields if not k.endswith("_env")]

    @model_validator(mode="after")
    def _one_source_each(self) -> KafkaSecurity:
        both = [k for k in self.keys() if getattr(self, k) is not None and getattr(self, f"{k}_env") is not None]
        if both:
            raise ValueError(f"{both[0]} and {both[0]}_env are both set: give the value or the variable, not both")
        return self

    def resolved(self) -> dict[str, Any]:
        """kafka-python keyword arguments, `<key>_env` variables read. A ValueError names the key and
        the variable, never a value."""
        out: dict[str, Any] = {}
        for key in self.keys():
            value = getattr(self, key)
            variable = getattr(self, f"{key}_env")
            if variable is not None:
                resolved = os.environ.get(variable)
                if resolved is None:
                    raise ValueError(f"events.kafka.security.{key}_env: environment variable {variable!r} is not set")
                try:
                    value = getattr(KafkaSecurity.model_validate({key: resolved}), key)
                except ValidationError:
                    raise ValueError(f"events.kafka.security.{key}_env: the value of {variable!r} "
                                     f"is not a valid {key}") from None
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            if value is not None:
                out[key] = value
        return out


class TopicRetention(Strict):
    """Hours the broker keeps each event topic's records. A controller rebuilds its evidence from the
    outcomes and evaluations since the rollout began: keep those at least as long as a rollout lasts."""

    outcomes: float | None = Field(None, gt=0)
    traffic: float | None = Field(None, gt=0)
    evaluations: float | None = Field(None, gt=0)


# The codec libraries kafka-python needs per compression type (kafka.codec's check, the package).
CODEC_PACKAGES = {"gzip": ("has_gzip", "(standard library)"), "snappy": ("has_snappy", "python-snappy"),
                  "lz4": ("has_lz4", "lz4"), "zstd": ("has_zstd", "zstandard")}


_BOOTSTRAP_SERVER = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(\d{1,5}))?")


class KafkaConfig(Strict):
    bootstrap_servers: str = "127.0.0.1:9092"
    # Kafka's topic name rules (ASCII letters, digits, . _ -; 249 characters with the longest topic's suffix)
    topic_prefix: str = Field("modelcanary", pattern=r"^[A-Za-z0-9._-]+$", max_length=249 - len(".evaluations"))
    security: KafkaSecurity | None = None
    partitions: int = Field(6, ge=1)
    linger_ms: int = Field(5, ge=0)
    compression_type: Literal["gzip", "lz4", "snappy", "zstd"] | None = "gzip"
    # retention.ms of the event topics when the service creates them (null: the broker's default)
    retention_hours: TopicRetention = TopicRetention()

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_ports(cls, v: str) -> str:
        for server in v.split(","):
            m = _BOOTSTRAP_SERVER.fullmatch(server.strip())
            if m is None or not 0 < int(m.group(1) or 9092) < 65536:
                raise ValueError("must be HOST:PORT, or several of them comma-separated")
        return v

    def compression_problem(self) -> str | None:
        """Why `compression_type` can't be used here: its codec's library is not installed."""
        if self.compression_type is None:
            return None
        from kafka import codec

        check, package = CODEC_PACKAGES[self.compression_type]
        if getattr(codec, check)():
            return None
        return (f"events.kafka.compression_type: {self.compression_type!r} needs the Python package {package!r}, "
                "which is not installed (or use gzip)")


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
    interval_s: float | None = Field(None, ge=0.05, le=5)
    # the report is published on a decision, else at most this often and only when it changed
    report_interval_s: float = Field(30.0, gt=0)
    # feedback that names a request the controller has not seen waits this long for its outcome
    feedback_hold_s: float = Field(120.0, gt=0)


class TracingConfig(Strict):
    otlp_endpoint: str | None = None
    capture_content: bool = False

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        """OTLP over HTTP: an http(s) URL (else every export fails and logs the URL, credentials and all),
        with no credentials in it: the exporter logs the URL whenever the collector is unreachable."""
        if v and (problem := _http_url_problem(v)) is not None:
            raise ValueError(f"must be an http(s) URL with a host and a valid port, got one whose {problem} "
                             "(the rest of the URL is not shown: it may hold a secret)")
        if v and _holds_credentials(v):
            raise ValueError("must not carry a query string, a fragment or user:password@, got one that does "
                             "(not shown: the exporter logs its URL); give the collector's credentials as headers "
                             "in the OTEL_EXPORTER_OTLP_HEADERS environment variable (e.g. api-key=...)")
        return v


def _holds_credentials(url: str) -> bool:
    """Whether a URL has a query, a fragment or a userinfo part (where a key would be)."""
    parts = urlsplit(url)
    return bool(parts.query or parts.fragment or "@" in parts.netloc)


class NotifyConfig(Strict):
    webhook_url: str | None = None
    webhook_url_env: EnvName | None = None  # names a variable holding the URL (from a Secret), as api_key_env

    @field_validator("webhook_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        """An http(s) URL with a host and a valid port (else every POST fails, at run time)."""
        if not v:
            return v  # "" is no webhook, as null
        problem = NotifyConfig._unusable(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _one_source(self) -> NotifyConfig:
        if self.webhook_url and self.webhook_url_env:
            raise ValueError("give webhook_url or webhook_url_env, not both")
        return self

    @staticmethod
    def _unusable(url: str) -> str | None:
        """Why no POST to `url` can work, or None. Never quotes it: its path (Slack, Teams) or
        user:password@ is the secret."""
        problem = _http_url_problem(url)
        if problem is None:
            return None
        return (f"must be an http(s) URL with a host and a valid port, got one whose {problem} "
                "(the rest of the URL is not shown: it may hold a secret)")

    def resolved_url(self) -> str | None:
        """The URL to POST to (None: no webhook): `webhook_url`, or the value of `webhook_url_env`'s
        variable without the whitespace around it (a Secret file's line break). A ValueError names the
        variable and what is wrong with its value, never the value."""
        variable = self.webhook_url_env
        if not variable:
            return self.webhook_url or None
        url = os.environ.get(variable, "").strip()
        if not url:
            raise ValueError(f"notify.webhook_url_env: environment variable {variable!r} is not set")
        problem = NotifyConfig._unusable(url)
        if problem is not None:
            raise ValueError(f"notify.webhook_url_env: the value of {variable!r} {problem}")
        return url


def _http_url_problem(url: str) -> str | None:
    """What is wrong with a URL the service calls (a webhook, a collector, a provider), phrased without
    its secret parts; None when it is fine."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "host part does not parse (e.g. an unclosed '[')"
    if parts.scheme not in ("http", "https"):
        shown = f" {parts.scheme!r}" if re.fullmatch(r"[A-Za-z][A-Za-z0-9.+-]{0,15}", parts.scheme) else ""
        return f"scheme{shown} is not http or https"
    if not parts.hostname:
        return "host is missing"
    if re.search(r"\s", url) or not url.isprintable():
        return "text contains spaces or control characters"
    try:
        port_ok = parts.port is None or parts.port > 0  # .port raises on one out of range or not a number
    except ValueError:
        port_ok = False
    if not port_ok:
        hostport = parts.netloc.rpartition("@")[2]
        raw = hostport[hostport.rfind("]") + 1:].partition(":")[2]
        shown = f" {raw!r}" if re.fullmatch(r"[A-Za-z0-9]{1,8}", raw) else ""
        return f"port{shown} is not a number from 1 to 65535"
    return None


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

    @field_validator("providers", "models", "routes")
    @classmethod
    def _names(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name in v:
            if not name.strip() or name != name.strip():
                raise ValueError(f"name {name!r} is empty or has spaces around it")
        return v

    @model_validator(mode="after")
    def _references(self) -> Config:  # noqa: C901 - one flat list of cross-reference checks, each naming its field
        problems: list[tuple[tuple, str]] = []
        for name, model in self.models.items():
            if model.provider not in self.providers:
                problems.append((("models", name, "provider"), f"unknown provider {model.provider!r}"))
        for name, route in self.routes.items():
            if name in self.models:
                problems.append((("routes", name), "a route and a model cannot share a name"))
            if route.stable not in self.models:
                problems.append((("routes", name, "stable"), f"unknown model {route.stable!r}"))
            problems += _candidate_problems(name, route, self)
            judge = route.shadow.judge
            if judge is not None and judge.model not in self.models:
                problems.append((("routes", name, "shadow", "judge", "model"), f"unknown model {judge.model!r}"))
            elif judge is not None and (p := self.providers.get(self.models[judge.model].provider)) is not None \
                    and p.api != "openai":
                problems.append((("routes", name, "shadow", "judge", "model"),
                                 f"the judge {judge.model!r} is served by an api: {p.api} provider; the judge's "
                                 "prompt is a Chat Completions request, so it needs an api: openai provider"))
            embeddings = route.shadow.similarity.model
            if embeddings is not None and embeddings not in self.models:
                problems.append((("routes", name, "shadow", "similarity", "model"), f"unknown model {embeddings!r}"))
        if problems:
            raise ConfigProblems(problems)
        return self

    def mixed_apis(self, stable: str, candidate: str) -> str | None:
        """Why a route's stable and candidate can't share it (their providers speak different APIs), or None."""
        apis = [p.api if (p := self.providers.get(self.models[m].provider)) else None for m in (stable, candidate)]
        if None in apis or apis[0] == apis[1]:
            return None
        return (f"stable {stable!r} is served by an api: {apis[0]} provider and candidate {candidate!r} by an "
                f"api: {apis[1]} one; a route's models must share one provider api (the proxy does not "
                "translate between formats)")

    def version(self) -> str:
        """A short, stable hash of the effective config (records carry it as config_version)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:12]


def _candidate_problems(name: str, route: RouteConfig, config: Config) -> list[tuple[tuple, str]]:
    """A route's candidates: known models other than stable, sharing its provider api, each listed once;
    several only with rollout.scope: segment; rollout.select only among several."""
    problems: list[tuple[tuple, str]] = []
    listed = "candidates" in route.model_fields_set
    if listed and route.candidates and route.candidate != route.candidates[0]:
        problems.append((("routes", name, "candidate"), "give candidate (one model) or candidates (a list), not both"))
    for i, key in enumerate(route.candidates):
        where = ("routes", name, "candidates", i) if listed else ("routes", name, "candidate")
        if key not in config.models:
            problems.append((where, f"unknown model {key!r}"))
        elif key == route.stable:
            problems.append((where, "must differ from stable"))
        elif key in route.candidates[:i]:
            problems.append((where, f"{key!r} is listed twice"))
        elif route.stable in config.models and (apis := config.mixed_apis(route.stable, key)):
            problems.append((where, apis))
    rollout = route.rollout
    if len(route.candidates) > 1 and rollout.scope == "route":
        problems.append((("routes", name, "candidates"), "several candidates need rollout.scope: segment "
                         "(each segment canaries the one rollout.select picks among those that passed shadow)"))
    if rollout.select != "first" and len(route.candidates) < 2:
        problems.append((("routes", name, "rollout", "select"), "chooses among several candidates; list them "
                         "in candidates: [a, b]"))
    return problems


class ConfigProblems(ValueError):
    def __init__(self, problems: list[tuple[tuple, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{_path(loc)}: {msg}" for loc, msg in problems))


def environment_problems(config: Config, proxy: bool) -> list[str]:
    """What a valid config names in the environment that is missing or unusable ('path: reason'
    lines, never a value); `proxy`: also the client keys, which only the proxy reads."""
    problems = []
    kafka = config.events.kafka
    if config.events.backend == "kafka":
        if kafka.security is not None:
            try:
                kafka.security.resolved()  # `<key>_env` variables must be set
            except ValueError as e:
                problems.append(str(e))
        if (codec := kafka.compression_problem()) is not None:
            problems.append(codec)
    if proxy and (client_keys := client_keys_problem(config)) is not None:
        problems.append(client_keys)
    return problems


def tls_file_problems(config: Config) -> list[str]:
    """The TLS files the Kafka client will open, checked where it starts (else it fails each connection
    without naming them); not by check-config, which may run where they are not mounted."""
    security = config.events.kafka.security if config.events.backend == "kafka" else None
    try:
        resolved = security.resolved() if security is not None else {}
    except ValueError:
        return []  # reported as the variable that is not set
    return [f"events.kafka.security.{key}: {resolved[key]!r} is not a readable file"
            for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_crlfile")
            if key in resolved and not (os.path.isfile(resolved[key]) and os.access(resolved[key], os.R_OK))]


class ReloadRefused(Exception):
    """A reload this process can't do (`code` says why, for the admin API's answer)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


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


_SECRET_FIELD = re.compile(r"password|secret|token", re.IGNORECASE)
_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def redacted_url(text: str) -> str:
    """`text` with any URL's user:password@ shown as ***@: a value quoted in an error is logged."""
    return _USERINFO.sub("***@", text)


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
        elif kind == "literal_error" and loc and loc[-1] == "[key]":  # a mapping whose keys are a fixed set
            loc = loc[:-1]
            msg = f"unknown key; expected {e['msg'].removeprefix('Input should be ')}"
        elif kind == "missing":
            msg = "required field is missing"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            secret = any(isinstance(p, str) and _SECRET_FIELD.search(p) for p in loc)
            if ("input" in e and kind not in ("model_type", "dict_type") and not isinstance(e["input"], (dict, list))
                    and not secret and not (kind == "value_error" and "got " in msg)):
                msg += f" (got {e['input']!r})"
        lines.append(f"{_path(loc)}: {redacted_url(msg)}")
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
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise ConfigError(str(p), ["(yaml) nested too deeply"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(str(p), [f"(yaml) {where}{problem}"]) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML would keep the last one
    silently: a model defined twice would lose its first definition)."""


def _unique_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen: set[object] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be given again
            continue
        key = loader.construct_object(key_node)
        if not isinstance(key, (str, int, float, bool)):  # a list or a mapping as a key: pydantic names it
            continue
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice in this mapping",
                                                    key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_keys)


def parse_config(data: object, source: str = "config") -> Config:
    """`data` as a Config, or ConfigError with every problem: field errors, and the cross-reference
    problems that the fields that are valid already show."""
    if not isinstance(data, dict):
        return validated(Config, data, source)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, _describe(e) + _reference_problems_despite(e, data)) from None


def load_config(path: str | os.PathLike) -> Config:
    return parse_config(read_yaml(path), str(path))


# What `Config._references` reads, per entry of these sections. Any other field, and any other
# section, can be set back to its default without changing what the reference checks find.
REFERENCE_FIELDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "providers": (("api",),),
    "models": (("provider",),),
    "routes": (("stable",), ("candidate",), ("candidates",), ("shadow", "judge", "model"),
               ("shadow", "similarity", "model"), ("rollout", "scope"), ("rollout", "select")),
}
MAX_PASSES = 3  # a default can fail a check across fields; that object is then dropped in turn


def _reference_problems_despite(err: ValidationError, data: dict) -> list[str]:
    """`Config._references` only runs once every field is valid. Its problems all the same: the
    same data with each invalid field or unknown key dropped (its default used instead), validated
    again. Nothing when a dropped field is one the references read, or a required one: the
    reference problems would then be guesses."""
    if _has_reference_problems(err):  # the fields were valid: `err` already has them
        return []
    data = dict(data)
    for _ in range(MAX_PASSES):
        for e in err.errors():
            loc = _field_loc(e["loc"])
            if e["type"] == "missing" or _reads_references(loc) or not _drop(data, loc):
                return []
        try:
            Config.model_validate(data)
            return []
        except ValidationError as again:
            err = again
        if _has_reference_problems(err):  # the references ran, so every field was valid this time
            return _describe(err)
    return []


def _has_reference_problems(err: ValidationError) -> bool:
    return any(isinstance((e.get("ctx") or {}).get("error"), ConfigProblems) for e in err.errors())


def _field_loc(loc: tuple) -> tuple:
    """An error's location up to the field it is in (a list item's error drops the whole list)."""
    field: list = []
    for part in loc:
        if isinstance(part, int):
            break
        if not (isinstance(part, str) and part.startswith("function-")):
            field.append(part)
    return tuple(field)


def _reads_references(loc: tuple) -> bool:
    """Whether the field at `loc` is, holds or lies in one that `Config._references` reads."""
    if not loc or loc[0] not in REFERENCE_FIELDS:
        return False
    rest = loc[2:]
    return len(loc) < 3 or any(rest[:len(f)] == f[:len(rest)] for f in REFERENCE_FIELDS[loc[0]])


def _drop(data: dict, loc: tuple) -> bool:
    """Remove the key at `loc` from the nested mappings of `data`, copying the nested ones on the way
    (only `data` itself changes); False when `loc` is not a key of a mapping there."""
    if not loc:
        return False
    node = data
    for part in loc[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            return False
        copy = dict(child)
        node[part] = copy
        node = copy
    if loc[-1] not in node:
        return False
    del node[loc[-1]]
    return True
