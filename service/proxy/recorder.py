"""After a call ends: metrics, the OutcomeEvent, the shadow sample and the trace. Never on the
client's critical path (it runs once the response is sent)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from service import metrics
from service.bus.base import EventBus
from service.config import Config, redaction_patterns
from service.proxy.outcome import Verdict
from service.proxy.routing import session_hash
from service.proxy.sampler import ShadowSampler
from service.proxy.segments import estimate_tokens, message_chars
from service.recent import Recent
from service.records import OutcomeEvent, PrimaryResult, TrafficEvent

FEEDBACK_MEMORY = 100_000


@dataclass(slots=True)
class Call:
    """One proxied request, filled in as it goes."""

    request_id: str
    route: str
    model_key: str
    role: str
    segment: str
    started: float
    request: dict | None
    session_key: str | None = None
    client_retry: bool = False
    stream: bool = False
    no_shadow: bool = False
    traceparent: str | None = None
    upstream_retries: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    status: int = 0
    verdict: Verdict | None = None
    response: dict | None = None
    span: object | None = None
    finish_reasons: list[str] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class Served:
    route: str
    model: str
    role: str
    segment: str
    session_id_hash: str | None


def usage_tokens(call: Call) -> tuple[int, int]:
    usage = (call.response or {}).get("usage") if call.response else None
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        return usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    if call.request is None:
        return 0, 0
    messages = call.request.get("messages")
    input_tokens = estimate_tokens(message_chars(messages)) if isinstance(messages, list) else 0
    output_chars = 0
    for choice in (call.response or {}).get("choices") or ():
        message = choice.get("message") or {}
        output_chars += len(message.get("content") or "")
        for tc in message.get("tool_calls") or ():
            output_chars += len((tc.get("function") or {}).get("arguments") or "")
    return input_tokens, estimate_tokens(output_chars)


class Recorder:
    def __init__(self, config: Config, bus: EventBus, sampler: ShadowSampler):
        self.config = config
        self.bus = bus
        self.sampler = sampler
        self.config_version = config.version()
        # request id, and ("session", hash), -> (index in _labels, has a session hash, session hash - 2**63)
        self._served = Recent(FEEDBACK_MEMORY, width=3)
        self._labels: list[tuple[str, str, str, str]] = []  # (route, model, role, segment): few
        self._label_index: dict[tuple[str, str, str, str], int] = {}
        self._redact = self._compile_redactions(config)
        # labelled children looked up once per label set (`labels()` takes a lock and builds tuples)
        self._requests = metrics.LabelCache(metrics.requests_total)
        self._failures = metrics.LabelCache(metrics.failures_total)
        self._duration = metrics.LabelCache(metrics.request_duration)
        self._ttft = metrics.LabelCache(metrics.time_to_first_token)
        self._client_retries = metrics.LabelCache(metrics.client_retries_total)
        self._tokens = metrics.LabelCache(metrics.tokens_total)
        self._cost = metrics.LabelCache(metrics.cost_usd_total)

    def reload(self, config: Config) -> None:
        self.config = config
        self.config_version = config.version()
        self._redact = self._compile_redactions(config)

    def finish(self, call: Call) -> None:
        verdict = call.verdict
        assert verdict is not None
        route, model, role = call.route, call.model_key, call.role
        input_tokens, output_tokens = usage_tokens(call)
        model_cfg = self.config.models.get(model)
        cost = model_cfg.price.cost(input_tokens, output_tokens) if model_cfg else 0.0

        self._requests.get(route, model, role, call.segment, verdict.outcome).inc()
        if not verdict.ok:
            self._failures.get(route, model, role, verdict.cause, verdict.blame).inc()
        self._duration.get(route, model, role).observe(call.latency_s)
        if call.ttft_s is not None:
            self._ttft.get(route, model, role).observe(call.ttft_s)
        if call.client_retry:
            self._client_retries.get(route, model, role).inc()
        if input_tokens:
            self._tokens.get(route, model, role, "input").inc(input_tokens)
        if output_tokens:
            self._tokens.get(route, model, role, "output").inc(output_tokens)
        if cost:
            self._cost.get(route, model, role).inc(cost)

        sid = session_hash(call.session_key)
        self.bus.publish("outcomes", OutcomeEvent.model_construct(
            request_id=call.request_id, ts=time.time(), route=route, model=model, role=role,
            segment=call.segment, session_id_hash=sid, outcome=verdict.outcome, cause=verdict.cause,
            blame=verdict.blame, latency_s=call.latency_s, ttft_s=call.ttft_s, input_tokens=input_tokens,
            output_tokens=output_tokens, cost_usd=cost, client_retry=call.client_retry,
            upstream_retries=call.upstream_retries, kind="request", success=None, reason=None,
        ))
        self._remember(call.request_id, (route, model, role, call.segment), sid)
        if call.span is not None:
            call.span.finish(response_model=(call.response or {}).get("model"), input_tokens=input_tokens,  # type: ignore[attr-defined]
                             output_tokens=output_tokens, finish_reasons=call.finish_reasons,
                             cause=verdict.cause, prompt=(call.request or {}).get("messages"),
                             completion=(call.response or {}).get("choices"))
        if (role == "stable" and verdict.ok and not call.no_shadow and call.request is not None
                and route in self.config.routes and self.sampler.wanted(route, call.request_id)):
            est = self.sampler.estimated_cost(route, input_tokens, output_tokens)
            if self.sampler.admit(route, est):
                self.bus.publish("traffic", self._traffic(call, input_tokens, output_tokens))

    def _traffic(self, call: Call, input_tokens: int, output_tokens: int) -> TrafficEvent:
        request = self._redacted(call.route, call.request or {})
        response = call.response
        if response is not None and self._redact.get(call.route):
            response = self._redacted(call.route, response)
        primary = PrimaryResult.model_construct(
            model=call.model_key, status=call.status, body=response, latency_s=call.latency_s,
            ttft_s=call.ttft_s, usage={"prompt_tokens": input_tokens, "completion_tokens": output_tokens},
            outcome="completed", cause=None,
        )
        return TrafficEvent.model_construct(
            request_id=call.request_id, ts=time.time(), route=call.route, segment=call.segment, request=request,
            primary=primary, config_version=self.config_version,
            traceparent=call.span.traceparent() if call.span is not None else call.traceparent,  # type: ignore[attr-defined]
        )

    # ---- feedback --------------------------------------------------------------------------
    def _remember(self, request_id: str, labels: tuple[str, str, str, str], sid: str | None) -> None:
        index = self._label_index.get(labels)
        if index is None:
            index = self._label_index[labels] = len(self._labels)
            self._labels.append(labels)
        if sid:
            signed = int(sid, 16) - 2**63
            self._served.put(request_id, index, 1, signed)
            self._served.put(("session", sid), index, 1, signed)
        else:
            self._served.put(request_id, index, 0, 0)

    def served(self, request_id: str | None, session_id: str | None) -> tuple[str, Served] | None:
        if request_id and (found := self._served.get(request_id)) is not None:
            return request_id, self._served_as(found)
        sid = session_hash(session_id)
        if sid and (found := self._served.get(("session", sid))) is not None:
            return "session:" + sid, self._served_as(found)
        return None

    def _served_as(self, found: tuple[int, ...]) -> Served:
        index, has_sid, signed = found
        return Served(*self._labels[index], format(signed + 2**63, "016x") if has_sid else None)

    def feedback(self, key: str, served: Served, success: bool, reason: str | None) -> None:
        metrics.feedback_total.labels(served.route, served.model, served.role, "success" if success else "failure").inc()
        self.bus.publish("outcomes", OutcomeEvent.model_construct(
            request_id=key.removeprefix("session:"), ts=time.time(), route=served.route, model=served.model,
            role=served.role, segment=served.segment, session_id_hash=served.session_id_hash, outcome=None,
            cause=None, blame=None, latency_s=None, ttft_s=None, input_tokens=0, output_tokens=0, cost_usd=0.0,
            client_retry=False, upstream_retries=0, kind="feedback", success=success, reason=reason,
        ))

    # ---- redaction -------------------------------------------------------------------------
    @staticmethod
    def _compile_redactions(config: Config) -> dict[str, list[re.Pattern]]:
        """`shadow.redact`: regexes, and `builtin:email` / `builtin:phone` for the built-in patterns."""
        return {route: [re.compile(p) for p in redaction_patterns(rc.shadow.redact)]
                for route, rc in config.routes.items()}

    def _redacted(self, route: str, obj: dict) -> dict:
        patterns = self._redact.get(route)
        if not patterns:
            return obj

        def scrub(value: object) -> object:
            if isinstance(value, str):
                for p in patterns:
                    value = p.sub("[REDACTED]", value)
                return value
            if isinstance(value, dict):
                return {k: scrub(v) for k, v in value.items()}
            if isinstance(value, list):
                return [scrub(v) for v in value]
            return value

        return scrub(obj)  # type: ignore[return-value]
