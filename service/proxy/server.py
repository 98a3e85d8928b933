"""uvicorn server that drains on SIGTERM: /readyz turns 503 at once, new requests are refused,
in-flight requests and streams finish (up to server.drain_seconds), then it exits.

Both classes lean on uvicorn internals, checked against uvicorn 0.54 (pinned `<0.55` in pyproject;
tests/test_internals.py fails if they change shape): GuardedHttpToolsProtocol subclasses the private
`uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`, overriding its parser callbacks and
reading `loop`, `transport` and `cycle.response_complete`, and setting `cycle.transport` (see
JoinedHead); DrainingServer overrides
`Server.handle_exit`, `Server.startup` and `Server.on_tick` and sets `should_exit`, `force_exit` and
`config.timeout_graceful_shutdown`, and closes `servers`; `serve --workers N` supervises its workers with
subclasses of uvicorn's `Multiprocess` and `Process` (Workers, WorkerProcess). What they buy: the 431/408 limits uvicorn lacks, one send per
whole response instead of two, chat requests answered below ASGI (`ChatCycle`, service/proxy/native.py,
started through `_start_asgi_task` and the `pipeline` queue), and a drain that the proxy decides
(readiness first, then in-flight work, bounded by server.drain_seconds).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.importer import import_from_string
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from service import metrics
from service.config import Config, ConfigError
from service.errors import error_body
from service.proxy.chat import header_map
from service.proxy.fast_path import CHAT_PATH, ProxyApp
from service.proxy.native import LEAVE_KEY, ChatAnswerer, ChatCycle, left_before_armed

if TYPE_CHECKING:
    from fastapi import FastAPI

    from service.proxy.app import Runtime

log = logging.getLogger("modelcanary.serve")

MAX_HEAD_BYTES = 64 * 1024   # request line + headers; more is refused with 431
HEAD_TIMEOUT_S = 10.0        # a connection must finish a request's headers this soon (slow-loris), and
                             # its body must not stall this long
CHAT_URL = CHAT_PATH.encode()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits it lacks: the size of a request head (unbounded
    otherwise: a client could send gigabytes of headers), the time to send it, and a body that stops
    coming (a slow-loris client could hold a connection, and the body read so far, forever). The one
    timer runs from a request's first byte until its body has come."""

    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._answerer = self.app.native_chat() if isinstance(self.app, ProxyApp) else None
        self._head_bytes = 0      # the request line and the headers ended so far
        self._unended_bytes = 0   # bytes read since the last header ended, while none did (one long header)
        self._in_head = False
        self._in_body = False     # the head has come and the body not yet: the timer watches it come
        self._body_bytes = 0      # of the request's body, so far
        self._body_mark = 0       # _body_bytes when the timer last fired
        self._refused = False
        self._refusal: bytes | None = None  # the refusal's bytes, held while earlier answers go out
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        cycle = self.cycle
        super().connection_lost(exc)
        if isinstance(cycle, ChatCycle):
            cycle.client_left()
        elif cycle is not None and not cycle.response_complete:
            scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]  # ASGI's scope, with our key in it
            if (left := scope.pop(LEAVE_KEY, None)) is not None:
                left()
            else:  # nobody waits yet: whoever arms the callback later is told at once
                scope[LEAVE_KEY] = left_before_armed

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        in_head = self._in_head
        super().data_received(data)
        if in_head and self._in_head and not self._refused:  # httptools holds a header that has not ended
            self._unended_bytes += len(data)
            self._count_head(0)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = self._unended_bytes = 0
        self._in_head = True
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._unended_bytes = 0
        self._count_head(len(name) + len(value) + 4)
        if not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._refused:
            return
        self._in_body = True
        self._body_bytes = self._body_mark = 0
        if self._answerer is not None and self.url == CHAT_URL and self.parser.get_method() == b"POST":
            cycle = self._chat_cycle(self._answerer)
            if cycle is not None:
                self._begin(cycle)
                return
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and self.cycle is not None:
            self.cycle.transport = JoinedHead(self.transport, self.loop)  # type: ignore[assignment]

    def _chat_cycle(self, answerer: ChatAnswerer) -> ChatCycle | None:
        """A cycle for a chat request answered below ASGI, or None for one that ASGI's route takes: a body
        that is chunked, undeclared or over the limit (its 413), an `Expect: 100-continue`, an upgrade."""
        headers = header_map(self.headers)
        declared = headers.get("content-length")
        if (declared is None or not declared.isdigit() or int(declared) > answerer.body_limit()
                or "transfer-encoding" in headers or self.expect_100_continue or self.parser.should_upgrade()):
            return None
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        return ChatCycle(self.transport, self.flow, headers, keep_alive, self.on_response_complete, answerer)

    def _begin(self, cycle: ChatCycle) -> None:
        """As uvicorn starts its own cycles: now, or queued behind a pipelined request still answering."""
        existing = self.cycle
        self.cycle = cycle  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            self._start_asgi_task(cycle, self.app)  # type: ignore[arg-type]
        else:
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, self.app))  # type: ignore[arg-type]

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            self._body_bytes += len(body)
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._cancel_head_timer()
        if not self._refused:
            super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse: the same answer, OpenAI-shaped."""
        if not self._refused:
            self._refuse(400, msg, "invalid_http_request")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._refusal is not None and not self._answering():
            self._send_refusal()

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if max(self._head_bytes, self._unended_bytes) > self.max_head_bytes and not self._refused:
            self._refuse(431, f"request headers exceed {self.max_head_bytes} bytes", "headers_too_large")

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._in_body:
            self._body_timeout()
            return
        if self.cycle is not None and not self.cycle.response_complete:  # a response is still going out
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)
            return
        if not self.transport.is_closing():
            self._refuse(408, f"request headers not received within {self.head_timeout_s:g} s", "request_timeout")

    def _body_timeout(self) -> None:
        """A body that came on, or waits for us (reading paused, queued behind a pipelined request),
        gets another period; one that stalled ends the connection, with a 408 unless an answer began."""
        if self._body_bytes > self._body_mark or self.flow.read_paused or self.pipeline:
            self._body_mark = self._body_bytes
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)
            return
        self._in_body = False
        self._refused = True
        cycle = self.cycle
        if isinstance(cycle, ChatCycle) or (cycle is not None and not cycle.response_started):
            body = error_body(408, f"request body stalled for {self.head_timeout_s:g} s", "request_timeout",
                              type_="invalid_request_error")
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Stop reading and answer `status`, then close: once the answers to the requests before this
        one (pipelined on the connection) have gone out, never in the middle of one."""
        self._refused = True
        self._cancel_head_timer()
        body = error_body(status, message, code, type_="invalid_request_error")
        reason = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        self._refusal = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                         b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        if not self._answering():
            self._send_refusal()

    def _answering(self) -> bool:
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def _send_refusal(self) -> None:
        refusal, self._refusal = self._refusal, None
        if refusal is not None and not self.transport.is_closing():
            self.transport.write(refusal)
        self.transport.close()


class JoinedHead:
    """The transport as one response cycle sees it: its first write (the response head) waits for the
    next one (the body) in the same turn of the loop, and both go out in one send. uvicorn writes them
    apart: two syscalls, and on loopback each runs the receiver's TCP work too. A measured ~10% of a
    busy proxy's CPU (py-spy, 2026-12-02). A head with no body in the same turn (a stream waiting for
    its first event) goes out at the turn's end."""

    __slots__ = ("_transport", "_loop", "_held", "_writes")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._writes = 0

    def write(self, data: bytes) -> None:
        self._writes += 1
        if self._writes == 1:
            self._held = data
            self._loop.call_soon(self._flush)
        elif self._held is not None:
            data, self._held = self._held + data, None
            self._transport.write(data)
        else:
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def _flush(self) -> None:
        if self._held is not None:
            data, self._held = self._held, None
            self._transport.write(data)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self._drain_started: float | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.config.workers > 1:  # a worker the supervisor replaces (SIGHUP) retires on RETIRE_SIGNAL
            asyncio.get_running_loop().add_signal_handler(RETIRE_SIGNAL, self.retire)

    def retire(self) -> None:
        """A worker being replaced: it stops taking connections (its siblings and its replacement take
        them, so no client is refused) and finishes what is in flight, as a drain does."""
        if self._drain_started is None:
            for listener in self.servers:
                listener.close()
            self._drain_started = time.monotonic()
            log.info("retiring: %d request(s) in flight, up to %.0f s", self.runtime.proxy.in_flight,
                     self.runtime.config.server.drain_seconds)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        proxy = self.runtime.proxy
        if self._drain_started is None:
            self._drain_started = time.monotonic()
            proxy.draining = True
            log.warning("draining: %d request(s) in flight, up to %.0f s", proxy.in_flight,
                        self.runtime.config.server.drain_seconds)
            return
        if sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_started is not None and not self.should_exit:
            waited = time.monotonic() - self._drain_started
            if self.runtime.proxy.in_flight <= 0:
                self.should_exit = True
            elif waited >= self.runtime.config.server.drain_seconds:
                # the drain time is used up: cut what is left now, not after uvicorn's own graceful wait
                self.runtime.proxy.cutting = True
                self.config.timeout_graceful_shutdown = 0.1  # type: ignore[assignment]  # seconds; annotated int
                self.should_exit = True
        return await super().on_tick(counter)


RETIRE_SIGNAL = signal.SIGUSR1   # from the supervisor to a worker it replaced
HEALTHCHECK_S = 30               # a worker must answer the supervisor's ping, and start, this soon: its
                                 # imports alone take seconds on a busy machine (uvicorn's default is 5)
WorkerFactory = Callable[[Config, str, int], "FastAPI"]  # (config, its path, N): one worker's app


class WorkerProcess(Process):
    """One worker of `serve --workers N`. Its app is built from the config the supervisor holds (checked
    there, at start and at each SIGHUP), never from the file as it is now, so every worker, a replacement
    too, runs the same config; it is served by a DrainingServer. A worker whose app cannot be built exits
    with uvicorn's STARTUP_FAILURE, after one line saying why."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], app_config: Config,
                 config_path: str) -> None:
        self.app_config = app_config
        self.config_path = config_path
        super().__init__(config, sockets)

    def pong(self) -> None:
        self.child_conn.recv()
        self.child_conn.send(self._server is not None and self._server.started)

    def target(self, sockets: list[socket.socket] | None = None) -> None:  # in the worker process
        threading.Thread(target=self.always_pong, daemon=True).start()
        try:
            factory: WorkerFactory = import_from_string(self.config.app)
            app = factory(self.app_config, self.config_path, self.config.workers)
        except (ConfigError, OSError) as e:
            text = e.explain() if isinstance(e, ConfigError) else str(e)
            log.error("worker %d did not start: %s", os.getpid(), text)
            sys.exit(STARTUP_FAILURE)
        except Exception:
            log.exception("worker %d did not start", os.getpid())
            sys.exit(STARTUP_FAILURE)
        self.config.app, self.config.factory = app, False
        self._server = DrainingServer(self.config, app.state.runtime)
        self._server.run(sockets)


class Workers(Multiprocess):
    """uvicorn's supervisor of `serve --workers N` (a worker that dies is replaced, SIGTERM and SIGINT
    stop all, SIGTTIN/SIGTTOU add or remove one), with what production needs of it:
    - a worker whose startup fails stops them all, and `startup_failed` says so (never a restart loop);
    - SIGHUP checks the file first (`reload`: the new config, or ConfigError): a bad one changes nothing;
      then each worker is replaced by one on the new config, the old one retiring (RETIRE_SIGNAL);
    - a worker that ended leaves the metrics (its in-flight requests no longer count)."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], app_config: Config,
                 config_path: str, reload: Callable[[Config], Config]) -> None:
        super().__init__(config, sockets)
        self.app_config = app_config
        self.config_path = config_path
        self.reload = reload
        self.retiring: list[Process] = []
        self.startup_failed = False

    def spawn(self) -> WorkerProcess:
        process = WorkerProcess(self.config, self.sockets, self.app_config, self.config_path)
        process.start()
        return process

    def init_processes(self) -> None:
        self.processes = [self.spawn() for _ in range(self.processes_num)]

    def run(self) -> None:
        super().run()
        for process in self.retiring:
            process.join()
            ended(process)

    def keep_subprocess_alive(self) -> None:
        for process in [p for p in self.retiring if not p.process.is_alive()]:
            process.join()
            ended(process)
            self.retiring.remove(process)
        if self.should_exit.is_set():
            return
        for idx, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()  # hung, or gone
            process.join()
            ended(process)
            if process.exitcode == STARTUP_FAILURE:
                log.error("worker %s failed to start: stopping every worker", process.pid)
                self.startup_failed = True
                self.should_exit.set()
                return
            if self.should_exit.is_set():
                return
            log.warning("worker %s ended (exit code %s): starting another", process.pid, process.exitcode)
            self.processes[idx] = self.spawn()

    def handle_hup(self) -> None:
        try:
            config = self.reload(self.app_config)
        except ConfigError as e:
            log.error("SIGHUP: config not reloaded: %s", "; ".join(e.problems))
            return
        log.info("SIGHUP: restarting %d worker(s) with %s", len(self.processes), self.config_path)
        running, self.app_config = self.app_config, config
        for idx, old in enumerate(self.processes):
            if self.should_exit.is_set():
                return
            new = self.spawn()
            if not new.wait_until_ready(self.config.timeout_worker_healthcheck, self.should_exit):
                new.kill()
                new.join()
                ended(new)
                self.app_config = running  # a worker that dies from now on comes back as those left run
                log.error("SIGHUP: a new worker did not start within %d s; %d of %d workers run the new file, "
                          "the others the one before: send SIGHUP again", self.config.timeout_worker_healthcheck,
                          idx, len(self.processes))
                return
            if old.process.is_alive() and old.pid is not None:
                os.kill(old.pid, RETIRE_SIGNAL)
            self.retiring.append(old)
            self.processes[idx] = new

    def handle_ttin(self) -> None:
        self.processes_num += 1
        self.processes.append(self.spawn())

    def handle_ttou(self) -> None:
        if self.processes_num > 1:
            self.processes_num -= 1
            process = self.processes.pop()
            if process.process.is_alive() and process.pid is not None:
                os.kill(process.pid, RETIRE_SIGNAL)
            self.retiring.append(process)


def ended(process: Process) -> None:
    """A worker process that has ended (joined): what it was doing no longer counts in /metrics."""
    if process.pid is not None:
        metrics.worker_ended(process.pid)


def listening_socket(host: str, port: int) -> socket.socket:
    """The proxy's socket, bound before the app starts (as uvicorn's `Config.bind_socket`, without
    its `sys.exit`): an address that can't be had fails before the shadow child or controller start."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
