"""Tracing: spans reach a real OTLP/HTTP receiver with the GenAI attributes (DESIGN §7).

The receiver is an in-process HTTP server on loopback that decodes the
opentelemetry-proto ExportTraceServiceRequest messages the SDK's exporter posts.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from service.config import TracingConfig
from service.tracing import Tracing

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
SECRET_KEY = "sk-planted-secret-0123456789abcdef"
PROMPT_TEXT = "my confidential prompt about invoice 4242"
ANSWER_TEXT = "the confidential answer 9191"


class Receiver:
    """Collects every ExportTraceServiceRequest posted to /v1/traces."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.raw: list[bytes] = []
        self.paths: list[str] = []
        self.content_types: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                with receiver._lock:
                    receiver.paths.append(self.path)
                    receiver.content_types.append(self.headers.get("Content-Type", ""))
                    receiver.raw.append(body)
                    receiver.requests.append(message)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[Span]:
        with self._lock:
            return [span for req in self.requests for rs in req.resource_spans
                    for ss in rs.scope_spans for span in ss.spans]

    def resources(self) -> list[dict]:
        with self._lock:
            return [attrs(rs.resource) for req in self.requests for rs in req.resource_spans]

    def wait_spans(self, n: int, timeout: float = 10.0) -> list[Span]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.spans()
            if len(spans) >= n:
                return spans
            time.sleep(0.05)
        return self.spans()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def attrs(obj) -> dict:
    return {kv.key: value(kv.value) for kv in obj.attributes}


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)


def drive_live_and_shadow(tracing: Tracing) -> tuple[str, dict[str, str]]:
    """A live call (two retries, then success) and a shadow call linked to it; returns the
    live traceparent and the live call's upstream headers."""
    live = tracing.start_call(route="support-bot", role="stable", request_model="good-model", provider="sim",
                              traceparent=CLIENT_TRACEPARENT, stream=False)
    assert live is not None
    headers = live.upstream_headers()
    t0 = time.time_ns()
    live.retry(1, "rate_limited", t0, t0 + 1_000_000)
    live.retry(2, "provider_5xx", t0 + 2_000_000, t0 + 3_000_000)
    prompt = [{"role": "system", "content": f"api key {SECRET_KEY}"}, {"role": "user", "content": PROMPT_TEXT}]
    completion = [{"role": "assistant", "content": ANSWER_TEXT}]
    live.finish(response_model="good-model-2024", input_tokens=12, output_tokens=34, finish_reasons=["stop"],
                cause=None, prompt=prompt, completion=completion)
    live_tp = live.traceparent()

    shadow = tracing.start_call(route="support-bot", role="shadow", request_model="new-model", provider="sim",
                                traceparent=None, stream=True, link_traceparent=live_tp)
    assert shadow is not None
    shadow.evaluation("json_valid", 1.0, True)
    shadow.evaluation("agreement", 0.25, False, detail=f"differs from: {ANSWER_TEXT}")
    shadow.finish(response_model="new-model", input_tokens=12, output_tokens=0, finish_reasons=["content_filter"],
                  cause="content_filtered", prompt=prompt, completion=None)
    shadow.evaluation("late_judge", None, None)   # after finish: a child span carries the event
    return live_tp, headers


def by_name(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_disabled_without_endpoint_costs_nothing():
    tracing = Tracing(TracingConfig())
    assert tracing.enabled is False
    assert tracing.start_call(route="r", role="stable", request_model="m", provider="p",
                              traceparent=CLIENT_TRACEPARENT, stream=False) is None
    assert tracing._provider is None
    tracing.shutdown()


def test_enabled_by_env_endpoint(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    tracing = Tracing(TracingConfig(), service_name="modelcanary-env")
    assert tracing.enabled
    call = tracing.start_call(route="r", role="stable", request_model="m", provider="p", traceparent=None,
                              stream=False)
    call.finish(response_model="m", input_tokens=1, output_tokens=1, finish_reasons=["stop"], cause=None)
    tracing.shutdown()
    spans = receiver.wait_spans(1)
    assert [s.name for s in spans] == ["chat m"]
    assert receiver.paths == ["/v1/traces"]
    assert receiver.resources()[0]["service.name"] == "modelcanary-env"


def test_genai_spans_parent_retries_links_and_evaluations(receiver):
    tracing = Tracing(TracingConfig(otlp_endpoint=receiver.url))
    assert tracing.enabled
    live_tp, headers = drive_live_and_shadow(tracing)
    tracing.shutdown()

    spans = receiver.wait_spans(5)
    assert all(p == "/v1/traces" for p in receiver.paths)
    assert all(ct == "application/x-protobuf" for ct in receiver.content_types)
    assert receiver.resources()[0]["service.name"] == "modelcanary"
    names = by_name(spans)
    assert sorted(names) == ["chat good-model", "chat new-model", "evaluation late_judge", "upstream retry"]

    # The live call: child of the client's traceparent, CLIENT kind, every GenAI attribute.
    (live,) = names["chat good-model"]
    assert live.trace_id.hex() == CLIENT_TRACE_ID
    assert live.parent_span_id.hex() == CLIENT_SPAN_ID
    assert live.kind == Span.SPAN_KIND_CLIENT
    a = attrs(live)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "sim"
    assert a["gen_ai.request.model"] == "good-model"
    assert a["gen_ai.response.model"] == "good-model-2024"
    assert a["gen_ai.usage.input_tokens"] == 12
    assert a["gen_ai.usage.output_tokens"] == 34
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["modelcanary.route"] == "support-bot"
    assert a["modelcanary.role"] == "stable"
    assert "error.type" not in a
    assert live.status.code != Status.STATUS_CODE_ERROR

    # traceparent() names the live span; upstream headers carry it (W3C), sampled.
    assert live_tp == f"00-{CLIENT_TRACE_ID}-{live.span_id.hex()}-01"
    assert headers["traceparent"] == live_tp

    # Upstream retries: child spans of the live span, each an error with its cause.
    retries = sorted(names["upstream retry"], key=lambda s: attrs(s)["modelcanary.upstream.attempt"])
    assert [attrs(r)["error.type"] for r in retries] == ["rate_limited", "provider_5xx"]
    for r in retries:
        assert r.trace_id == live.trace_id
        assert r.parent_span_id == live.span_id
        assert r.status.code == Status.STATUS_CODE_ERROR
        assert r.end_time_unix_nano - r.start_time_unix_nano == 1_000_000

    # The shadow call: its own trace, linked to the live span; failure → error.type + ERROR status.
    (shadow,) = names["chat new-model"]
    assert shadow.trace_id != live.trace_id
    assert not shadow.parent_span_id
    assert [(lk.trace_id, lk.span_id) for lk in shadow.links] == [(live.trace_id, live.span_id)]
    s = attrs(shadow)
    assert s["modelcanary.role"] == "shadow"
    assert s["error.type"] == "content_filtered"
    assert s["gen_ai.response.finish_reasons"] == ["content_filter"]
    assert shadow.status.code == Status.STATUS_CODE_ERROR

    # Evaluations: gen_ai.evaluation.result events on the shadow span (and on a child after finish).
    events = [(e.name, attrs(e)) for e in shadow.events]
    assert events == [
        ("gen_ai.evaluation.result", {"gen_ai.evaluation.name": "json_valid", "gen_ai.evaluation.score.value": 1.0,
                                      "gen_ai.evaluation.score.label": "pass"}),
        ("gen_ai.evaluation.result", {"gen_ai.evaluation.name": "agreement", "gen_ai.evaluation.score.value": 0.25,
                                      "gen_ai.evaluation.score.label": "fail"}),
    ]
    (late,) = names["evaluation late_judge"]
    assert late.parent_span_id == shadow.span_id
    assert [(e.name, attrs(e)) for e in late.events] == [
        ("gen_ai.evaluation.result", {"gen_ai.evaluation.name": "late_judge",
                                      "gen_ai.evaluation.score.label": "error"})]

    # No content unless opted in: the planted key, prompt and answer appear nowhere on the wire.
    wire = b"".join(receiver.raw)
    for secret in (SECRET_KEY, PROMPT_TEXT, ANSWER_TEXT):
        assert secret.encode() not in wire
    assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a


def test_content_recorded_only_when_opted_in(receiver):
    tracing = Tracing(TracingConfig(otlp_endpoint=receiver.url + "/v1/traces", capture_content=True))
    drive_live_and_shadow(tracing)
    tracing.shutdown()
    spans = by_name(receiver.wait_spans(5))
    live = attrs(spans["chat good-model"][0])
    assert PROMPT_TEXT in live["gen_ai.input.messages"]
    assert ANSWER_TEXT in live["gen_ai.output.messages"]
    shadow = spans["chat new-model"][0]
    assert "gen_ai.output.messages" not in attrs(shadow)
    assert ANSWER_TEXT in attrs(shadow.events[1])["gen_ai.evaluation.explanation"]
    assert all(p == "/v1/traces" for p in receiver.paths)


def test_unsampled_or_invalid_client_traceparent(receiver):
    tracing = Tracing(TracingConfig(otlp_endpoint=receiver.url))
    # An unsampled parent: the decision is honoured, but the context still propagates.
    unsampled = tracing.start_call(route="r", role="stable", request_model="m", provider="p",
                                   traceparent=f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00", stream=False)
    assert unsampled.upstream_headers()["traceparent"].startswith(f"00-{CLIENT_TRACE_ID}-")
    assert unsampled.traceparent().endswith("-00")
    unsampled.finish(response_model=None, input_tokens=0, output_tokens=0, finish_reasons=[], cause="timeout")
    # A malformed header starts a new trace instead of failing.
    fresh = tracing.start_call(route="r", role="stable", request_model="m2", provider="p",
                               traceparent="not-a-traceparent", stream=False)
    fresh.finish(response_model=None, input_tokens=0, output_tokens=0, finish_reasons=[], cause=None)
    fresh.finish(response_model=None, input_tokens=0, output_tokens=0, finish_reasons=[], cause="timeout")  # no-op
    tracing.shutdown()
    spans = receiver.wait_spans(1)
    assert [s.name for s in spans] == ["chat m2"]
    assert spans[0].trace_id.hex() != CLIENT_TRACE_ID
    assert not spans[0].parent_span_id
    assert "error.type" not in attrs(spans[0])
