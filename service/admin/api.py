"""Operator API: rollout state and actions (bearer token), reload, and the Argo/Flagger analysis gate."""

from __future__ import annotations

import hmac
import logging
import os
from typing import TYPE_CHECKING

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.config import ConfigError
from service.errors import openai_error
from service.records import dump
from service.rollout.book import ACTIONS, TransitionError

if TYPE_CHECKING:
    from service.proxy.app import Runtime

audit = logging.getLogger("modelcanary.audit")


def admin_router(runtime: Runtime) -> APIRouter:
    router = APIRouter()

    def refused(request: Request) -> Response | None:
        header = request.headers.get("authorization")
        client = request.client.host if request.client else "-"
        if not header:
            audit.warning("refused admin call %s %s: no token client=%s", request.method, request.url.path, client)
            return openai_error(401, "admin endpoints need 'Authorization: Bearer <token>'", code="missing_token")
        expected = os.environ.get(runtime.config.server.admin_token_env)
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not expected or not hmac.compare_digest(given.encode(), expected.encode()):
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

    @router.get("/admin/rollouts/{route}")
    async def get_rollout(route: str, request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        if route not in runtime.book.states:
            return unknown(route)
        return JSONResponse(_public(runtime.book.get(route)))

    @router.get("/admin/rollouts/{route}/report")
    async def report(route: str, request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        if route not in runtime.book.states:
            return unknown(route)
        state = runtime.book.get(route)
        return JSONResponse({"route": route, "state": _public(state), "report": state.report})

    @router.post("/admin/rollouts/{route}/{action}")
    async def act(route: str, action: str, request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        if action not in ACTIONS:
            return openai_error(404, f"unknown action {action[:40]!r}; use one of {', '.join(ACTIONS)}",
                                param="action", code="unknown_action")
        if route not in runtime.book.states:
            return unknown(route)
        try:
            state = runtime.book.operate(route, action, by="operator")  # type: ignore[arg-type]
        except TransitionError as e:
            return openai_error(409, str(e), code="invalid_transition")
        audit.info("operator action=%s route=%s phase=%s weight=%.3f client=%s", action, route, state.phase,
                   state.canary_weight, request.client.host if request.client else "-")
        return JSONResponse(_public(state))

    @router.post("/admin/reload")
    async def reload(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        try:
            restarted = runtime.reload()
        except ConfigError as e:
            return openai_error(400, f"config not reloaded: {'; '.join(e.problems)}", code="invalid_config")
        except ValueError as e:
            return openai_error(409, str(e), code="no_config_file")
        audit.info("operator action=reload restarted=%s", ",".join(restarted) or "-")
        return JSONResponse({"status": "reloaded", "new_rollouts": restarted})

    @router.get("/analysis/{route}")
    async def analysis(route: str, request: Request) -> Response:
        from service.judge.decide import analysis as verdict_of

        if route not in runtime.book.states:
            return unknown(route)
        result = verdict_of(runtime.book.get(route))
        if request.query_params.get("gate") == "promote" and not result["promote_ready"]:
            return JSONResponse(result, status_code=412)
        return JSONResponse(result)

    return router


def _public(state) -> dict:
    data = dump(state)
    data.pop("report", None)
    return data
