"""Streamed answers: an upstream SSE stream relayed event by event (`StreamRelay`), and the response
that sends it (`EventStreamResponse`), which always ends the call, however the stream stops.

Starlette's StreamingResponse does the same through an anyio task group per response (on ASGI
servers older than spec 2.4, which uvicorn's httptools server is); this sends from the request's
own task and watches for the disconnect with one plain asyncio task, which costs less per stream.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.errors import error_body
from service.proxy.outcome import Verdict, failed
from service.proxy.recorder import Call
from service.upstream.base import TransportFailure, UpstreamReply

log = logging.getLogger("modelcanary.proxy")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
STREAM_CAPTURE_LIMIT = 8 * 1024 * 1024
PARTIAL_EVENT_LIMIT = 1024 * 1024  # an unfinished SSE event longer than this is forwarded as it comes
_DONE = re.compile(rb"^data: ?\[DONE\]\r?$", re.MULTILINE)


def chat_stream_over(events: bytes) -> bool:
    """Whether whole SSE events end a Chat Completions stream (`data: [DONE]`)."""
    return b"[DONE]" in events and _DONE.search(events) is not None


def events_end(data: bytes) -> int:
    """Offset just past the last complete SSE event in `data` (0 when there is none)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def last_event_start(data: bytes) -> int:
    """Offset of the last whole SSE event in `data` (events that end with a blank line)."""
    body = data.rstrip(b"\r\n")
    return events_end(body) if body else 0


def client_gone(receive: Receive) -> bool:
    """Whether the client has hung up, known without waiting: an ASGI server answers `receive()` at
    once with `http.disconnect` then. One step of the coroutine, dropped if it would wait (a few µs,
    where Starlette's `is_disconnected` costs ~100 µs with its cancel scope)."""
    step = receive()
    if not hasattr(step, "send") or not hasattr(step, "close"):  # a coroutine has both
        return False
    try:
        step.send(None)
    except StopIteration as done:
        return isinstance(done.value, dict) and done.value.get("type") == "http.disconnect"
    except Exception:  # a server that refuses to be asked: not known to be gone
        return False
    step.close()
    return False


def chat_error_event(status: int, message: str, code: str) -> bytes:
    return b"data: " + error_body(status, message, code) + b"\n\n"


class StreamRelay:
    """One upstream SSE answer, forwarded to the client whole event by whole event.

    The answer is over once its last event is forwarded (`is_over`, chat's `data: [DONE]`), or when
    the upstream ends the body: never later, since servers may keep the connection open, send pings,
    or hold it for the next call. `judge(raw, clipped)` gives the verdict on the captured stream
    (`clipped`: only its first STREAM_CAPTURE_LIMIT bytes, whole events; such a stream is whole only
    once its last event was forwarded); `tally(raw)` notes the answer of a stream that left none for
    the call (it stopped before its end: the client left, the upstream cut it), from the whole events
    captured, so that its tokens count, and returns the failure those events hold (an upstream error
    event), if any; `finish(call)` ends the call (metrics, outcome), exactly
    once, from `close`, which the response runs whenever the stream stops, also when it never started.
    """

    def __init__(self, call: Call, reply: UpstreamReply, judge: Callable[[bytes, bool], Verdict],
                 tally: Callable[[bytes], Verdict | None] | None, finish: Callable[[Call], None],
                 cutting: Callable[[], bool], is_over: Callable[[bytes], bool] = chat_stream_over,
                 has_output: Callable[[bytes], bool] | None = None,
                 error_event: Callable[[int, str, str], bytes] = chat_error_event):
        """`cutting()`: whether the proxy is cutting the streams left at the end of its drain;
        `has_output(events)`: whether events carry output, for time to first token (default: any
        event does); `error_event(status, message, code)`: an error in the stream's own format."""
        self.call = call
        self._cutting = cutting
        self.reply = reply
        self._judge = judge
        self._tally = tally
        self._finish = finish
        self._is_over = is_over
        self._has_output = has_output
        self._error_event = error_event
        self._captured: list[bytes] = []
        self._size = 0
        self._over = False
        self._closed = False

    def response(self, headers: Mapping[str, str], media_type: str = "text/event-stream") -> EventStreamResponse:
        return EventStreamResponse(self.events(), headers=headers, media_type=media_type, on_close=self.close,
                                   on_cut=self.cut)

    def cut(self) -> bytes | None:
        """The stream's last event when the proxy cuts it at the end of its drain (None: it doesn't):
        the call ends `draining`, its client is told."""
        if not self._cutting():
            return None
        self.call.verdict = failed("draining", "the stream was still open when server.drain_seconds ran out")
        return self._error_event(503, "the proxy is shutting down and cut this stream at the end of its drain; "
                                 "retry on another replica", "draining")

    async def events(self) -> AsyncGenerator[bytes, None]:  # noqa: C901 - the stream's lifecycle (forward, capture, end, fail) in one generator
        call = self.call
        partial = b""  # the start of an SSE event not yet complete: forwarded once it is
        last = b""  # the events that hold the terminal one: forwarded once the stream is judged
        try:
            async for chunk in self.reply.chunks():
                if self._size < STREAM_CAPTURE_LIMIT:
                    self._captured.append(chunk)
                    self._size += len(chunk)
                if partial:
                    chunk, partial = partial + chunk, b""
                if not chunk.endswith(b"\n\n"):
                    cut = events_end(chunk)
                    if len(chunk) - cut <= PARTIAL_EVENT_LIMIT:
                        chunk, partial = chunk[:cut], chunk[cut:]
                if chunk:
                    if call.ttft_s is None and (self._has_output is None or self._has_output(chunk)):
                        call.ttft_s = time.perf_counter() - call.started
                    if self._is_over(chunk):
                        self._over = True
                        last = chunk
                        break
                    yield chunk
            clipped = self._size >= STREAM_CAPTURE_LIMIT
            call.verdict = self._judge(self._whole_events() if clipped else b"".join(self._captured), clipped)
            if clipped and call.verdict.ok and not self._over:  # its end is past what was captured
                call.verdict = failed("bad_response", "the stream ended before its last event")
            if call.verdict.cause != "bad_response":
                yield last + partial  # partial: the upstream ended without a final blank line: a whole last event
            else:  # say so, before the terminal event (clients stop reading there), never silently; an
                # unended event that is part of the problem is not forwarded: the client sees whole events
                terminal = last_event_start(last)
                yield last[:terminal] + self._error_event(
                    502, f"upstream stream is malformed: {call.verdict.detail}", "bad_response") + last[terminal:]
        except TransportFailure as e:
            # a cut-off event is never forwarded: the client sees whole events, then this error event
            call.verdict = failed(e.cause, e.detail)
            yield self._error_event(502, f"upstream stream failed: {e.detail}", e.cause)
        except Exception:
            log.exception("proxy error while streaming request %s", call.request_id)
            call.verdict = failed("proxy_error")
            yield self._error_event(500, "internal proxy error", "proxy_error")

    async def close(self, client_left: bool) -> None:
        """End the call once: the verdict the stream reached, else the client left (or the proxy
        stopped the stream); then hand the upstream connection back, or close it mid-answer."""
        if self._closed:
            return
        self._closed = True
        call = self.call
        seen = None
        if call.response is None and self._tally is not None and self._captured:
            try:
                seen = self._tally(self._whole_events())
            except Exception:  # the call still ends, without the tokens of its partial answer
                log.exception("could not read the partial answer of request %s", call.request_id)
        if call.verdict is None:  # an error the client was sent is what it saw, also if it left then
            call.verdict = seen or (failed("client_cancelled") if client_left else
                                    failed("proxy_error", "the stream was stopped before the answer ended"))
        if not self._over:
            self.reply.release()
        self._finish(call)
        if self._over:
            await self.reply.settle()


    def _whole_events(self) -> bytes:
        """The captured stream up to its last whole event: a capture may stop inside an event."""
        raw = b"".join(self._captured)
        return raw[:events_end(raw)]


class EventStreamResponse(Response):
    """SSE bytes sent as they come; the stream is cancelled when the client leaves. `on_close(left)`
    runs after the stream stopped, in every case: a generator that never started runs none of its
    own code when closed, so the call's end cannot live in it."""

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int = 200,
                 headers: Mapping[str, str] | None = None, media_type: str = "text/event-stream",
                 on_close: Callable[[bool], Awaitable[None]] | None = None,
                 on_cut: Callable[[], bytes | None] | None = None):
        """`on_cut()`: when the server cancels the stream, its last bytes if the proxy meant to (the
        end of a drain); None: an unexpected cancel, raised on."""
        self.chunks = chunks
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.on_close = on_close
        self.on_cut = on_cut
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.current_task()
        assert sender is not None  # an ASGI app is called in a task
        left = False

        async def watch_for_disconnect() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            sender.cancel()

        watcher = asyncio.get_running_loop().create_task(watch_for_disconnect())
        started = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            started = True
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            last = None if left or self.on_cut is None else self.on_cut()
            if not left and last is None:
                raise
            sender.uncancel()  # the client left, or the proxy cuts the stream: it ends here
            if last is not None:
                await self._last_words(send, started, last)
        finally:
            watcher.cancel()
            try:
                aclose = getattr(self.chunks, "aclose", None)
                if aclose is not None:
                    await aclose()  # the stream's own cleanup now, not when it is collected
            finally:
                if self.on_close is not None:
                    await self.on_close(left)

    async def _last_words(self, send: Send, started: bool, last: bytes) -> None:
        if not started:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": last, "more_body": False})
