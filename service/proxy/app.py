"""The proxy service: wires config, bus, rollout book, providers and the HTTP routes.

In-process shadow workers (memory mode) come in as a `ShadowRunner` from the composition root
(`service.embedded`), so that this package never imports `collectors`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service import metrics
from service.admin.api import admin_router
from service.bus import EventBus, make_bus
from service.config import Config, ConfigError, load_config
from service.errors import openai_error
from service.proxy.chat import BadRequest, Proxy
from service.proxy.recorder import Recorder
from service.proxy.sampler import ShadowSampler
from service.records import RolloutState
from service.rollout.book import RolloutBook
from service.rollout.controller import Controller
from service.rollout.follower import follow_rollouts
from service.tracing import Tracing
from service.upstream import Provider, make_providers

log = logging.getLogger("modelcanary")

# (config, bus, providers, tracing, stop) -> runs shadow workers until stop is set
ShadowRunner = Callable[[Config, EventBus, dict[str, Provider], Tracing, asyncio.Event], Awaitable[None]]

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
ERROR_RESPONSE = {"description": "OpenAI-shaped error", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["message", "type"]}}}}}}


CHAT_PATH = "/v1/chat/completions"


class ProxyApp(FastAPI):
    """FastAPI with one shortcut: `POST /v1/chat/completions` goes straight to the proxy's handler.

    The route is still declared (for the OpenAPI schema, and for every other method), but the hot
    path skips the generic middleware stack and FastAPI's per-request dependency solving, ~8% of a
    busy proxy's CPU. The handler answers its own errors in OpenAI's shape; anything unexpected gets
    the catch-all handler's 500. The shortcut steps aside whenever it would change behaviour: when
    user middleware is added or FastAPI's own OpenTelemetry instrumentation is active.
    """

    fast_chat = None  # async (Request) -> Response, set by create_app

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["path"] == CHAT_PATH and scope["method"] == "POST"
                and self.fast_chat is not None and not self.user_middleware and not self.root_path
                and not _native_telemetry_on(self)):
            scope["app"] = self
            request = Request(scope, receive, send)
            try:
                response = await self.fast_chat(request)
            except Exception as exc:
                log.error("unhandled error on POST %s: %s", CHAT_PATH, type(exc).__name__, exc_info=exc)
                response = openai_error(500, "internal proxy error", code="proxy_error")
            await response(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _native_telemetry_on(app: FastAPI) -> bool:
    native = getattr(app, "_native_telemetry", None)
    return native is not None and native.enabled()


class Runtime:
    """Everything one proxy process runs."""

    def __init__(self, config: Config, config_path: str | None, shadow_workers: ShadowRunner | None = None):
        self.config = config
        self.shadow_workers = shadow_workers
        self.config_path = config_path
        self.bus: EventBus = make_bus(config.events)
        kafka = config.events.backend == "kafka"
        persist = None if kafka else Path(config.state_dir) / "rollouts.json"
        self.book = RolloutBook(config, persist_path=persist, publish=self._publish_rollout)
        self.providers = make_providers(config)
        self.tracing = Tracing(config.tracing)
        self.sampler = ShadowSampler(config)
        self.recorder = Recorder(config, self.bus, self.sampler)
        self.proxy = Proxy(config, self.book, self.providers, self.recorder, self.tracing)
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self._shadow: asyncio.Task | None = None
        self._shadow_stop = asyncio.Event()

    def _publish_rollout(self, state: RolloutState) -> None:
        self.bus.publish("rollouts", state)

    async def start(self) -> None:
        await self.bus.start()
        if self.config.events.backend == "kafka":
            follow = self.bus.subscribe(["rollouts"], group=None)
            self.tasks.append(asyncio.create_task(follow_rollouts(follow, self.book, self.stop), name="rollouts"))
        else:
            controller = Controller(self.config, self.bus, self.book, self.config.notify.webhook_url)
            self.tasks.append(asyncio.create_task(controller.run(self.stop), name="controller"))
            if self.shadow_workers is not None:
                self._start_shadow_workers()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # main thread only
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload_on_sighup)

    def _start_shadow_workers(self) -> None:
        """In-process shadow workers (memory mode), stopped with `stop` or replaced on reload."""
        assert self.shadow_workers is not None
        self._shadow_stop = asyncio.Event()
        self._shadow = asyncio.create_task(
            self.shadow_workers(self.config, self.bus, self.providers, self.tracing, self._shadow_stop), name="shadow-workers")

    async def _restart_shadow_workers(self) -> None:
        self._shadow_stop.set()
        await asyncio.gather(self._shadow, return_exceptions=True)
        if not self.stop.is_set():
            self._start_shadow_workers()

    def _reload_on_sighup(self) -> None:
        try:
            self.reload()
        except ConfigError as e:
            log.error("SIGHUP: config not reloaded: %s", "; ".join(e.problems))
        except ValueError as e:
            log.error("SIGHUP: %s", e)

    async def close(self) -> None:
        self.stop.set()
        if self._shadow is not None:
            self._shadow_stop.set()
            self.tasks.append(self._shadow)
        for task in self.tasks:
            try:
                await asyncio.wait_for(task, 5)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception:
                log.exception("background task %s failed", task.get_name())
        await self.bus.close()
        for provider in self.providers.values():
            await provider.close()
        self.tracing.shutdown()

    def reload(self) -> list[str]:
        if not self.config_path:
            raise ValueError("the proxy was started without a config file; nothing to reload")
        config = load_config(self.config_path)
        for name, cfg in config.providers.items():
            if name not in self.config.providers or cfg != self.config.providers[name]:
                old = self.providers.get(name)
                self.providers[name] = make_providers(config)[name]
                if old is not None:
                    asyncio.get_running_loop().create_task(old.close())
        self.config = config
        self.sampler.reload(config)
        self.recorder.reload(config)
        self.proxy.reload(config)
        restarted = self.book.reload(config)
        if self._shadow is not None:
            self.tasks.append(asyncio.get_running_loop().create_task(self._restart_shadow_workers()))
        log.info("config reloaded from %s; new rollouts: %s", self.config_path, restarted or "none")
        return restarted


def create_app(config: Config, config_path: str | None = None,
               shadow_workers: ShadowRunner | None = None) -> FastAPI:
    runtime = Runtime(config, config_path, shadow_workers)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.start()
        try:
            yield
        finally:
            await runtime.close()

    app = ProxyApp(title="modelcanary", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    proxy = runtime.proxy
    app.fast_chat = proxy.chat

    @app.post(CHAT_PATH, openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": CHAT_REQUEST_SCHEMA}}}},
        responses={200: {"description": "chat completion (JSON, or SSE when stream=true)"},
                   400: ERROR_RESPONSE, 404: ERROR_RESPONSE, 413: ERROR_RESPONSE, 502: ERROR_RESPONSE})
    async def chat_completions(request: Request) -> Response:
        return await proxy.chat(request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        try:
            allowed = proxy.allowed_names(request.headers)
        except BadRequest as e:
            return e.response()
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "modelcanary"}
                for name in runtime.config.routes if allowed is None or "*" in allowed or name in allowed]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/feedback", openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "required": ["success"], "properties": {
            "request_id": {"type": "string"}, "session_id": {"type": "string"},
            "success": {"type": "boolean"}, "reason": {"type": "string"}}}}}}},
        responses={400: ERROR_RESPONSE, 404: ERROR_RESPONSE})
    async def feedback(request: Request) -> Response:
        return await _feedback(runtime, request)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if proxy.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    app.include_router(admin_router(runtime))

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def passthrough(request: Request, path: str) -> Response:
        return await proxy.passthrough(request, path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return openai_error(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

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


async def _feedback(runtime: Runtime, request: Request) -> Response:
    from service.proxy.chat import BadRequest, _bearer

    keys = runtime.proxy.client_keys
    allowed: set[str] | None = None
    try:
        if keys is not None:  # client keys on: feedback needs one too, for a route it may use
            allowed = keys.get(_bearer(request.headers.get("authorization")) or "")
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
        reason = body.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise BadRequest(400, "field 'reason' must be a string", param="reason")
        found = runtime.recorder.served(request_id if isinstance(request_id, str) else None,
                                        session_id if isinstance(session_id, str) else None)
        if found is None:
            raise BadRequest(404, "no recent request with that request_id or session_id on this proxy",
                             param="request_id", code="request_not_found")
        if allowed is not None and "*" not in allowed and found[1].route not in allowed:
            raise BadRequest(403, "this client key may not give feedback on that request", code="model_not_allowed")
    except BadRequest as e:
        return e.response()
    key, served = found
    runtime.recorder.feedback(key, served, success, (reason or "")[:500] or None)
    return JSONResponse({"status": "recorded", "route": served.route, "role": served.role}, status_code=202)


def _version() -> str:
    from service import __version__

    return __version__


