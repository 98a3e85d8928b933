"""A small TCP fault proxy for tests: sits between modelcanary and the simulator or the broker.

Modes, switchable at runtime (`set_mode`), applied to new and to open connections:

- ``pass``      forward bytes both ways
- ``drop``      close every connection at once (new ones are accepted and closed: the peer sees EOF)
- ``delay``     forward, each chunk held for ``delay_s`` first
- ``reset``     forward until ``after_bytes`` bytes came back from the target on a connection, then
                send the client a TCP RST (SO_LINGER 0); ``after_bytes=0`` resets at once
- ``blackhole`` accept and read, forward nothing and answer nothing (the peer waits for its timeout);
                leaving it resets the connections it held (what they sent is lost, their streams are broken)
- ``reply``     answer each new connection's first request with the raw bytes ``reply`` (a whole HTTP
                response, malformed on purpose) and close: an upstream that returns garbage

With `tls` (a server-side `ssl.SSLContext`) it terminates TLS, as a provider's load balancer does:
clients speak HTTPS to it, and it forwards plain bytes.

It runs its own event loop on a thread, so sync tests drive it directly. It counts connections
and HTTP requests sent to the target (request lines seen client → target), which is how a test
counts upstream calls without trusting the proxy's own numbers.

`ProxiedBroker` is a Tansu broker that advertises the fault proxy's port, so Kafka clients (which
connect to the advertised address after bootstrap) go through the fault proxy too.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import ssl
import struct
import subprocess
import threading
from dataclasses import dataclass, field

from tests.fixtures.broker import _TANSU_ENV, TansuBroker

MODES = ("pass", "drop", "delay", "reset", "blackhole", "reply")
# A request line ends a CRLF-terminated line (after a keep-alive body, the line starts with body bytes).
_REQUEST_LINE = re.compile(rb"(?:GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) /\S* HTTP/1\.[01]$")


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    target: asyncio.StreamWriter | None = None
    back_bytes: int = 0
    tail: bytes = b""
    tasks: list[asyncio.Task] = field(default_factory=list)


class FaultProxy:
    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1", port: int = 0,
                 capture_bytes: int = 0, tls: ssl.SSLContext | None = None):
        self.target = (target_host, target_port)
        self.host = host
        self.tls = tls
        self._want_port = port
        self.port = 0
        self.mode = "pass"
        self.delay_s = 0.0
        self.after_bytes = 0
        self.reply = b""
        self.capture_bytes = capture_bytes  # keep up to this many bytes sent to the target (tests inspect them)
        self.captured = bytearray()
        self.connections = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None

    # ---- control (any thread) -------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._server = loop.run_until_complete(
                asyncio.start_server(self._accept, self.host, self._want_port, reuse_address=True, ssl=self.tls))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._close_all())
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name=f"fault-proxy-{self.target[1]}", daemon=True)
        self._thread.start()
        if not ready.wait(5):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
        self._loop = None

    def set_mode(self, mode: str, *, delay_s: float = 0.0, after_bytes: int = 0, reply: bytes = b"") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.reply = reply
        if self._loop is None:
            self.delay_s, self.after_bytes, self.mode = delay_s, after_bytes, mode
            return
        asyncio.run_coroutine_threadsafe(self._apply(mode, delay_s, after_bytes), self._loop).result(5)

    def reset_counts(self) -> None:
        with self._lock:
            self.connections = 0
            self.requests = 0
            self.captured.clear()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the loop -------------------------------------------------------------------------------
    async def _apply(self, mode: str, delay_s: float, after_bytes: int) -> None:
        """Switch on the loop: `after_bytes` counts from now on every open connection."""
        healed = self.mode == "blackhole" and mode != "blackhole"
        self.delay_s, self.after_bytes, self.mode = delay_s, after_bytes, mode
        for conn in list(self._conns):
            conn.back_bytes = 0
            if healed:
                self._reset(conn)  # bytes were swallowed: those connections are broken for good
            elif mode == "drop":
                self._close(conn)
            elif mode == "reset" and after_bytes <= 0:
                self._reset(conn)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self.connections += 1
        conn = _Conn(writer)
        if self.mode == "drop":
            writer.close()
            return
        if self.mode == "reset" and self.after_bytes <= 0:
            self._reset(conn)
            return
        self._conns.add(conn)
        try:
            if self.mode == "blackhole":
                await self._swallow(reader, conn)
                return
            if self.mode == "reply":
                await self._reply(reader, conn)
                return
            try:
                t_reader, t_writer = await asyncio.open_connection(*self.target)
            except OSError:
                self._reset(conn)
                return
            conn.target = t_writer
            up = asyncio.create_task(self._pipe(reader, t_writer, conn, upstream=True))
            down = asyncio.create_task(self._pipe(t_reader, writer, conn, upstream=False))
            conn.tasks = [up, down]
            await asyncio.wait(conn.tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._close(conn)
            self._conns.discard(conn)

    async def _reply(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 1 << 20:
            data = await reader.read(65536)
            if not data:
                return
            head += data
        self._count(conn, head)
        conn.client.write(self.reply)
        await conn.client.drain()
        conn.client.close()

    async def _swallow(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        while await reader.read(65536):
            pass

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn,
                    upstream: bool) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                mode = self.mode
                if mode == "drop":
                    break
                if mode == "blackhole":
                    continue  # read and forget: nothing goes through, in either direction
                if mode == "reply" and upstream:  # an open connection answers the next request with garbage too
                    self._count(conn, data)
                    conn.client.write(self.reply)
                    await conn.client.drain()
                    break
                if mode == "delay" and self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                if upstream:
                    self._count(conn, data)
                else:
                    if mode == "reset" and conn.back_bytes + len(data) > self.after_bytes:
                        keep = max(0, self.after_bytes - conn.back_bytes)
                        if keep:
                            writer.write(data[:keep])
                            await writer.drain()
                        self._reset(conn)
                        return
                    conn.back_bytes += len(data)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            if not upstream and self.mode != "blackhole":
                self._close(conn)

    def _count(self, conn: _Conn, data: bytes) -> None:
        lines = (conn.tail + data).split(b"\r\n")
        conn.tail = lines.pop()[-256:]  # the unfinished line (a request line is short)
        n = sum(1 for line in lines if _REQUEST_LINE.search(line[-2048:]))
        if self.capture_bytes and len(self.captured) < self.capture_bytes:
            with self._lock:
                self.captured += data[: self.capture_bytes - len(self.captured)]
        if n:
            with self._lock:
                self.requests += n

    def _reset(self, conn: _Conn) -> None:
        sock = conn.client.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        conn.client.transport.abort()
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        try:
            current = asyncio.current_task()
        except RuntimeError:
            current = None
        for task in conn.tasks:
            if task is not current:
                task.cancel()
        for w in (conn.client, conn.target):
            if w is not None and not w.is_closing():
                w.transport.abort() if self.mode in ("drop", "reset") else w.close()

    async def _close_all(self) -> None:
        for conn in list(self._conns):
            self._close(conn)
        if self._server is not None:
            self._server.close()


class ProxiedBroker(TansuBroker):
    """Tansu that advertises the fault proxy's port, so every client connection goes through it."""

    def __init__(self, advertised_port: int, **kw):
        super().__init__(**kw)
        self.advertised_port = advertised_port

    def start(self, timeout_s: float = 15.0) -> ProxiedBroker:
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "broker", "--listener-url", f"tcp://127.0.0.1:{self.port}",
                 "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised_port}",
                 "--storage-engine", "memory://tansu/"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.wait_ready(timeout_s)
        return self
