"""The one place the proxy reaches into FastAPI: `POST /v1/chat/completions` skips the framework.

FastAPI's `__call__` runs the whole middleware stack (ServerErrorMiddleware, ExceptionMiddleware,
the router) and its per-request dependency solving before our handler, which parses the body
itself anyway. Going straight to the handler measured at ~8% of a busy proxy's CPU in commit 89a2e4f
(2026-11-30); a quick re-measure on a loaded machine (2026-12-01) stayed within its noise. The route
stays declared, for the OpenAPI schema and every other method.

Checked against fastapi 0.165 and starlette 1.10 (pinned `<0.166` and `<1.11` in pyproject); the
shortcut reads `user_middleware` (Starlette), `root_path` and `_native_telemetry` (FastAPI), and
tests/test_internals.py fails if those change shape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.errors import openai_error

log = logging.getLogger("modelcanary")

CHAT_PATH = "/v1/chat/completions"


class ProxyApp(FastAPI):
    """FastAPI with one shortcut: `POST /v1/chat/completions` goes straight to `fast_chat`.

    The handler answers its own errors in OpenAI's shape; anything unexpected gets the catch-all
    500. The shortcut steps aside whenever it would change behaviour: when user middleware is
    added, a root path is set, or FastAPI's own OpenTelemetry instrumentation is active, as they
    stand at the first request.
    """

    fast_chat: Callable[[Request], Awaitable[Response]] | None = None  # set by create_app
    _shortcut: bool | None = None  # decided at the first request, when the app's setup is over

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == CHAT_PATH and scope["method"] == "POST" and self.shortcut():
            assert self.fast_chat is not None  # shortcut() requires it
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

    def shortcut(self) -> bool:
        """Whether the shortcut is on, decided once: middleware can't be added once the app has started,
        and FastAPI's instrumentation turns on with a global OpenTelemetry provider, which is set at
        start-up. Asking FastAPI on every request cost ~7 µs of the ~200 a proxied call takes."""
        if self._shortcut is None:
            self._shortcut = (self.fast_chat is not None and not self.user_middleware and not self.root_path
                              and not native_telemetry_on(self))
        return self._shortcut


def native_telemetry_on(app: FastAPI) -> bool:
    native: Any = getattr(app, "_native_telemetry", None)
    return native is not None and bool(native.enabled())
