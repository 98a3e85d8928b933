"""The simulator's HTTP/1.1 server: an asyncio Protocol over httptools (uvloop when present).

Keep-alive and pipelining (answers go out in request order), Content-Length and chunked
request bodies, `Expect: 100-continue`, chunked SSE responses. Delays are timer callbacks
(`loop.call_at`), not coroutines; with `time_scale: 0` a request is answered inside the
`data_received` call that completed it, without touching the timer queue at all.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable

import httptools

from service.simulator import messages
from service.simulator.config import SimulatorConfig
from service.simulator.engine import Engine, Reply, error_reply, invalid_api_key_reply
from service.simulator.responses import ResponsesEndpoint

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
    uvloop = None

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_PIPELINED = 64          # queued requests per connection before we stop reading
HANG_SECONDS = 3600.0       # a "timeout" failure holds the connection this long, then drops it

_REASONS = {
    200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found",
    405: b"Method Not Allowed", 413: b"Payload Too Large", 417: b"Expectation Failed",
    429: b"Too Many Requests", 500: b"Internal Server Error", 503: b"Service Unavailable", 529: b"Overloaded",
}
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in _REASONS.items()}
_HEALTH = Reply(body=b'{"status":"ok"}')
_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"


def _not_found(method: bytes, path: bytes) -> Reply:
    return error_reply(404, f"Invalid URL ({method.decode('latin-1')} {path.decode('latin-1')})",
                       "invalid_request_error")


def _not_allowed(method: bytes, path: bytes) -> Reply:
    return error_reply(405, f"Method {method.decode('latin-1')} is not allowed for {path.decode('latin-1')}",
                       "invalid_request_error")


class _Request:
    __slots__ = ("method", "url", "auth", "anthropic", "task_type", "body", "keep_alive", "http11", "too_large",
                 "arrival")

    def __init__(self, method, url, auth, anthropic, task_type, body, keep_alive, http11, too_large):
        self.method = method
        self.url = url
        self.auth = auth
        self.anthropic = anthropic  # an Anthropic client (it sent `anthropic-version`)
        self.task_type = task_type
        self.body = body
        self.keep_alive = keep_alive
        self.http11 = http11
        self.too_large = too_large
        self.arrival = 0.0


class Apis:
    """The engine and the endpoints of the other API formats rendered from it (shared by connections)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.responses = ResponsesEndpoint(engine)
        self.messages = messages.MessagesEndpoint(engine)


class HttpProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, apis: Apis, loop: asyncio.AbstractEventLoop, conns: set):
        self.apis = apis
        self.engine = apis.engine
        self.loop = loop
        self.conns = conns
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.pending: deque[_Request] = deque()
        self.busy = False
        self.closed = False
        self.reading_paused = False
        self.draining = False
        self.half_closed = False
        self.timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.body: list[bytes] = []
        self.body_size = 0
        self.auth: bytes | None = None
        self.api_key: bytes | None = None
        self.anthropic = False
        self.task_type: str | None = None
        self.expect: bytes | None = None
        self.too_large = False

    # -------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.conns.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.pending.clear()

    def eof_received(self) -> bool:
        """The client half-closed: answer what it already sent, then close."""
        self.half_closed = True
        if self.busy or self.pending:
            return True  # keep the transport open for writing
        return False

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._protocol_error(400, "Protocol upgrades are not supported.")
        except httptools.HttpParserError as e:
            self._protocol_error(400, f"Malformed HTTP request: {e}")

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # -------------------------------------------------------- httptools callbacks

    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"authorization":
            self.auth = value
        elif name == b"x-api-key":
            self.api_key = value
        elif name == b"anthropic-version":
            self.anthropic = True
        elif name == b"x-task-type":
            self.task_type = value.decode("latin-1")
        elif name == b"expect":
            self.expect = value.lower()
        elif name == b"content-length" and value.isdigit() and int(value) > MAX_BODY_BYTES:
            self.too_large = True

    def on_headers_complete(self) -> None:
        if self.expect is None:
            return
        if self.expect != b"100-continue":
            self._protocol_error(417, "Only 'Expect: 100-continue' is supported.")
        elif self.too_large:
            self._protocol_error(413, f"Request body larger than {MAX_BODY_BYTES} bytes.")
        elif not self.busy and not self.pending:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.too_large:
            return
        self.body_size += len(body)
        if self.body_size > MAX_BODY_BYTES:
            self.too_large = True
            self.body = []
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.closed:
            return
        p = self.parser
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        auth = self.auth if self.auth is not None or self.api_key is None else b"Bearer " + self.api_key
        req = _Request(p.get_method(), self.url, auth, self.anthropic, self.task_type, body, p.should_keep_alive(),
                       p.get_http_version() == "1.1", self.too_large)
        self.pending.append(req)
        if self.busy:
            if len(self.pending) > MAX_PIPELINED and not self.reading_paused:
                self.transport.pause_reading()
                self.reading_paused = True
        else:
            self._drain()

    # -------------------------------------------------------- request queue

    def _drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        try:
            while self.pending and not self.busy and not self.closed:
                req = self.pending.popleft()
                self.busy = True
                req.arrival = self.loop.time() if self.engine.time_scale else 0.0
                self._respond(req, self._dispatch(req))
            if self.reading_paused and len(self.pending) < MAX_PIPELINED // 2 and not self.closed:
                self.transport.resume_reading()
                self.reading_paused = False
        finally:
            self.draining = False

    def _done(self, keep_alive: bool) -> None:
        self.timer = None
        self.busy = False
        if not keep_alive:
            self.close()
        elif self.pending:
            self._drain()
        elif self.half_closed:
            self.close()

    def _dispatch(self, req: _Request) -> Reply:  # noqa: C901 - one router over the simulator's endpoints and methods
        url = req.url
        q = url.find(b"?")
        path = url if q < 0 else url[:q]
        if path.startswith(b"/v1/"):
            path = path[3:]
        elif path == b"/healthz" or path == b"/readyz":
            return _HEALTH
        engine = self.engine
        if req.too_large:
            return error_reply(413, f"Request body larger than {MAX_BODY_BYTES} bytes.", "invalid_request_error")
        method = req.method
        if path == b"/chat/completions":
            if method != b"POST":
                return _not_allowed(method, req.url)
            if not engine.authorized(req.auth):
                return invalid_api_key_reply()
            return engine.chat(req.body, req.task_type)
        if path == b"/responses":
            if method != b"POST":
                return _not_allowed(method, req.url)
            if not engine.authorized(req.auth):
                return invalid_api_key_reply()
            return self.apis.responses.respond(req.body, req.task_type)
        if path.startswith(b"/responses/"):
            if method not in (b"GET", b"DELETE"):
                return _not_allowed(method, req.url)
            if not engine.authorized(req.auth):
                return invalid_api_key_reply()
            rid = path[11:].decode("utf-8", "replace")
            return self.apis.responses.retrieve(rid) if method == b"GET" else self.apis.responses.delete(rid)
        if path == b"/messages":
            if method != b"POST":
                return _not_allowed(method, req.url)
            if not engine.authorized(req.auth):
                return messages.invalid_key_reply()
            return self.apis.messages.respond(req.body, req.task_type)
        if path == b"/models":
            if method != b"GET":
                return _not_allowed(method, req.url)
            if not engine.authorized(req.auth):
                return messages.invalid_key_reply() if req.anthropic else invalid_api_key_reply()
            return messages.list_models(engine) if req.anthropic else engine.list_models()
        if path == b"/embeddings" or path == b"/completions":
            if method != b"POST":
                return _not_allowed(method, req.url)
            if not engine.authorized(req.auth):
                return invalid_api_key_reply()
            if path == b"/embeddings":
                return engine.embeddings(req.body, req.task_type)
            return engine.completion(req.body, req.task_type)
        if path.startswith(b"/models/") and method == b"GET":
            if not engine.authorized(req.auth):
                return invalid_api_key_reply()
            return engine.get_model(path[8:].decode("utf-8", "replace"))
        return _not_found(method, req.url)

    # -------------------------------------------------------- writing

    def _respond(self, req: _Request, reply: Reply) -> None:
        if reply.hang:
            # Never answer: the client's own timeout fires. Later pipelined requests wait too,
            # as they would behind a stuck upstream. Dropped after HANG_SECONDS.
            self.timer = self.loop.call_later(HANG_SECONDS, self.close)
            return
        if reply.frames is not None:
            self._stream(req, reply)
        elif reply.delay > 0.0:
            self.timer = self.loop.call_at(req.arrival + reply.delay, self._write, req, reply)
        else:
            self._write(req, reply)

    def _write(self, req: _Request, reply: Reply) -> None:
        if self.closed:
            return
        keep_alive = req.keep_alive
        head = _STATUS_LINES.get(reply.status) or b"HTTP/1.1 %d Unknown\r\n" % reply.status
        parts = [head, b"content-type: ", reply.content_type, b"\r\ncontent-length: ",
                 str(len(reply.body)).encode(), b"\r\n"]
        for name, value in reply.headers:
            parts += [name, b": ", value, b"\r\n"]
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts += [b"\r\n", reply.body]
        self.transport.write(b"".join(parts))
        self._done(keep_alive)

    def _stream(self, req: _Request, reply: Reply) -> None:
        chunked = req.http11
        keep_alive = req.keep_alive and chunked and not reply.abort
        head = _SSE_HEAD + (b"transfer-encoding: chunked\r\n" if chunked else b"") + \
            (b"" if keep_alive else b"connection: close\r\n") + b"\r\n"
        frames = reply.frames
        times = reply.times

        def frame(k: int) -> bytes:
            f = frames[k]
            return b"%x\r\n%s\r\n" % (len(f), f) if chunked else f

        def finish() -> None:
            if reply.abort:
                self.transport.abort()  # drop mid-stream: no terminating chunk
                self.closed = True
                self.timer = None
                self.busy = False
                return
            if chunked:
                self.transport.write(b"0\r\n\r\n")
            self._done(keep_alive)

        if times[-1] <= 0.0:
            self.transport.write(head + b"".join(frame(k) for k in range(len(frames))))
            finish()
            return

        def send(k: int) -> None:
            if self.closed:
                return
            self.transport.write(head + frame(0) if k == 0 else frame(k))
            if k + 1 < len(frames):
                self.timer = self.loop.call_at(req.arrival + times[k + 1], send, k + 1)
            else:
                finish()

        self.timer = self.loop.call_at(req.arrival + times[0], send, 0)

    def _protocol_error(self, status: int, message: str) -> None:
        """Answer a request we can't parse (or accept) and drop the connection."""
        if self.closed or self.transport is None:
            return
        reply = error_reply(status, message, "invalid_request_error")
        if not self.busy:
            self.transport.write(_STATUS_LINES[status] + b"content-type: application/json\r\ncontent-length: "
                                 + str(len(reply.body)).encode() + b"\r\nconnection: close\r\n\r\n" + reply.body)
        self.close()


# ---------------------------------------------------------------- lifecycle


async def _start(engine: Engine, host: str, port: int) -> tuple[asyncio.AbstractServer, set]:
    loop = asyncio.get_running_loop()
    conns: set = set()
    apis = Apis(engine)
    server = await loop.create_server(lambda: HttpProtocol(apis, loop, conns), host, port, backlog=2048,
                                      reuse_address=True)
    return server, conns


async def _shutdown(server: asyncio.AbstractServer, conns: set) -> None:
    server.close()
    for conn in list(conns):
        conn.close()
    await asyncio.sleep(0)


def _new_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def serve(config: SimulatorConfig, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, then close every connection and return."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        engine = Engine(config)
        server, conns = await _start(engine, host, port)
        actual = server.sockets[0].getsockname()[1]
        print(f"modelcanary simulator listening on http://{host}:{actual}/v1 "
              f"(models: {', '.join(config.models)}; time_scale {config.time_scale})", flush=True)
        await stop.wait()
        await _shutdown(server, conns)
        print("modelcanary simulator stopped", file=sys.stderr, flush=True)

    with asyncio.Runner(loop_factory=_new_loop) as runner:
        runner.run(main())


def start_in_thread(config: SimulatorConfig, host: str = "127.0.0.1", port: int = 0) -> tuple[int, Callable[[], None]]:
    """Run the simulator on its own event loop in a daemon thread; returns (port, stop)."""
    ready = threading.Event()
    box: dict = {}

    def run() -> None:
        loop = _new_loop()
        asyncio.set_event_loop(loop)
        try:
            server, conns = loop.run_until_complete(_start(Engine(config), host, port))
        except BaseException as e:  # report bind errors to the caller
            box["error"] = e
            ready.set()
            loop.close()
            return
        box["port"] = server.sockets[0].getsockname()[1]
        box["loop"] = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(_shutdown(server, conns))
            loop.close()

    thread = threading.Thread(target=run, name="modelcanary-simulator", daemon=True)
    thread.start()
    ready.wait()
    if "error" in box:
        raise box["error"]
    loop: asyncio.AbstractEventLoop = box["loop"]

    def stop() -> None:
        if thread.is_alive():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # loop already closed
                pass
            thread.join(10)

    return box["port"], stop


__all__ = ["HttpProtocol", "serve", "start_in_thread"]
