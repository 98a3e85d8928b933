"""The proxy service: wires config, bus, rollout book, providers and the HTTP routes.

Memory mode's shadow workers come in as a `ShadowRunner` from the composition root
(`modelcanary.compose`: they run in a child process, `collectors.embedded`), so that this package never
imports `collectors`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service import metrics
from service.admin.api import admin_router
from service.admin.traffic import RecentTraffic
from service.bus import EventBus, make_bus
from service.config import Config, ConfigError, ReloadRefused, TracingConfig, environment_problems, load_config
from service.errors import ErrorResponse, anthropic_error, openai_error
from service.feedback import unmatched_route
from service.proxy.chat import BadRequest, Proxy
from service.proxy.endpoint import FormatEndpoint
from service.proxy.fast_path import CHAT_PATH, ProxyApp
from service.proxy.formats import MESSAGES, RESPONSES
from service.proxy.owners import KAFKA_WAIT_S, ResponseOwners, follow_outcomes
from service.proxy.recorder import Recorder
from service.proxy.routing import judging
from service.proxy.sampler import ShadowSampler
from service.records import RolloutState
from service.rollout.book import RolloutBook
from service.rollout.controller import Controller
from service.rollout.follower import follow
from service.rollout.notify import Notifier, configured_url
from service.tracing import Tracing
from service.upstream import make_provider, make_providers

if TYPE_CHECKING:
    from service.bus.kafka import KafkaBus

log = logging.getLogger("modelcanary")

# (config, bus, stop, reloads) -> runs shadow workers until stop is set; each config put on
# `reloads` replaces the workers' config
ShadowRunner = Callable[[Config, EventBus, asyncio.Event, "asyncio.Queue[Config]"], Coroutine[Any, Any, None]]

CHAT_REQUEST_SCHEMA = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "description": "a route name from the config (or a model key)"},
        "messages": {"type": "array", "items": {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "array"}, {"type": "null"}]}}}},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"anyOf": [{"type": "string"}, {"type": "object"}]},
        "response_format": {"type": "object"},
        "user": {"type": "string"},
        "temperature": {"type": "number"},
        "max_tokens": {"type": "integer"},
    },
}
RESPONSES_REQUEST_SCHEMA = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": {"type": "string", "description": "a route name from the config (or a model key)"},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": "string"},
        "previous_response_id": {"type": "string", "description": "goes to the model that stored that response"},
        "stream": {"type": "boolean"},
        "tools": {"type": "array", "items": {"type": "object"}},
        "text": {"type": "object"},
        "store": {"type": "boolean"},
        "max_output_tokens": {"type": "integer"},
    },
}
MESSAGES_REQUEST_SCHEMA = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        "model": {"type": "string", "description": "a route name from the config (or a model key)"},
        "messages": {"type": "array", "items": {"type": "object", "required": ["role"]}},
        "system": {"anyOf": [{"type": "string"}, {"type": "array"}]},
        "max_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
        "tools": {"type": "array", "items": {"type": "object"}},
    },
}
ERROR_RESPONSE = {"description": "OpenAI-shaped error", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["message", "type"]}}}}}}

MAX_FEEDBACK_ID = 256  # characters of a feedback's request_id or session_id
OWNERS_TAIL = 20_000   # outcomes a starting replica reads back to learn recent response owners (seconds of work)


class Runtime:
    """Everything one proxy process runs."""

    def __init__(self, config: Config, config_path: str | None, shadow_workers: ShadowRunner | None = None,
                 workers: int = 1):
        self.config = config
        self.shadow_workers = shadow_workers
        self.config_path = config_path
        self.workers = workers  # `serve --workers N`: this process is one of N
        self.bus: EventBus = make_bus(config.events)
        kafka = config.events.backend == "kafka"
        persist = None if kafka else Path(config.state_dir) / "rollouts.json"
        self.book = RolloutBook(config, persist_path=persist, publish=self._publish_rollout)
        self.providers = make_providers(config)
        self.tracing = Tracing(config.tracing)
        self._retired_tracing: Tracing | None = None  # the last one a reload replaced, stopping once its spans end
        self.sampler = ShadowSampler(config)
        self.recorder = Recorder(config, self.bus, self.sampler,
                                 lambda route, segment: judging(self.book.states.get(route), segment))
        self.proxy = Proxy(config, self.book, self.providers, self.recorder, self.tracing)
        self.owners = ResponseOwners()
        # memory mode: the recent sampled traffic, for `modelcanary capture` (GET /admin/traffic)
        self.recent_traffic = RecentTraffic() if not kafka else None
        wait_s = KAFKA_WAIT_S if config.events.backend == "kafka" else 0.0  # another replica may have served it
        self.responses = FormatEndpoint(self.proxy, RESPONSES, self.owners, wait_s)
        self.messages = FormatEndpoint(self.proxy, MESSAGES, self.owners)
        self.stop = asyncio.Event()
        # Kafka mode: set once the rollout states on the topic are adopted (routing and operator actions
        # wait for it); memory mode has no other states than its own
        self.caught_up = asyncio.Event()
        if not kafka:
            self.caught_up.set()
        self.tasks: list[asyncio.Task] = []
        self._shadow: asyncio.Task | None = None
        self._shadow_reloads: asyncio.Queue[Config] = asyncio.Queue()
        self._owners_task: asyncio.Task | None = None
        # memory mode: the embedded controller's; Kafka mode: for the operator actions this replica takes
        # (the leader, if any, notifies its own decisions)
        self.notifier = Notifier(configured_url(config.notify))
        self.controller: Controller | None = None  # memory mode: the embedded one, from `start`

    def _publish_rollout(self, state: RolloutState) -> None:
        self.bus.publish("rollouts", state)

    async def start(self) -> None:
        await self.bus.start()
        if self.config.events.backend == "kafka":
            bus = cast("KafkaBus", self.bus)  # the kafka backend's bus (make_bus)
            self.tasks.append(asyncio.create_task(follow(bus, self.book, self.stop, self.caught_up), name="rollouts"))
            self._follow_owners()
        else:
            controller = self.controller = Controller(self.config, self.bus, self.book, self.notifier)
            if self.recent_traffic is not None:
                self.tasks.append(asyncio.create_task(self.recent_traffic.run(self.bus, self.stop),
                                                      name="recent-traffic"))
            self.tasks.append(asyncio.create_task(controller.run(self.stop), name="controller"))
            if self.shadow_workers is not None:  # in-process until `stop`; a reload hands them the new config
                self._shadow = asyncio.create_task(
                    self.shadow_workers(self.config, self.bus, self.stop, self._shadow_reloads), name="shadow-workers")
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # main thread only
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload_on_sighup)

    def _follow_owners(self) -> None:
        """Kafka mode: learn which model stored each response any replica served, and how long its
        conversation was, once a route serves the Responses API: a follow-up may reach any replica, and
        falls in its conversation's segment whether or not the route has a candidate (and a reload that
        adds one finds the conversations begun before). From start, or the reload that adds the first
        such route; it starts from the outcomes topic's last OWNERS_TAIL records."""
        if self.config.events.backend != "kafka" or self._owners_task is not None:
            return
        if any(self.config.providers[self.config.models[rc.stable].provider].api == "openai"
               for rc in self.config.routes.values()):
            outcomes = cast("KafkaBus", self.bus).tail(["outcomes"], OWNERS_TAIL)
            self._owners_task = asyncio.create_task(follow_outcomes(outcomes, self.owners, self.stop),
                                                    name="response-owners")
            self.tasks.append(self._owners_task)

    def _reload_on_sighup(self) -> None:
        try:
            self.reload()
        except ConfigError as e:
            log.error("SIGHUP: config not reloaded: %s", "; ".join(e.problems))
        except ReloadRefused as e:
            log.error("SIGHUP: %s", e)

    async def close(self) -> None:
        self.stop.set()
        if self._shadow is not None:
            self.tasks.append(self._shadow)
        for task in self.tasks:
            try:
                await asyncio.wait_for(task, 5)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception:
                log.exception("background task %s failed", task.get_name())
        await self.notifier.drain()
        await self.bus.close()
        for provider in self.providers.values():
            await provider.close()
        for tracing in (self._retired_tracing, self.tracing):
            if tracing is not None:
                tracing.shutdown()

    def reload(self) -> list[str]:
        """Apply the config file again, or raise ConfigError and keep the running config: also for what
        `serve` would refuse at start (environment_problems)."""
        if not self.config_path:
            raise ReloadRefused("no_config_file", "the proxy was started without a config file; nothing to reload")
        if self.workers > 1:
            raise ReloadRefused("several_workers", f"this proxy runs {self.workers} worker processes (serve --workers "
                                f"{self.workers}): a reload here would reach only the one that answered; send "
                                "SIGHUP to the `modelcanary serve` process, which restarts every worker with the file")
        config = load_config(self.config_path)
        problems = environment_problems(config, proxy=True) + start_only_changes(self.config, config)
        if problems:
            raise ConfigError(self.config_path, problems)
        if config.tracing != self.config.tracing:
            self._reload_tracing(config.tracing)
        for name, cfg in config.providers.items():
            if name not in self.config.providers or cfg != self.config.providers[name]:
                old = self.providers.get(name)
                self.providers[name] = make_provider(name, cfg)
                if old is not None:  # the calls under way finish on it
                    old.retire()
        self.config = config
        self.notifier.url = configured_url(config.notify)
        self.sampler.reload(config)
        self.recorder.reload(config)
        self.proxy.reload(config)
        restarted = self.book.reload(config)
        self._follow_owners()
        if self._shadow is not None:
            self._shadow_reloads.put_nowait(config)
        log.info("config reloaded from %s; new rollouts: %s", self.config_path, restarted or "none")
        return restarted

    def _reload_tracing(self, cfg: TracingConfig) -> None:
        """The same collector keeps its exporter (only what spans record changes); another gets a new
        tracer, and the old one stops once the calls holding its spans have ended. At most one waits:
        one still waiting from an earlier reload (a call that outlived two reloads) stops now."""
        if cfg.otlp_endpoint == self.config.tracing.otlp_endpoint:
            self.tracing.capture_content = cfg.capture_content
            return
        if self._retired_tracing is not None:
            self._retired_tracing.retire(wait=False)
        self._retired_tracing, self.tracing = self.tracing, Tracing(cfg)
        self._retired_tracing.retire()
        self.proxy.use_tracing(self.tracing)


def start_only_changes(running: Config, new: Config) -> list[str]:
    """What a reload can't apply: the settings the proxy reads once, at start (the state file, the
    listening socket, the event bus with its broker and spool)."""
    restart = "changes only with a restart (a reload keeps the running value)"
    changed = [("state_dir", running.state_dir != new.state_dir),
               ("server.host", running.server.host != new.server.host),
               ("server.port", running.server.port != new.server.port),
               ("events", running.events != new.events)]
    return [f"{key}: {restart}" for key, differs in changed if differs]


def create_app(config: Config, config_path: str | None = None,  # noqa: C901 - counts its nested route handlers together; each is a few lines
               shadow_workers: ShadowRunner | None = None, workers: int = 1) -> FastAPI:
    runtime = Runtime(config, config_path, shadow_workers, workers)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.close()

    app = ProxyApp(title="modelcanary", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    proxy = runtime.proxy
    app.fast_chat = proxy.chat
    app.chat_answerer = proxy

    @app.post(CHAT_PATH, openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": CHAT_REQUEST_SCHEMA}}}},
        responses={200: {"description": "chat completion (JSON, or SSE when stream=true)"},
                   400: ERROR_RESPONSE, 404: ERROR_RESPONSE, 413: ERROR_RESPONSE, 502: ERROR_RESPONSE})
    async def chat_completions(request: Request) -> Response:
        return await proxy.chat(request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        anthropic = _anthropic_client(request)
        try:
            allowed = proxy.allowed_names(request.headers)
        except BadRequest as e:
            return e.response(anthropic_error if anthropic else openai_error)
        names = [name for name in runtime.config.routes if _may_use(allowed, name)]
        data = [_model_entry(name, anthropic) for name in names]
        if anthropic:
            return JSONResponse({"data": data, "has_more": False, "first_id": names[0] if names else None,
                                 "last_id": names[-1] if names else None})
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> Response:
        anthropic = _anthropic_client(request)
        shape: ErrorResponse = anthropic_error if anthropic else openai_error
        try:
            allowed = proxy.allowed_names(request.headers)
        except BadRequest as e:
            return e.response(shape)
        known = model_id in runtime.config.routes or model_id in runtime.config.models
        if known and _may_use(allowed, model_id):  # another key's model is as unknown as no model
            return JSONResponse(_model_entry(model_id, anthropic))
        return shape(404, f"The model '{model_id[:100]}' does not exist", code="model_not_found", param="model")

    @app.post("/v1/responses", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": RESPONSES_REQUEST_SCHEMA}}}},
        responses={200: {"description": "a response (JSON, or SSE when stream=true)"}, 400: ERROR_RESPONSE,
                   404: ERROR_RESPONSE, 409: ERROR_RESPONSE, 413: ERROR_RESPONSE, 502: ERROR_RESPONSE})
    async def responses(request: Request) -> Response:
        return await runtime.responses(request)

    @app.post("/v1/messages", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": MESSAGES_REQUEST_SCHEMA}}}},
        responses={200: {"description": "an Anthropic message (JSON, or SSE when stream=true)"},
                   400: ERROR_RESPONSE, 404: ERROR_RESPONSE, 413: ERROR_RESPONSE, 502: ERROR_RESPONSE})
    async def messages(request: Request) -> Response:
        return await runtime.messages(request)

    @app.post("/v1/feedback", openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "required": ["success"], "properties": {
            "request_id": {"type": "string"}, "session_id": {"type": "string"},
            "success": {"type": "boolean"}, "reason": {"type": "string"}}}}}}},
        responses={400: ERROR_RESPONSE, 404: ERROR_RESPONSE})
    async def feedback(request: Request) -> Response:
        return await _feedback(runtime, request)

    @app.api_route("/healthz", methods=["GET", "HEAD"])  # HEAD: what some load balancers probe with
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.api_route("/readyz", methods=["GET", "HEAD"])
    async def readyz() -> JSONResponse:
        if proxy.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not runtime.caught_up.is_set():
            return JSONResponse({"status": "catching_up"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    app.include_router(admin_router(runtime))

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def passthrough(request: Request, path: str) -> Response:
        if path == "feedback":  # the proxy's own endpoint, never an upstream's: POST only
            return openai_error(405, "Method Not Allowed", headers={"Allow": "POST"})
        if path.startswith("responses/"):  # a stored response's own endpoints: to the model that stored it
            return await proxy.passthrough(request, path, await runtime.responses.owner(path.split("/", 2)[1]))
        return await proxy.passthrough(request, path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return openai_error(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None,
                            headers=dict(exc.headers) if exc.headers else None)  # a 405's Allow

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return openai_error(400, f"{where}: {first.get('msg', 'invalid request')}", param=where or None)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s: %s", request.method, request.url.path, type(exc).__name__, exc_info=exc)
        return openai_error(500, "internal proxy error", code="proxy_error")

    return app


def _anthropic_client(request: Request) -> bool:
    """Whether an Anthropic SDK asks (it always sends `anthropic-version`): answered in its shapes."""
    return "anthropic-version" in request.headers


def _may_use(allowed: set[str] | None, name: str) -> bool:
    """Whether a client whose key allows `allowed` (None: no client keys) may use route or model `name`."""
    return allowed is None or "*" in allowed or name in allowed


def _model_entry(name: str, anthropic: bool) -> dict:
    """A route or model key as the models endpoints list it: OpenAI's `Model` or Anthropic's `ModelInfo`."""
    if anthropic:
        return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
    return {"id": name, "object": "model", "created": 0, "owned_by": "modelcanary"}


async def _feedback(runtime: Runtime, request: Request) -> Response:  # noqa: C901 - validates each field in turn, one clear error each
    """Memory mode: resolved here, 404 for an id this process has not served. Kafka mode: any replica
    accepts it (202) and publishes it; the one that served the request resolves it at once, else the
    controller resolves it against the request's outcome (and applies the client key's routes)."""
    from service.proxy.chat import BadRequest, _bearer, client_authorization

    keys = runtime.proxy.client_keys
    allowed: set[str] | None = None
    try:
        if keys is not None:  # client keys on: feedback needs one too, for a route it may use
            allowed = keys.get(_bearer(client_authorization(request.headers)) or "")
            if allowed is None:
                raise BadRequest(401, "missing or unknown client key in the Authorization header",
                                 code="invalid_api_key")
        body = runtime.proxy.parse_json(await runtime.proxy.read_body(request))
        success = body.get("success")
        if not isinstance(success, bool):
            raise BadRequest(400, "field 'success' is required and must be a boolean", param="success")
        request_id, session_id = body.get("request_id"), body.get("session_id")
        if not isinstance(request_id, str) and not isinstance(session_id, str):
            raise BadRequest(400, "give 'request_id' (the x-request-id response header) or 'session_id' as a string",
                             param="request_id")
        request_id = request_id if isinstance(request_id, str) else None
        session_id = session_id if isinstance(session_id, str) else None
        for field, value in (("request_id", request_id), ("session_id", session_id)):
            if value is not None and not 0 < len(value) <= MAX_FEEDBACK_ID:
                raise BadRequest(400, f"field {field!r} must be 1 to {MAX_FEEDBACK_ID} characters", param=field)
        reason = body.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise BadRequest(400, "field 'reason' must be a string", param="reason")
        if reason is not None and not reason.isascii():
            try:
                reason.encode()
            except UnicodeEncodeError:
                raise BadRequest(400, "field 'reason' holds a lone UTF-16 surrogate, which is no character",
                                 param="reason") from None
        reason = (reason or "")[:500] or None
        match = {"request_id": request_id} if request_id is not None else {"session_id": session_id}
        found = runtime.recorder.served(request_id, session_id)
        kafka = runtime.config.events.backend == "kafka"
        if found is None and not kafka:  # counted where Kafka mode's controller counts what never matched
            label = unmatched_route(allowed)
            metrics.feedback_unmatched_total.labels(label).inc()
            if runtime.controller is not None:
                runtime.controller.feedback.unmatched[label] += 1  # the report's feedback section
            raise BadRequest(404, "no recent request with that request_id or session_id on this proxy",
                             param="request_id", code="request_not_found")
        if found is not None and allowed is not None and "*" not in allowed and found[1].route not in allowed:
            raise BadRequest(403, "this client key may not give feedback on that request", code="model_not_allowed")
    except BadRequest as e:
        return e.response()
    if found is None:
        routes = None if allowed is None or "*" in allowed else sorted(allowed)
        runtime.recorder.unresolved_feedback(request_id, None if request_id else session_id, success, reason, routes)
        return JSONResponse({"accepted": True, "match": match}, status_code=202)
    key, served = found
    runtime.recorder.feedback(key, served, success, reason)
    return JSONResponse({"accepted": True, "match": match, "status": "recorded", "route": served.route,
                         "role": served.role}, status_code=202)


def _version() -> str:
    from service import __version__

    return __version__


