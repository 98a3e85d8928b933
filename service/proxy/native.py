"""`POST /v1/chat/completions` answered from uvicorn's HTTP protocol itself, without ASGI.

The proxy's busiest route does not need what ASGI gives every request: the scope, the request and
response cycle with its message passing, Starlette's `Request`, the header checks of uvicorn's
`send`. `GuardedHttpToolsProtocol` (service/proxy/server.py) hands a chat request with a declared
body within `server.max_body_bytes` to a `ChatCycle` instead of uvicorn's `RequestResponseCycle`;
anything else (chunked or oversized bodies, `Expect: 100-continue`, a query string, other paths)
takes the ASGI route as before. What it buys, measured in one run against the tree before it (2-core
VM, 2026-12-04, wrk against the simulator): CPU per request at c=16 137 against 165 µs, added p50 at
c=1 0.213 against 0.255 ms, max req/s 7,946 against 6,874 (benchmarks/README, seventh round).

A `ChatCycle` stands where uvicorn keeps its cycle (`protocol.cycle`, the pipeline queue), so the
protocol's own code feeds it: `on_body` appends to `body` and sets `message_event`,
`on_message_complete` clears `more_body`, `connection_lost` sets `disconnected`, `shutdown` clears
`keep_alive`, and `_start_asgi_task` runs `run_asgi`. Checked against uvicorn 0.54 (pinned `<0.55`);
tests/test_internals.py fails if the protocol stops using these names. The answer is any Starlette
`Response`, sent through this cycle's `send`, so plain answers, errors and event streams are the
same objects on both routes.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
import time
from collections.abc import Callable, MutableMapping
from typing import Any, Protocol

from starlette.responses import Response
from uvicorn.protocols.http.flow_control import FlowControl

from service.errors import openai_error

log = logging.getLogger("modelcanary")

_SCOPE = {"type": "http"}  # what a Starlette Response reads of the scope
_DISCONNECT = {"type": "http.disconnect"}
_HEADER_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")  # as uvicorn refuses them: no header splitting


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


# Told of the client leaving while an answer is awaited: `on_leave(callback)` arms it (None disarms); the
# protocol calls the callback once the connection is lost, so the proxy stops waiting for the upstream.
OnLeave = Callable[[Callable[[], None] | None], None]
LEAVE_KEY = "modelcanary.on_leave"  # where an ASGI request's armed callback waits (its scope)


def left_before_armed() -> None:
    """What the protocol leaves in the scope of a request whose client left before anyone waited."""


def on_leave_in_scope(scope: MutableMapping[str, Any], callback: Callable[[], None] | None) -> None:
    """`OnLeave` for a request that came through ASGI: the protocol finds the callback in its scope, or
    has left word there that the client is gone already (then it is told at once, as below ASGI)."""
    if callback is not None and scope.get(LEAVE_KEY) is left_before_armed:
        callback()
    scope[LEAVE_KEY] = callback


class ChatAnswerer(Protocol):
    """What the protocol asks of the proxy (`service.proxy.chat.Proxy`)."""

    def body_limit(self) -> int: ...

    async def answer_chat(self, started: float, headers: dict[str, str], raw: bytes,
                          gone: Callable[[], bool], on_leave: OnLeave | None = None) -> Response: ...


class ChatCycle:
    """One chat request and its answer on a connection, in place of uvicorn's RequestResponseCycle."""

    __slots__ = ("transport", "flow", "message_event", "on_response", "keep_alive", "headers", "body",
                 "more_body", "disconnected", "response_complete", "_answerer", "_head", "_chunked", "_left")

    def __init__(self, transport: asyncio.Transport, flow: FlowControl, headers: dict[str, str], keep_alive: bool,
                 on_response: Callable[[], None], answerer: ChatAnswerer):
        self.transport = transport
        self.flow = flow
        self.message_event = asyncio.Event()
        self.on_response = on_response
        self.keep_alive = keep_alive
        self.headers = headers
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.response_complete = False
        self._answerer = answerer
        self._head: bytes | None = None
        self._chunked = False
        self._left: Callable[[], None] | None = None

    async def run_asgi(self, _app: object) -> None:
        """Read the body, answer, send (the name is the one the protocol calls to start a cycle)."""
        try:
            while self.more_body and not self.disconnected:
                self.flow.resume_reading()
                await self.message_event.wait()
                self.message_event.clear()
            if self.disconnected:
                return
            started = time.perf_counter()
            try:
                response = await self._answerer.answer_chat(started, self.headers, bytes(self.body), self.gone,
                                                            self.on_leave)
            except Exception as exc:
                response = unhandled(exc)
            await response(_SCOPE, self.receive, self.send)
        except asyncio.CancelledError:
            self.transport.close()
            raise
        except Exception as exc:  # as uvicorn does once a response has started: the connection can't be trusted
            log.error("error while sending an answer: %s", type(exc).__name__, exc_info=exc)
            self.transport.close()
        finally:
            self.on_response = _nothing  # the protocol's next request is started once, from here at most

    def gone(self) -> bool:
        return self.disconnected

    def on_leave(self, callback: Callable[[], None] | None) -> None:
        self._left = callback
        if self.disconnected:  # already gone: told at once
            self.client_left()

    def client_left(self) -> None:
        """The connection is lost (the protocol tells it): whoever awaits the answer stops."""
        left, self._left = self._left, None
        if left is not None:
            left()

    async def receive(self) -> MutableMapping[str, Any]:
        """The body is in before the answer starts: all that is left to hear is that the client left."""
        while not self.disconnected and not self.response_complete:
            await self.message_event.wait()
            self.message_event.clear()
        return _DISCONNECT

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected or self.response_complete:
            return
        if message["type"] == "http.response.start":
            self._start(message["status"], message.get("headers", ()))
            return
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            self.transport.write(data + b"0\r\n\r\n" if not more else data)
        else:
            head, self._head = self._head, None
            self.transport.write(head + body if head is not None else body)
        if not more:
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    def _start(self, status: int, headers: Any) -> None:
        """The response head; a whole answer's goes out with its body, in one write."""
        lines = [STATUS_LINES[status]]
        chunked = True
        for name, value in headers:
            if _HEADER_VALUE.search(value):
                raise RuntimeError(f"invalid value of response header {name!r}")
            if name == b"content-length":
                chunked = False
            lines += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        if chunked:
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        self._chunked = chunked
        if chunked:  # a stream: its head goes out now, before the first event
            self.transport.write(b"".join(lines))
        else:
            self._head = b"".join(lines)


def unhandled(exc: Exception) -> Response:
    """The answer to a chat request whose handler failed unexpectedly (on either route): logged, and
    the catch-all 500 in OpenAI's shape."""
    log.error("unhandled error on POST /v1/chat/completions: %s", type(exc).__name__, exc_info=exc)
    return openai_error(500, "internal proxy error", code="proxy_error")


def _nothing() -> None:
    pass
