"""OpenTelemetry traces following the GenAI semantic conventions (DESIGN §7).

One CLIENT span `chat {gen_ai.request.model}` per proxied (or shadow) call,
child spans for upstream retries, a Link from a shadow call to the live call
it replays, and `gen_ai.evaluation.result` events for evaluator results.

Enabled when `tracing.otlp_endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set;
spans go out over OTLP/HTTP (protobuf) through a BatchSpanProcessor. When it is
off, `Tracing.enabled` is False and `start_call` returns None at once: no
OpenTelemetry SDK object is ever created.

Message content (prompt, completion, evaluator explanations) is recorded only
with `tracing.capture_content: true`. Headers are never recorded.
"""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from service.config import TracingConfig

_PROPAGATOR = TraceContextTextMapPropagator()
OPERATION = "chat"
EVALUATION_EVENT = "gen_ai.evaluation.result"
SHUTDOWN_TIMEOUT_S = 1.5  # how long stopping waits for the collector to take the spans left (docs/reliability.md)


def _traces_url(endpoint: str) -> str:
    """A base OTLP/HTTP endpoint (as in OTEL_EXPORTER_OTLP_ENDPOINT) → its traces URL: /v1/traces
    after its path (the config refuses a query, a fragment and credentials in it)."""
    parts = urlsplit(endpoint)
    path = parts.path.rstrip("/")
    return parts._replace(path=path if path.endswith("/v1/traces") else path + "/v1/traces").geturl()


def _context_from(traceparent: str | None, tracestate: str | None = None):
    """The remote parent context of a W3C traceparent, or None when absent or invalid."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def format_traceparent(span_context: trace.SpanContext) -> str:
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def _content(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return value.decode("utf-8", "replace")
    return json.dumps(value, ensure_ascii=False, default=str)


class Tracing:
    """The process's tracer. Build one at start; `shutdown()` flushes the spans left. A reload that
    replaces it calls `retire()` instead. Used from one thread (the event loop's)."""

    def __init__(self, cfg: TracingConfig, service_name: str = "modelcanary"):
        self.capture_content = bool(cfg.capture_content)  # a reload may change it: read as each span ends
        env_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT")
        self.enabled: bool = bool(cfg.otlp_endpoint or env_endpoint)
        self._provider: TracerProvider | None = None
        self._exporter: SpanExporter | None = None
        self._tracer: trace.Tracer | None = None
        self._open = 0  # spans started and not finished
        self._retired = False
        self._stopping = threading.Lock()
        if not self.enabled:
            return

        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # The config wins over the environment; the exporter itself reads the env otherwise
        # (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as is, OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces).
        exporter = OTLPSpanExporter(endpoint=_traces_url(cfg.otlp_endpoint)) if cfg.otlp_endpoint \
            else OTLPSpanExporter()
        # shut down by `shutdown()`, bounded; an atexit hook would also keep every retired provider alive
        self._provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}),
                                        shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._exporter = exporter
        from service import __version__ as version

        self._tracer = self._provider.get_tracer("modelcanary", version)

    def start_call(
        self,
        *,
        route: str,
        role: str,
        request_model: str,
        provider: str,
        traceparent: str | None,
        stream: bool,
        tracestate: str | None = None,
        link_traceparent: str | None = None,
        operation: str = OPERATION,
    ) -> CallSpan | None:
        """Start the span of one upstream call. `traceparent` and `tracestate` are the client's W3C
        headers (the span's parent, whose tracestate the span and the upstream request carry on); a
        shadow call passes the live call's traceparent as `link_traceparent`. `operation`: GenAI's
        operation name (`chat`; a passed-through call's, e.g. `embeddings`)."""
        if self._tracer is None:
            return None
        links = ()
        link_ctx = _context_from(link_traceparent)
        if link_ctx is not None:
            links = (Link(trace.get_current_span(link_ctx).get_span_context(),
                          {"modelcanary.link.type": "live_call"}),)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": request_model,
            "modelcanary.route": route,
            "modelcanary.role": role,
            "modelcanary.stream": stream,
        }
        span = self._tracer.start_span(
            f"{operation} {request_model}",
            context=_context_from(traceparent, tracestate),
            kind=SpanKind.CLIENT,
            attributes=attributes,
            links=links,
        )
        self._open += 1
        return CallSpan(self, span, request_model, provider, operation)

    def retire(self, wait: bool = True) -> None:
        """Replaced by a reload: stop once the spans started on this tracer have ended (`wait=False`:
        now), in a thread of its own (stopping may wait for the collector)."""
        self._retired = True
        if self._open == 0 or not wait:
            self._stop_in_background()

    def _ended(self) -> None:
        self._open -= 1
        if self._retired and self._open == 0:
            self._stop_in_background()

    def _stop_in_background(self) -> None:
        threading.Thread(target=self.shutdown, name="tracing-stop", daemon=True).start()

    def shutdown(self) -> None:
        """Export what is buffered and stop (idempotent), waiting at most SHUTDOWN_TIMEOUT_S: a
        collector that is down or slow does not hold up the exit; the spans it did not take are lost."""
        with self._stopping:
            provider, exporter = self._provider, self._exporter
            self._provider, self._exporter, self._tracer = None, None, None
        if provider is None or exporter is None:
            return
        flushing = threading.Thread(target=provider.shutdown, name="tracing-flush", daemon=True)
        flushing.start()
        flushing.join(SHUTDOWN_TIMEOUT_S)
        if flushing.is_alive():
            exporter.shutdown()  # ends the exporter's retries, and with them the flush


class CallSpan:
    """One proxied or shadow call. Not thread-safe; one owner (the request's task)."""

    __slots__ = ("_tracing", "_span", "_model", "_provider", "_operation", "_finished")

    def __init__(self, tracing: Tracing, span: trace.Span, request_model: str, provider: str, operation: str):
        self._tracing = tracing
        self._span = span
        self._model = request_model
        self._provider = provider
        self._operation = operation
        self._finished = False

    @property
    def span(self) -> trace.Span:
        return self._span

    def upstream_headers(self) -> dict[str, str]:
        """W3C `traceparent` (and `tracestate`) naming this span, for the upstream request."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self._span))
        return carrier

    def traceparent(self) -> str:
        """This span's context as a traceparent (kept in the TrafficEvent so shadow calls can link)."""
        return format_traceparent(self._span.get_span_context())

    def retry(self, attempt: int, cause: str, start_ns: int, end_ns: int) -> None:
        """A child span for one upstream attempt that failed with `cause` and was retried."""
        tracer = self._tracing._tracer
        if tracer is None:
            return
        child = tracer.start_span(
            "upstream retry",
            context=trace.set_span_in_context(self._span),
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": self._operation,
                "gen_ai.provider.name": self._provider,
                "gen_ai.request.model": self._model,
                "modelcanary.upstream.attempt": attempt,
                "error.type": cause,
            },
            start_time=start_ns,
        )
        child.set_status(Status(StatusCode.ERROR, cause))
        child.end(end_time=end_ns)

    def evaluation(self, name: str, score: float | None, passed: bool | None, detail: str | None = None) -> None:
        """A `gen_ai.evaluation.result` event. After `finish()` it goes on a short child span instead."""
        attributes: dict[str, Any] = {"gen_ai.evaluation.name": name}
        if score is not None:
            attributes["gen_ai.evaluation.score.value"] = float(score)
        if passed is not None:
            attributes["gen_ai.evaluation.score.label"] = "pass" if passed else "fail"
        elif score is None:
            attributes["gen_ai.evaluation.score.label"] = "error"
        if detail and self._tracing.capture_content:
            attributes["gen_ai.evaluation.explanation"] = detail
        if not self._finished:
            self._span.add_event(EVALUATION_EVENT, attributes)
            return
        tracer = self._tracing._tracer
        if tracer is None:
            return
        child = tracer.start_span(f"evaluation {name}", context=trace.set_span_in_context(self._span),
                                  kind=SpanKind.INTERNAL)
        child.add_event(EVALUATION_EVENT, attributes)
        child.end()

    def finish(
        self,
        *,
        response_model: str | None,
        input_tokens: int | None,
        output_tokens: int | None,
        finish_reasons: list[str],
        cause: str | None,
        prompt: object | None = None,
        completion: object | None = None,
    ) -> None:
        """Record the outcome and end the span (a second call does nothing).

        `cause` is the failure cause (DESIGN §6), None when the call completed. Tokens are None
        when unknown (a passed-through answer is not read): left out, as a zero reads as measured.
        `prompt`/`completion` are recorded only with `tracing.capture_content: true`.
        """
        if self._finished:
            return
        self._finished = True
        span = self._span
        if response_model:
            span.set_attribute("gen_ai.response.model", response_model)
        if input_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", int(input_tokens))
        if output_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", int(output_tokens))
        if finish_reasons:
            span.set_attribute("gen_ai.response.finish_reasons", [str(r) for r in finish_reasons])
        if cause:
            span.set_attribute("error.type", cause)
            span.set_status(Status(StatusCode.ERROR, cause))
        if self._tracing.capture_content:
            if prompt is not None:
                span.set_attribute("gen_ai.input.messages", _content(prompt))
            if completion is not None:
                span.set_attribute("gen_ai.output.messages", _content(completion))
        span.end()
        self._tracing._ended()
