"""The hot path: parse once, pick a model, forward bytes, classify, hand the rest to the Recorder."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING
from urllib.parse import quote

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from service import metrics
from service.config import Checks, Config, ModelConfig
from service.errors import ErrorResponse, openai_error
from service.proxy.native import OnLeave, on_leave_in_scope
from service.proxy.outcome import COMPLETED, Verdict, classify_chat, failed, upstream_refused
from service.proxy.owners import Owner
from service.proxy.recorder import Call, Recorder
from service.proxy.retries import RetryDetector, fingerprint
from service.proxy.routing import pick
from service.proxy.sampler import opted_out
from service.proxy.segments import classify_segment
from service.proxy.sse import chat_has_output, reassemble
from service.proxy.streaming import SSE_HEADERS, StreamRelay, client_gone
from service.records import PASSTHROUGH_SEGMENT, Role
from service.rollout.book import RolloutBook
from service.upstream.base import Provider, UpstreamReply
from service.upstream.errors import CLIENT_CAUSES, error_cause, error_fields, in_answer_cause, json_object, unexplained
from service.upstream.model_settings import model_body
from service.upstream.retry import RetryBudget, send_with_retries

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from service.tracing import Tracing

log = logging.getLogger("modelcanary.proxy")

DRAIN_LIMIT = 64 * 1024 * 1024


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self, shape: ErrorResponse = openai_error) -> Response:
        return shape(self.status, self.message, self.code, self.param)


class Proxy:
    def __init__(self, config: Config, book: RolloutBook, providers: dict[str, Provider],
                 recorder: Recorder, tracing: Tracing | None = None):
        self.book = book
        self.providers = providers
        self.recorder = recorder
        self.use_tracing(tracing)
        self.retries = RetryDetector()
        self.draining = False
        self.cutting = False  # the drain time is up: the streams left are being cut
        self.in_flight = 0
        self._in_flight_children = metrics.LabelCache(metrics.in_flight_requests)
        self.reload(config)

    def use_tracing(self, tracing: Tracing | None) -> None:
        """Spans only from a tracer that exports (None: no tracing work per request)."""
        self.tracing = tracing if tracing is not None and tracing.enabled else None

    def reload(self, config: Config) -> None:
        self.config = config
        self.budgets = {route: RetryBudget() for route in config.routes}
        self.budgets.update({model: RetryBudget() for model in config.models})
        self.client_keys = _client_keys(config)
        # the provider API each route and model speaks (a route's models share one)
        self.api_of = {key: config.providers[m.provider].api for key, m in config.models.items()}
        self.api_of.update({route: self.api_of[rc.stable] for route, rc in config.routes.items()})

    # ---- request parsing -------------------------------------------------------------------
    def body_limit(self) -> int:
        return self.config.server.max_body_bytes

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.server.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise BadRequest(400, f"header content-length is not a number: {declared[:40]!r}")
            if int(declared) > limit:
                if int(declared) <= DRAIN_LIMIT:  # read and drop it, so the client sees the 413, not a reset
                    async for _ in request.stream():
                        pass
                raise BadRequest(413, f"request body of {declared} bytes exceeds server.max_body_bytes ({limit})",
                                 code="request_too_large")
            return await request.body()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(413, f"request body exceeds server.max_body_bytes ({limit})", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def parse_json(raw: bytes) -> dict:
        if not raw:
            raise BadRequest(400, "request body is empty; send a JSON object")
        try:
            body = json.loads(raw)
        except UnicodeDecodeError:
            raise BadRequest(400, "request body is not valid UTF-8") from None
        except json.JSONDecodeError as e:
            raise BadRequest(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        except RecursionError:
            raise BadRequest(400, "request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest(400, f"request body must be a JSON object, got {type(body).__name__}")
        return body

    def resolve(self, model_name: object, headers: Mapping[str, str]) -> tuple[str, str | None]:
        """(route or model key, route when it is a route). Raises 401/403/404 as OpenAI does."""
        allowed = self.allowed_names(headers)
        if not isinstance(model_name, str) or not model_name:
            raise BadRequest(400, "field 'model' is required and must be a string naming a route", param="model")
        if model_name not in self.config.routes and model_name not in self.config.models:
            visible = sorted(r for r in self.config.routes if allowed is None or "*" in allowed or r in allowed)
            raise BadRequest(404, f"The model '{model_name[:100]}' does not exist; known routes: "
                             f"{', '.join(visible)}", param="model", code="model_not_found")
        if allowed is not None and "*" not in allowed and model_name not in allowed:
            raise BadRequest(403, f"this client key may not use model '{model_name}'", param="model",
                             code="model_not_allowed")
        return model_name, (model_name if model_name in self.config.routes else None)

    def refuse_other_api(self, name: str, api: str) -> None:
        """400 when route or model `name` is served by a provider of another API than `api`."""
        served = self.api_of[name]
        if served != api:
            raise BadRequest(400, f"model '{name}' is served by an api: {served} provider; send it to "
                             f"{ENDPOINT_OF_API[served]} (the proxy does not translate between formats)",
                             param="model")

    def allowed_names(self, headers: Mapping[str, str]) -> set[str] | None:
        """The routes this client may use (None: no client keys configured). 401 for an unknown key."""
        if self.client_keys is None:
            return None
        allowed = self.client_keys.get(_bearer(client_authorization(headers)) or "")
        if allowed is None:
            raise BadRequest(401, "missing or unknown client key in the Authorization header", code="invalid_api_key")
        return allowed

    def _client_auth(self, headers: Mapping[str, str]) -> str | None:
        """The client's Authorization, to pass through when the provider has no key of its own; never
        when client keys are on (then it is a key for this proxy, not for the provider)."""
        return client_authorization(headers) if self.client_keys is None else None

    # ---- chat completions ------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        """`POST /v1/chat/completions` through ASGI: the app's route, for requests the HTTP protocol does
        not answer itself (service/proxy/native.py)."""
        started = time.perf_counter()
        try:
            raw = await self.read_body(request)
        except BadRequest as e:
            return e.response()
        except ClientDisconnect:
            return Response(status_code=499)
        gone = partial(client_gone, request.receive)
        return await self.answer_chat(started, header_map(request.scope["headers"]), raw, gone,
                                      partial(on_leave_in_scope, request.scope))

    async def answer_chat(self, started: float, headers: dict[str, str], raw: bytes,  # noqa: C901 - the hot path stays one function (no call per step per request)
                          gone: Callable[[], bool], on_leave: OnLeave | None = None) -> Response:
        """A chat request whose body is in: `headers` with lower-case names, `gone()` whether the client
        has left, `on_leave` to be told when it does while the upstream is awaited."""
        request_id = os.urandom(12).hex()
        if self.draining:
            return openai_error(503, "the proxy is shutting down; retry on another replica", code="draining")
        try:
            body = self.parse_json(raw)
            name, route = self.resolve(body.get("model"), headers)
            self.refuse_other_api(name, "openai")
            if "messages" not in body or not isinstance(body["messages"], list):
                raise BadRequest(400, "field 'messages' is required and must be an array", param="messages")
            stream = body.get("stream", False)
            if not isinstance(stream, bool) and stream is not None:
                raise BadRequest(400, f"field 'stream' must be a boolean, got {json.dumps(stream)[:40]}", param="stream")
        except BadRequest as e:
            return e.response()
        session_key = headers.get("x-session-id") or (body.get("user") if isinstance(body.get("user"), str) else None)
        client = f"{headers.get('authorization', '')}|{session_key or ''}"
        if route is not None:
            rc = self.config.routes[route]
            segment = classify_segment(body, headers.get("x-task-type"), rc.task_types)
            model_key, role = pick(route, self.book.routing[route], session_key, segment, client, body["messages"])
        else:
            route, model_key, role = name, name, "stable"
            segment = classify_segment(body)
        call = Call(request_id=request_id, route=route, model_key=model_key, role=role, segment=segment,
                    started=started, request=body, session_key=session_key, stream=bool(stream),
                    no_shadow=opted_out(headers.get("x-modelcanary-no-shadow")),
                    traceparent=headers.get("traceparent"))
        call.client_retry = self.retries.is_retry(headers.get("x-stainless-retry-count"), fingerprint(client, raw))
        model = self.config.models[model_key]
        provider = self.providers[model.provider]
        call.asked = asked = model_body(body, model)
        try:
            out = upstream_body(asked)
        except BadRequest as e:
            return e.response()
        up_headers = self.upstream_headers(call, model, provider, headers)
        judge = partial(classify_chat, asked, checks=self._checks(call))

        self._start(call)
        sent = await self.forward(call, provider, "/chat/completions", out, up_headers,
                                  deadline_s=self.config.providers[model.provider].timeout_s, on_leave=on_leave)
        if isinstance(sent, Response):
            return sent
        if call.stream and sent.status == 200:
            return StreamRelay(call, sent, partial(self._classify_stream, call, judge),
                               partial(self._tally_stream, call), self._done, self.cutting_streams,
                               has_output=chat_has_output).response(self._headers(call, sent) | SSE_HEADERS)
        try:
            answer = self._plain(call, sent, judge)
        except Exception:
            answer = self.unjudged(call)
        return self.respond(gone, call, answer)

    # ---- pieces every proxied endpoint shares ------------------------------------------------
    def cutting_streams(self) -> bool:
        return self.cutting

    def _start(self, call: Call) -> None:
        """The call is in flight from here; `_done` ends it, exactly once."""
        self.in_flight += 1
        self._in_flight_gauge(call.route).inc()

    async def forward(self, call: Call, provider: Provider, path: str, data: bytes, headers: dict[str, str],
                      method: str = "POST", deadline_s: float | None = None, error: ErrorResponse = openai_error,
                      on_leave: OnLeave | None = None) -> UpstreamReply | Response:
        """Send a started call upstream with the retry rules. Returns the upstream's reply, or the error
        response to send, in the `error` shape (the call's end is then arranged). A client that leaves
        meanwhile (`on_leave`) ends the wait: the call is `client_cancelled` then, as the client saw it."""
        task = asyncio.current_task()
        left = False

        def client_left() -> None:
            nonlocal left
            left = True
            if task is not None:
                task.cancel()

        if on_leave is not None:
            on_leave(client_left)
        try:
            attempt = await send_with_retries(
                provider, path, data, headers, call.stream, self.budgets[call.route], method=method,
                on_retry=lambda cause, t0, t1: self._on_retry(call, cause, t0, t1), deadline_s=deadline_s)
        except asyncio.CancelledError:
            call.verdict = failed("client_cancelled")
            if not left:  # the server's own cancel (shutdown): it goes on up
                self._done(call)
                raise
            if task is not None:
                task.uncancel()
            call.status = 499  # nginx's "client closed request": no status reached the client
            self._done(call)
            return Response(status_code=499)
        except Exception:
            log.exception("proxy error on request %s", call.request_id)
            call.verdict = failed("proxy_error")
            call.status = 500
            self._done(call)
            return error(500, "internal proxy error", code="proxy_error", headers=self._headers(call))
        finally:
            if on_leave is not None:
                on_leave(None)
        call.upstream_retries = attempt.retries
        if attempt.failure is not None:
            call.verdict = failed(attempt.failure.cause, attempt.failure.detail)
            call.status = 504 if attempt.failure.cause == "timeout" else 502
            return self._after_send(call, error(call.status, f"upstream {attempt.failure.detail}",
                                                code=attempt.failure.cause, headers=self._headers(call)))
        assert attempt.reply is not None
        call.status = attempt.reply.status
        return attempt.reply

    def upstream_headers(self, call: Call, model: ModelConfig, provider: Provider, headers: Mapping[str, str],
                         forwarded: tuple[str, ...] = (), operation: str = "chat") -> dict[str, str]:
        """The upstream request's headers: the provider's key (else the client's), the `forwarded` client
        headers, and the trace context; starts the call's span (GenAI `operation`) when tracing is on."""
        up_headers = {"Content-Type": "application/json",
                      "Accept": "text/event-stream" if call.stream else "application/json"}
        up_headers.update((k, headers[k]) for k in forwarded if k in headers)
        client_auth = self._client_auth(headers)
        auth = provider.auth_header(client_auth)
        if auth:
            up_headers["Authorization"] = auth
            call.client_credential = auth == client_auth
        if self.tracing is not None:
            call.span = self.tracing.start_call(route=call.route, role=call.role, request_model=model.name,
                                                provider=model.provider, traceparent=call.traceparent,
                                                tracestate=headers.get("tracestate"), stream=call.stream,
                                                operation=operation)
            assert call.span is not None  # enabled tracing starts a span
            up_headers.update(call.span.upstream_headers())
        elif call.traceparent:  # W3C trace context passed on as it came, tracestate with its traceparent
            up_headers["traceparent"] = call.traceparent
            if "tracestate" in headers:
                up_headers["tracestate"] = headers["tracestate"]
        return up_headers

    def respond(self, gone: Callable[[], bool], call: Call, response: Response) -> Response:
        """A whole (not streamed) answer for a call whose verdict is set: a client that already hung up
        never receives it, so its call is `client_cancelled` whatever the upstream answered."""
        if gone():
            call.verdict = failed("client_cancelled")
            call.status = 499  # nginx's "client closed request": no status reached the client
        return self._after_send(call, response)

    def _plain(self, call: Call, reply: UpstreamReply, judge: Callable[[dict], Verdict]) -> Response:
        headers = self._headers(call, reply)
        if 200 <= reply.status < 300:
            try:
                data = json.loads(reply.body)
                if not isinstance(data, dict):
                    raise ValueError("not an object")
            except ValueError:
                call.verdict = failed("bad_response", "malformed JSON from upstream")
                call.status = 502
                return openai_error(502, "upstream returned a malformed response", code="bad_response", headers=headers)
            call.response = data
            call.verdict = judge(data)
            if call.verdict.cause == "bad_response":
                return self._not_a_completion(call, data, call.verdict.detail, headers)
            call.finish_reasons = [reason for c in data.get("choices", ()) if isinstance(c, dict)
                                   and (reason := c.get("finish_reason"))]
            return Response(reply.body, status_code=reply.status, media_type="application/json", headers=headers)
        return self._upstream_error(call, reply, headers)

    @staticmethod
    def _not_a_completion(call: Call, data: dict, detail: str | None, headers: dict[str, str]) -> Response:
        """A 502 for a 2xx that is no chat completion. An error object in it keeps its cause (as in a
        stream) and its message, and the refused call bills nothing."""
        call.status = 502
        error = data.get("error")
        if not isinstance(error, dict):
            return openai_error(502, f"upstream response is not a chat completion: {detail}", code="bad_response",
                                headers=headers)
        call.response = None
        call.verdict = failed(in_answer_cause(error.get("code")))
        message = error_fields(data)[1]
        return openai_error(502, "upstream answered HTTP 200 with an error" + (f": {message[:500]}" if message else ""),
                            code=call.verdict.cause, headers=headers)

    def _upstream_error(self, call: Call, reply: UpstreamReply, headers: dict[str, str]) -> Response:
        """The upstream's error with its status and cause: its JSON body as it came, any other body in an
        OpenAI-shaped error's message. A client's mistake that the upstream answered as its own failure
        (a 5xx) goes back as the 400 it is, so that clients do not retry it."""
        parsed = json_object(reply.body)
        call.verdict = upstream_refused(error_cause(reply.status, parsed), call.client_credential)
        if call.verdict.blame == "proxy":
            return self.refused_credentials(call, openai_error, headers)
        if reply.status >= 500 and call.verdict.cause in CLIENT_CAUSES:
            call.status = 400
            message = error_fields(parsed)[1].split("\n\n", 1)[0]
            return openai_error(400, f"upstream rejected the request: {message}", code=call.verdict.cause,
                                headers=headers)
        if parsed is not None:  # the upstream's own JSON error, whatever its shape
            return Response(reply.body, status_code=reply.status, headers=headers, media_type="application/json")
        return openai_error(reply.status, unexplained(reply.status, reply.body), code=call.verdict.cause, headers=headers)

    def refused_credentials(self, call: Call, error: ErrorResponse, headers: dict[str, str]) -> Response:
        """A 502, not the upstream's 401/403: the client's key is fine (SDKs would say it is not)."""
        call.status = 502
        provider = self.config.models[call.model_key].provider
        return error(502, f"the upstream refused the credentials modelcanary holds for provider '{provider}' "
                     f"(providers.{provider}.api_key_env)", code="auth_error", headers=headers)

    def _classify_stream(self, call: Call, judge: Callable[..., Verdict] | None, raw: bytes,
                         clipped: bool) -> Verdict:
        """The verdict on a captured stream; `judge` classifies the reassembled answer (None: a
        passed-through endpoint, judged by transport and status only)."""
        if judge is None:
            return COMPLETED
        result = reassemble(raw)
        response = result.response
        if result.problem is not None or response is None:
            return failed(result.cause, result.problem)
        call.response = response
        choices = response["choices"]  # reassembled: each with its finish_reason, None if it told none
        call.finish_reasons = [c["finish_reason"] for c in choices if c["finish_reason"]]
        if clipped:
            return COMPLETED
        if len(call.finish_reasons) < len(choices):  # e.g. a server that cut the answer short, with or without [DONE]
            return failed("bad_response", "stream ended without a finish_reason")
        return judge(response, chunks=raw.count(b'"delta"'))  # a JSON key: in a string it would be escaped

    @staticmethod
    def _tally_stream(call: Call, raw: bytes) -> Verdict | None:
        """A chat stream that stopped before its end: its answer as far as it went, so that its tokens
        count (estimated from the text: a stream tells its usage only at its end); and the failure its
        events hold, if any (an error event the client was sent before it left)."""
        result = reassemble(raw)
        if result.response is not None:
            call.response = result.response
        return failed(result.cause, result.problem) if result.broken else None

    def _checks(self, call: Call) -> Checks:
        rc = self.config.routes.get(call.route)
        return rc.checks if rc is not None else _DEFAULT_CHECKS

    def _on_retry(self, call: Call, cause: str, t0: int, t1: int) -> None:
        metrics.upstream_retries_total.labels(call.route, call.model_key, cause).inc()
        if call.span is not None:
            call.span.retry(call.upstream_retries + 1, cause, t0, t1)
        call.upstream_retries += 1

    def _headers(self, call: Call, reply: UpstreamReply | None = None) -> dict[str, str]:
        """The role headers, and the upstream answer's headers a client acts on (`passed_headers`)."""
        own = {"x-request-id": call.request_id, "x-modelcanary-route": call.route,
               "x-modelcanary-model": call.model_key, "x-modelcanary-role": call.role}
        return own if reply is None else passed_headers(reply.headers) | own

    def unjudged(self, call: Call, error: ErrorResponse = openai_error) -> Response:
        """An answer the proxy failed to classify (a bug of ours): the call ends `proxy_error`, recorded
        like any other, and the client gets the 500 that says so. Call it from an `except` block."""
        log.exception("proxy error while classifying the answer to request %s", call.request_id)
        call.verdict = failed("proxy_error", "the answer could not be classified")
        call.status = 500
        return error(500, "internal proxy error", code="proxy_error", headers=self._headers(call))

    def _after_send(self, call: Call, response: Response) -> Response:
        # Starlette awaits `background()` once the response is sent; a tiny awaitable callable is
        # cheaper than a BackgroundTask (which inspects its function on every request).
        response.background = _AfterSend(self._done, call)  # type: ignore[assignment]
        return response

    def _in_flight_gauge(self, route: str) -> Gauge:
        return self._in_flight_children.get(route)

    def _done(self, call: Call) -> None:
        self.in_flight -= 1
        self._in_flight_gauge(call.route).dec()
        call.latency_s = time.perf_counter() - call.started
        self.recorder.add(call)

    # ---- other OpenAI endpoints ------------------------------------------------------------
    async def passthrough(self, request: Request, path: str, owner: Owner | None = None) -> Response:
        """Any other `/v1/` endpoint, to the route's stable model; a stored response's own endpoints
        (`responses/{id}…`) to the model that stored it (`owner`), when known and on the route."""
        started = time.perf_counter()
        request_id = os.urandom(12).hex()
        if self.draining:
            return openai_error(503, "the proxy is shutting down; retry on another replica", code="draining")
        try:
            raw = await self.read_body(request) if request.method in ("POST", "PUT", "PATCH") else b""
            body = self.parse_json(raw) if raw and "json" in request.headers.get("content-type", "json") else None
            name = body.get("model") if body else request.query_params.get("model")
            key, route, model_key, role = self._passthrough_target(name, request.headers, owner)
            model = self.config.models[model_key]
            if body is not None:
                body["model"] = model.name
                raw = upstream_body(body)
        except BadRequest as e:
            return e.response()
        except ClientDisconnect:
            return Response(status_code=499)
        provider = self.providers[model.provider]
        call = Call(request_id=request_id, route=route or key, model_key=model_key, role=role, segment=PASSTHROUGH_SEGMENT,
                    started=started, request=None, stream=body is not None and body.get("stream") is True,
                    traceparent=request.headers.get("traceparent"))
        endpoint = path.split("/", 1)[0]
        up_headers = self.upstream_headers(call, model, provider, request.headers,
                                           operation=PASSTHROUGH_OPERATIONS.get(endpoint, endpoint))
        up_headers["Content-Type"] = request.headers.get("content-type", "application/json")  # a file upload's too
        qs = ("?" + request.url.query) if request.url.query else ""
        self._start(call)
        sent = await self.forward(call, provider, upstream_path(request, path) + qs, raw, up_headers,
                                  method=request.method, on_leave=partial(on_leave_in_scope, request.scope))
        if isinstance(sent, Response):
            return sent
        if call.stream and sent.status == 200:
            relay = StreamRelay(call, sent, partial(self._classify_stream, call, None), None, self._done,
                                self.cutting_streams)
            return relay.response(self._headers(call, sent) | SSE_HEADERS,
                                  media_type=sent.headers.get("content-type", "text/event-stream"))
        return self.respond(partial(client_gone, request.receive), call, self._passed_through(call, sent))

    def _passthrough_target(self, name: object, headers: Mapping[str, str],
                            owner: Owner | None) -> tuple[str, str | None, str, Role]:
        """(name's key, route, model key, role) of a passed-through call: the route's stable model, or
        the stored response's owner when it is one of the route's."""
        if name is None and owner is not None:
            name = owner.route
        if name is None:
            if len(self.config.routes) != 1:
                raise BadRequest(400, "name a route in 'model' so the proxy knows which provider to use",
                                 param="model")
            name = next(iter(self.config.routes))
        key, route = self.resolve(name, headers)
        if not route:
            return key, route, key, "stable"
        rc = self.config.routes[route]
        if owner is not None and owner.serves(route, rc) and owner.model in self.config.models:
            return key, route, owner.model, "stable" if owner.model == rc.stable else "canary"
        return key, route, rc.stable, "stable"

    def _passed_through(self, call: Call, reply: UpstreamReply) -> Response:
        """A passed-through endpoint's whole answer, judged by its status (an error's by its body too)."""
        headers = self._headers(call, reply)
        if not 200 <= reply.status < 300:
            return self._upstream_error(call, reply, headers)
        call.verdict = COMPLETED
        if "content-disposition" in reply.headers:  # a file download
            headers["content-disposition"] = reply.headers["content-disposition"]
        return Response(reply.body, status_code=reply.status, headers=headers,
                        media_type=reply.headers.get("content-type", "application/json"))


_DEFAULT_CHECKS = Checks()


class _AfterSend:
    """What Starlette awaits after sending a response: record the finished call."""

    __slots__ = ("done", "call")

    def __init__(self, done: Callable[[Call], None], call: Call):
        self.done = done
        self.call = call

    async def __call__(self) -> None:
        self.done(self.call)


# Upstream answer headers passed to the client: rate limits, retry hints (`x-should-retry` decides
# whether the openai SDKs retry) and the provider's own request id (as `x-upstream-request-id`: the
# proxy's `x-request-id` names its records). Not the rest: cookies, `alt-svc` and the like are the
# provider's host's, not the proxy's.
PASSED_HEADERS = frozenset({"retry-after", "retry-after-ms", "x-should-retry", "request-id", "openai-processing-ms",
                            "openai-organization", "openai-project", "openai-version"})
PASSED_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")


def passed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k in PASSED_HEADERS or k.startswith(PASSED_PREFIXES)}
    if "x-request-id" in headers:
        out["x-upstream-request-id"] = headers["x-request-id"]
    return out


def header_map(pairs: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """A request's headers (ASGI's list of lower-case names and values) as a plain dict, built in one
    pass: several lookups in Starlette's `Headers` each scan and decode the whole list. A repeated
    header gives its first value, as `Headers.get` does."""
    out: dict[str, str] = {}
    for name, value in pairs:
        key = name.decode("latin-1")
        if key not in out:
            out[key] = value.decode("latin-1")
    return out


def upstream_path(request: Request, path: str) -> str:
    """A passed-through request's path below /v1, as the client encoded it: `%2F`, `%3F` and `%20` stay
    escapes (decoding them would change the path, or break the request line); anything else a request
    line can't hold is escaped."""
    raw: bytes = request.scope.get("raw_path") or b""
    return quote(raw[3:] if raw.startswith(b"/v1/") else "/" + path, safe="/%:@!$&'()*+,;=-._~")


# GenAI's operation names for the endpoints passed through; other endpoints are named by their path
PASSTHROUGH_OPERATIONS = {"embeddings": "embeddings", "completions": "text_completion"}
ENDPOINT_OF_API = {"openai": "POST /v1/chat/completions or POST /v1/responses", "anthropic": "POST /v1/messages"}


def upstream_body(body: dict) -> bytes:
    """`body` as the upstream gets it: compact UTF-8 JSON. 400 for what parsed but JSON can't carry on:
    NaN or an infinity (Python's parser takes the literals, and numbers too large for a double), or a
    lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair: no character)."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:
        raise BadRequest(400, "request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without "
                              "its pair), which is no character") from None
    except ValueError:
        raise BadRequest(400, "request body holds NaN or Infinity (or a number too large for a double), "
                              "which JSON does not allow") from None


def client_authorization(headers: Mapping[str, str]) -> str | None:
    """The client's key as an Authorization value: its `Authorization`, else its `x-api-key` (how
    Anthropic's clients send it)."""
    auth = headers.get("authorization")
    if auth is None and (key := headers.get("x-api-key")):
        return "Bearer " + key
    return auth


def _bearer(value: str | None) -> str | None:
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return None


def _client_keys(config: Config) -> dict[str, set[str]] | None:
    """`server.client_keys_env` names a variable holding `key=route1,route2;key2=*`."""
    env = config.server.client_keys_env
    if not env:
        return None
    spec = os.environ.get(env, "")
    keys: dict[str, set[str]] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        key, _, routes = entry.partition("=")
        keys[key.strip()] = {r.strip() for r in routes.split(",") if r.strip()} or {"*"}
    return keys
