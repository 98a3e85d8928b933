"""The one place the proxy reaches into FastAPI: `POST /v1/chat/completions` skips the framework.

Most chat requests do not reach the app at all: the HTTP protocol answers them below ASGI
(service/proxy/native.py), under the same conditions as this shortcut (`native_chat`). The
shortcut serves the rest: chunked or oversized bodies, `Expect: 100-continue`, a query string.

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

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.proxy.native import ChatAnswerer, unhandled

CHAT_PATH = "/v1/chat/completions"


class ProxyApp(FastAPI):
    """FastAPI with one shortcut: `POST /v1/chat/completions` goes straight to `fast_chat`.

    The handler answers its own errors in OpenAI's shape; anything unexpected gets the catch-all
    500. The shortcut steps aside whenever it would change behaviour: when user middleware is
    added, a root path is set, or FastAPI's own OpenTelemetry instrumentation is active, as they
    stand at the first request.
    """

    fast_chat: Callable[[Request], Awaitable[Response]] | None = None  # set by create_app
    chat_answerer: ChatAnswerer | None = None  # set by create_app: the route below ASGI (native.py)
    _shortcut: bool | None = None  # decided at the first request, when the app's setup is over

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == CHAT_PATH and scope["method"] == "POST" and self.shortcut():
            assert self.fast_chat is not None  # shortcut() requires it
            scope["app"] = self
            request = Request(scope, receive, send)
            try:
                response = await self.fast_chat(request)
            except Exception as exc:
                response = unhandled(exc)
            await response(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def native_chat(self) -> ChatAnswerer | None:
        """Who answers chat requests below ASGI (service/proxy/native.py), when the shortcut is on: the
        same conditions, since both skip the middleware stack. Asked when a connection is made, so
        after the app's setup."""
        return self.chat_answerer if self.shortcut() else None

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
