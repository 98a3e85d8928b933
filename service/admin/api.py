"""Operator API: rollout state and actions (bearer token), reload, and the Argo/Flagger analysis gate."""

from __future__ import annotations

import hmac
import logging
import math
import os
import urllib.parse
from typing import TYPE_CHECKING

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.config import ConfigError, ReloadRefused
from service.errors import openai_error
from service.records import dump
from service.rollout.book import ACTIONS, TransitionError, UnknownSegment

if TYPE_CHECKING:
    from service.proxy.app import Runtime

audit = logging.getLogger("modelcanary.audit")

ACTION_PARAMS = ("segment",)  # the only query parameter of POST /admin/rollouts/{route}/{action}
GATES = ("promote",)  # /analysis/{route}?gate=: a non-2xx answer blocks the gated step


def admin_router(runtime: Runtime) -> APIRouter:  # noqa: C901 - counts its nested handlers together; each is a few lines
    router = APIRouter()

    def refused(request: Request) -> Response | None:
        header = request.headers.get("authorization")
        client = request.client.host if request.client else "-"
        variable = runtime.config.server.admin_token_env
        expected = (os.environ.get(variable) or "").strip()  # a token file's trailing newline is no part of it
        if not expected:
            audit.warning("refused admin call %s %s: %s is not set client=%s", request.method, request.url.path,
                          variable, client)
            return openai_error(403, f"the admin API is disabled: the admin token variable {variable} is not set "
                                "on the proxy", code="admin_token_not_set")
        if not header:
            audit.warning("refused admin call %s %s: no token client=%s", request.method, request.url.path, client)
            return openai_error(401, "admin endpoints need 'Authorization: Bearer <token>'", code="missing_token")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), expected.encode()):
            audit.warning("refused admin call %s %s: invalid token client=%s", request.method, request.url.path,
                          client)
            return openai_error(403, "admin token is not valid", code="invalid_token")
        return None

    def unknown(route: str) -> Response:
        return openai_error(404, f"unknown route {route[:100]!r}; known routes: {', '.join(sorted(runtime.book.states))}",
                            param="route", code="route_not_found")

    @router.get("/admin/rollouts")
    async def list_rollouts(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        return JSONResponse({"rollouts": [_public(s) for s in runtime.book.states.values()]})

    # A route name may hold '/' (`acme/support-bot`): `{route:path}` takes it, and the route and what
    # follows it are read from the raw path, where a %2F stays inside its segment, so
    # /admin/rollouts/acme%2Freport is route `acme/report`, never the report of route `acme`.
    @router.get("/admin/rollouts/{route:path}/report")
    async def report(route: str, request: Request) -> Response:
        return get_rollout_or_report(request, f"{route}/report")

    @router.get("/admin/rollouts/{route:path}")
    async def get_rollout(route: str, request: Request) -> Response:
        return get_rollout_or_report(request, route)

    def get_rollout_or_report(request: Request, rest: str) -> Response:
        """GET /admin/rollouts/{route} (the state) or .../{route}/report; `rest` is the path after
        /admin/rollouts/, decoded."""
        if (denied := refused(request)) is not None:
            return denied
        segments = _raw_segments(request, rest)
        wants_report = len(segments) > 1 and segments[-1] == "report"
        route = _decoded(segments[:-1] if wants_report else segments)
        if route not in runtime.book.states:
            return unknown(route)
        state = runtime.book.get(route)
        if wants_report:
            return JSONResponse({"route": route, "state": _public(state), "report": state.report})
        return JSONResponse(_public(state))

    @router.get("/admin/traffic")
    async def traffic(request: Request) -> Response:
        """Memory mode: the recent sampled TrafficEvents and feedback as JSON lines (`modelcanary capture`)."""
        if (denied := refused(request)) is not None:
            return denied
        recent = runtime.recent_traffic
        if recent is None:
            return openai_error(409, "in Kafka mode capture reads the traffic and outcomes topics, not the proxy",
                                code="kafka_mode")
        bounds: dict[str, float | None] = {}
        for name in ("since", "until"):
            raw = request.query_params.get(name)
            bounds[name] = _unix_time(raw) if raw is not None else None
            if raw is not None and bounds[name] is None:
                return openai_error(400, f"{name} must be a unix time in seconds, got {raw[:40]!r}", param=name,
                                    code="invalid_value")
        return Response(b"".join(recent.lines(bounds["since"], bounds["until"])), media_type="application/x-ndjson")

    @router.post("/admin/rollouts/{route:path}/{action}")
    async def act(route: str, action: str, request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        segments = _raw_segments(request, f"{route}/{action}")  # the action is the last raw segment
        if len(segments) < 2:  # e.g. POST /admin/rollouts/acme%2Fpause: route `acme/pause`, no action
            return openai_error(405, "POST takes an action: /admin/rollouts/{route}/{promote|pause|resume|rollback}"
                                " (a '/' in a route name is sent as %2F)", code="method_not_allowed")
        route, action = _decoded(segments[:-1]), _decoded(segments[-1:])
        if action not in ACTIONS:
            return openai_error(404, f"unknown action {action[:40]!r}; use one of {', '.join(ACTIONS)}",
                                param="action", code="unknown_action")
        if route not in runtime.book.states:
            return unknown(route)
        if (bad := _action_input_problem(request, await request.body())) is not None:
            return bad
        if not runtime.caught_up.is_set():  # an action on a state older than the topic's would be lost
            return openai_error(503, "this replica has not caught up with the rollout states yet; retry in a few "
                                "seconds", code="catching_up")
        segment = request.query_params.get("segment")
        before = runtime.book.states[route]
        try:
            state = runtime.book.operate(route, action, by="operator", segment=segment)  # type: ignore[arg-type]
        except TransitionError as e:
            return openai_error(409, str(e), code="invalid_transition")
        except UnknownSegment as e:
            return openai_error(404, str(e), param="segment", code="segment_not_found")
        if runtime.config.events.backend == "kafka":  # memory mode: the embedded controller notifies every change
            runtime.notifier.changed(state, before)
        audit.info("operator action=%s route=%s segment=%s phase=%s weight=%.3f client=%s", action, route,
                   (segment or "-")[:64], state.phase, state.canary_weight, request.client.host if request.client else "-")
        return JSONResponse(_public(state))

    @router.post("/admin/reload")
    async def reload(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        try:
            restarted = runtime.reload()
        except ConfigError as e:
            return openai_error(400, f"config not reloaded: {'; '.join(e.problems)}", code="invalid_config")
        except ReloadRefused as e:
            return openai_error(409, str(e), code=e.code)
        audit.info("operator action=reload restarted=%s", ",".join(restarted) or "-")
        return JSONResponse({"status": "reloaded", "new_rollouts": restarted})

    @router.get("/analysis/{route:path}")  # the whole rest of the path: acme/support-bot or acme%2Fsupport-bot
    async def analysis(route: str, request: Request) -> Response:
        from service.judge.segments import analysis_of as verdict_of

        if route not in runtime.book.states:
            return unknown(route)
        gates = request.query_params.getlist("gate")
        if any(g not in GATES for g in gates) or len(gates) > 1:
            shown = ", ".join(repr(g[:40]) for g in gates)
            return openai_error(400, f"gate must be one of: {', '.join(GATES)} (or left out); got {shown}",
                                param="gate", code="invalid_value")
        result = verdict_of(runtime.book.get(route))
        if gates == ["promote"] and not result["promote_ready"]:
            return JSONResponse(result, status_code=412)
        return JSONResponse(result)

    return router


def _raw_segments(request: Request, rest: str) -> list[str]:
    """`rest` (the decoded path after a prefix) as the raw, still percent-encoded, segments it was
    sent as: the tail of the raw path that decodes to it. Without a raw path (a server that gives
    none), the decoded segments."""
    raw = request.scope.get("raw_path")
    if isinstance(raw, bytes):
        parts = raw.decode("latin-1").split("/")
        for k in range(1, len(parts) + 1):
            tail = parts[-k:]
            if urllib.parse.unquote("/".join(tail)) == rest:
                return tail
    return rest.split("/")


def _decoded(segments: list[str]) -> str:
    return urllib.parse.unquote("/".join(segments))


def _public(state) -> dict:
    data = dump(state)
    data.pop("report", None)
    return data


def _unix_time(raw: str) -> float | None:
    """`raw` as a finite number of seconds, else None (nan and inf would silently match nothing)."""
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _action_input_problem(request: Request, body: bytes) -> Response | None:
    """A 400 for anything an action would otherwise ignore: a body, an unknown, repeated or empty
    query parameter. Ignoring them acts on more than was asked (a misspelt segment pauses them all).
    An empty JSON object, what many HTTP clients send on a bare POST, carries nothing and is fine."""
    if b"".join(body.split()) not in (b"", b"{}", b"null"):
        return openai_error(400, "this endpoint takes no body; put the segment in the query: ?segment=...",
                            param="body", code="unexpected_body")
    for name in request.query_params:
        if name not in ACTION_PARAMS:
            return openai_error(400, f"unknown query parameter {name[:40]!r}; this endpoint takes: "
                                f"{', '.join(ACTION_PARAMS)}", param=name[:40], code="unknown_parameter")
    values = request.query_params.getlist("segment")
    if len(values) > 1:
        return openai_error(400, f"segment given {len(values)} times; name one segment, or leave it out to act "
                            "on every segment", param="segment", code="invalid_value")
    if values and not values[0].strip():
        return openai_error(400, "segment is empty; name a segment, or leave it out to act on every segment",
                            param="segment", code="invalid_value")
    return None
