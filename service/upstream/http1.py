"""HTTP/1.1 to one upstream origin: keep-alive connections, each an asyncio Protocol with httptools'
response parser (the parser uvicorn uses).

Why not aiohttp's client: a proxied call paid ~100 µs more CPU in it than in this (aiohttp 3.14:
133-151 against 32-38 µs per call in a loop against the simulator, 2026-12-02), a third of the
proxy's CPU per request. The upstream call is the hot path's only I/O, so it is kept this small:
one write per request, the body as the parser hands it over, one timer per call.

What it does: TLS (`https://`, the system's CAs), an egress proxy from the environment
(`HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY`: service/upstream/egress.py), chunked and length- or
close-delimited bodies, gzip/deflate bodies (decoded), a connect timeout, and either a deadline for
the whole answer or, for streams, a limit on the gap between two reads. A stream that outruns its
reader stops the socket's reads until the reader catches up; that pause is not counted in the gap.
1xx interim answers (100 Continue, 103 Early Hints) are read past. Not done, since an LLM API
needs none of it: redirects, HTTP/2.
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools

from service.upstream.egress import EgressProxy, TunnelRefused, egress_proxy, tunnel

# An idle connection is dropped after this long; servers close theirs sooner or later (uvicorn: 5 s).
KEEPALIVE_S = 30.0
# A stream's unread body: above this the socket stops reading, below half of it reads again.
HIGH_WATER = 256 * 1024
# An answer's head (status line and headers) larger than this is refused, as the proxy's own server does.
MAX_HEAD_BYTES = 64 * 1024


class HTTPFailure(Exception):
    """No (whole) HTTP answer: `timeout` when the time ran out, else `connection_error`. `answered`:
    some of the answer had come (the server took the request: sending it again could do it twice)."""

    def __init__(self, timeout: bool, detail: str, answered: bool = False):
        super().__init__(detail)
        self.timeout = timeout
        self.detail = detail
        self.answered = answered


class Origin:
    """The pool of connections to one `scheme://host:port` (no limit on their number)."""

    def __init__(self, base_url: str, connect_timeout_s: float):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.base_path = url.path.rstrip("/")
        default_port = self.port == (443 if url.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_line = b"Host: " + (host if default_port else f"{host}:{self.port}").encode("idna") + b"\r\n"
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._connect_timeout_s = connect_timeout_s
        self._egress: EgressProxy | None = None
        self._egress_problem: str | None = None
        try:
            self._egress = egress_proxy(url.scheme, self.host)
        except ValueError as e:
            self._egress_problem = str(e)  # every call fails with it: never a silent direct connection
        self._target = ""  # what precedes the path in the request line: the origin, through an http:// proxy
        if self._egress is not None and self._ssl is None:
            self._target = f"http://{host.encode('idna').decode('ascii')}:{self.port}"
            if self._egress.authorization:
                self._host_line += f"Proxy-Authorization: {self._egress.authorization}\r\n".encode("latin-1")
        self._idle: deque[Connection] = deque()
        self._open: set[Connection] = set()
        self._retired = False

    async def request(self, method: str, path: str, body: bytes, headers: dict[str, str],
                      timeout_s: float, stream: bool) -> Connection:
        """Send one request; return its connection once the answer's head is in (`status`, `headers`).
        `timeout_s` bounds the whole answer, or for a stream each wait for data. The caller reads the
        body and calls `release()` in every case."""
        head = self._head(method, path, body, headers)
        loop = asyncio.get_running_loop()
        conn = self._reusable(loop.time())
        if conn is None:
            conn = await self._connect(loop)
        conn.send(head, body, timeout_s, stream, method == "HEAD")
        try:
            await conn.head_done()
        except BaseException:
            conn.close()
            raise
        return conn

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    def retire(self) -> None:
        """No connection is reused from now on: the idle ones close, the busy ones once released."""
        self._retired = True
        while self._idle:
            self._idle.pop().close()

    def _head(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"{method} {self._target}{self.base_path}{path} HTTP/1.1\r\n".encode("latin-1"), self._host_line]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError(f"header {name!r} has a line break or a colon in its name or value")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(b"Content-Length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        return b"".join(lines)

    def _reusable(self, now: float) -> Connection | None:
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to have been closed
            if not conn.closed and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> Connection:
        if self._egress_problem is not None:
            raise HTTPFailure(False, f"could not connect: {self._egress_problem}")
        egress = self._egress
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if egress is None:
                    _, conn = await loop.create_connection(
                        lambda: Connection(self), self.host, self.port, ssl=self._ssl,
                        server_hostname=self.host if self._ssl else None)
                elif self._ssl is None:
                    _, conn = await loop.create_connection(lambda: Connection(self), egress.host, egress.port)
                else:
                    sock = await tunnel(loop, egress, self.host, self.port)
                    try:
                        _, conn = await loop.create_connection(lambda: Connection(self), sock=sock, ssl=self._ssl,
                                                               server_hostname=self.host)
                    except BaseException:
                        sock.close()
                        raise
        except TimeoutError:
            via = f" through the egress proxy {egress.address}" if egress else ""
            raise HTTPFailure(True, f"no connection{via} in {self._connect_timeout_s:g} s") from None
        except TunnelRefused as e:
            raise HTTPFailure(False, f"could not connect: {e}") from None
        except ssl.SSLCertVerificationError as e:
            raise HTTPFailure(False, f"could not connect: TLS certificate not accepted ({e.verify_message})") from None
        except ssl.SSLError as e:
            raise HTTPFailure(False, f"could not connect: TLS handshake failed ({e.reason or type(e).__name__})") from None
        except OSError as e:
            via = f" through the egress proxy {egress.address}" if egress else ""
            raise HTTPFailure(False, f"could not connect{via}: {type(e).__name__}") from None
        self._open.add(conn)
        return conn

    def _put_back(self, conn: Connection) -> None:
        if self._retired:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.append(conn)

    def _forget(self, conn: Connection) -> None:
        self._open.discard(conn)


class Connection(asyncio.Protocol):
    """One keep-alive connection, serving one request at a time."""

    def __init__(self, origin: Origin):
        self.origin = origin
        self.closed = False
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._busy = False
        self._begin()

    def _begin(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._backpressure = False  # a stream read chunk by chunk: its socket pauses above HIGH_WATER
        self._paused = False
        self._head_in = False
        self._head_bytes = 0  # of the answer so far: any is an answer begun
        self._interim = False  # a 1xx answer is being read: the final one follows it
        self._keep_alive = False
        self._done = False
        self._failure: HTTPFailure | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._encoded = False
        self._decoder: zlib._Decompress | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timeout_s = 0.0
        self._stream = False
        self._head_only = False
        self._last_read = 0.0

    # ---- the caller's side ---------------------------------------------------------------------
    def send(self, head: bytes, body: bytes, timeout_s: float, stream: bool, head_only: bool) -> None:
        assert self._transport is not None and not self._busy
        self._begin()
        self._busy = True
        self._timeout_s, self._stream, self._backpressure, self._head_only = timeout_s, stream, stream, head_only
        self._last_read = self._loop.time()
        self._timer = self._loop.call_at(self._last_read + timeout_s, self._on_timer)
        self._transport.write(head + body)

    async def head_done(self) -> None:
        while not self._head_in:
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        self._backpressure = False  # the reader takes all of it at once
        while not self._done:
            if self._paused:
                self._resume()
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    async def next_chunk(self) -> bytes:
        """The body as it comes; b"" at its end."""
        while not self._chunks:
            if self._done:
                return b""
            await self._wait()
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered < HIGH_WATER // 2:
            self._resume()
        return data

    @property
    def done(self) -> bool:
        return self._done

    def release(self) -> None:
        """Back to the pool when the answer was read to its end and may be followed by another; closed
        otherwise."""
        if self.closed:
            return
        self._busy = False
        self._cancel_timer()
        if self._done and self._failure is None and self._keep_alive and not self._head_only:
            if self._paused:  # ended while its reader was behind: idle, it must see the server's close
                self._resume()
            self.origin._put_back(self)
        else:
            self.close()

    def close(self) -> None:
        self._cancel_timer()
        if not self.closed:
            self.closed = True
            self.origin._forget(self)
            if self._transport is not None:
                self._transport.abort()

    async def _wait(self) -> None:
        if self._failure is not None:
            raise self._failure
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._failure is not None:
            raise self._failure

    def _pause(self) -> None:
        self._paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def _resume(self) -> None:
        self._paused = False
        self._last_read = self._loop.time()  # the gap counts the upstream's silence, not our pause
        if self._transport is not None:
            self._transport.resume_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, timeout: bool, detail: str) -> None:
        if self._failure is None and not self._done:
            self._failure = HTTPFailure(timeout, detail, answered=self._head_bytes > 0)
        self._wake()

    def _on_timer(self) -> None:
        self._timer = None
        if self._done or not self._busy:
            return
        if self._stream:  # a limit on each gap between reads, while reading is not paused
            now = self._loop.time()
            due = now + self._timeout_s if self._paused else self._last_read + self._timeout_s
            if due > now:
                self._timer = self._loop.call_at(due, self._on_timer)
                return
        self._fail(True, f"no answer in {self._timeout_s:g} s")
        self.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        if not self._busy or self._done:  # bytes nobody asked for: the connection can't be trusted
            self.close()
            return
        if self._stream:
            self._last_read = self._loop.time()
        if not self._head_in:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(False, f"malformed HTTP answer ({type(e).__name__})")
            self.close()
            return
        if not self._head_in and self._head_bytes > MAX_HEAD_BYTES:  # httptools would hold all of it
            self._fail(False, f"an answer head over {MAX_HEAD_BYTES // 1024} KiB")
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.origin._forget(self)
        self._cancel_timer()
        if self._busy and not self._done:
            where = "mid-body" if self._head_in else "before answering"
            if exc is not None:  # a reset, not the orderly close that may end a body
                self._fail(False, f"the connection broke {where} ({type(exc).__name__})")
            elif self._head_in and self._ends_at_close():
                self.on_message_complete()
            else:
                self._fail(False, f"the server closed the connection {where}")
        self._wake()

    # ---- httptools callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        if key not in self.headers:
            self.headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if 100 <= self.status < 200 and self.status != 101:  # interim: the final answer follows
            self._interim = True
            return
        self._keep_alive = self._parser.should_keep_alive()  # llhttp forgets it once the message is over
        self._head_in = True
        encoding = self.headers.get("content-encoding", "").strip().lower()
        self._encoded = encoding in ("gzip", "deflate", "x-gzip")
        if self._head_only:
            self._finish()
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._encoded:
            if self._decoder is None:
                self._decoder = zlib.decompressobj(wbits=47)  # gzip or zlib, by the header; none for an empty body
            try:
                body = self._decoder.decompress(body)
            except zlib.error:
                self._fail(False, "a body that does not decode")
                self.close()
                return
        if body:
            self._chunks.append(body)
            self._buffered += len(body)
            if self._buffered > HIGH_WATER and self._backpressure and not self._paused:
                self._pause()
            self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self.status, self.headers = 0, {}
            return
        if self._decoder is not None:
            rest = self._decoder.flush()
            if not self._decoder.eof:  # the compressed data stops short of its end
                self._fail(False, "a body that does not decode (cut short)")
                self.close()
                return
            if rest:
                self._chunks.append(rest)
        self._finish()

    def _finish(self) -> None:
        self._done = True
        self._cancel_timer()
        self._wake()

    def _ends_at_close(self) -> bool:
        """A body with neither a length nor chunks ends when the server closes the connection."""
        return "content-length" not in self.headers and "chunked" not in self.headers.get("transfer-encoding", "")
