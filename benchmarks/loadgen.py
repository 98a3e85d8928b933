"""A small load generator that runs in its own process: HTTP/1.1 keep-alive over raw asyncio
(uvloop) with httptools parsing, so it costs little CPU next to the server it measures.

Open loop (`--rate R`): request i is due at t0 + i/R whatever happened before; its latency is
measured from that scheduled time, so queueing anywhere (in the server, or waiting for a free
connection) is counted and not hidden by coordinated omission. wrk and hey are closed-loop.

Closed loop (`--concurrency C --requests N`): C connections each send their next request as soon
as the previous answer is in, until N answers (used to push many requests through quickly).

`--vary` makes every request body distinct (a counter in the last message), as real traffic is.

    python benchmarks/loadgen.py URL --rate 500 --duration 10 --body '{"model": ...}' --out r.json

Prints (and writes with --out) one JSON object: latencies in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
    uvloop = None


class Conn(asyncio.Protocol):
    def __init__(self, gen: Generator):
        self.gen = gen
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.started = 0.0       # the scheduled (open loop) or actual (closed loop) send time
        self.busy = False
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.busy:
            self.busy = False
            self.gen.failed(self, "connection_lost")
        elif self in self.gen.conns:
            self.gen.conns.remove(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if not self.busy:  # an answer to no request: a server closing an idle connection (408, say)
            self.gen.unsolicited[status] = self.gen.unsolicited.get(status, 0) + 1
            self.closed = True
            self.transport.close()
            return
        self.busy = False
        self.gen.completed(self, status, self.parser.should_keep_alive())

    def send(self, payload: bytes, started: float) -> None:
        self.started = started
        self.busy = True
        self.transport.write(payload)


class Generator:
    def __init__(self, url: str, body: bytes, vary: bool, headers: dict[str, str], max_connections: int):
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.path = parts.path or "/"
        self.body = body
        self.vary = vary
        self.max_connections = max_connections
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                     f"Content-Type: application/json\r\n{extra}Content-Length: ").encode()
        self.fixed = self._payload(body)
        self.counter = 0
        self.loop = asyncio.get_running_loop()
        self.idle: deque[Conn] = deque()
        self.conns: list[Conn] = []
        self.opening = 0
        self.waiting: deque[float] = deque()   # scheduled times waiting for a connection
        self.latencies: list[float] = []
        self.lags: list[float] = []           # how late requests went out vs their schedule
        self.status: dict[int, int] = {}
        self.errors: dict[str, int] = {}
        self.unsolicited: dict[int, int] = {}
        self.sent = 0
        self.last_done = 0.0
        self.outstanding = 0
        self.on_done = None

    def _payload(self, body: bytes) -> bytes:
        return self.head + str(len(body)).encode() + b"\r\n\r\n" + body

    def payload(self) -> bytes:
        if not self.vary:
            return self.fixed
        self.counter += 1
        # the body ends with `"}]}` (last message's content); put a counter before its closing quote
        cut = self.body.rfind(b'"')
        body = self.body[:cut] + b" #%d" % self.counter + self.body[cut:]
        return self._payload(body)

    async def open(self, n: int) -> None:
        await asyncio.gather(*(self._open_one() for _ in range(n)))

    async def _open_one(self) -> None:
        self.opening += 1
        try:
            _, conn = await self.loop.create_connection(lambda: Conn(self), self.host, self.port)
        except OSError as e:
            self.errors[type(e).__name__] = self.errors.get(type(e).__name__, 0) + 1
            return
        finally:
            self.opening -= 1
        self.conns.append(conn)
        self._release(conn)

    def _release(self, conn: Conn) -> None:
        if conn.closed:
            return
        if self.waiting:
            started = self.waiting.popleft()
            self.lags.append(time.perf_counter() - started)
            conn.send(self.payload(), started)
        else:
            self.idle.append(conn)

    def submit(self, started: float) -> None:
        """Send a request scheduled at `started` now, or as soon as a connection is free."""
        self.sent += 1
        self.outstanding += 1
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                self.lags.append(time.perf_counter() - started)
                conn.send(self.payload(), started)
                return
        self.waiting.append(started)
        if len(self.conns) + self.opening < self.max_connections:
            self.loop.create_task(self._open_one())

    def completed(self, conn: Conn, status: int, keep_alive: bool) -> None:
        self.last_done = time.perf_counter()
        self.latencies.append(self.last_done - conn.started)
        self.status[status] = self.status.get(status, 0) + 1
        self.outstanding -= 1
        if keep_alive:
            self._release(conn)
        else:
            conn.transport.close()
            self.conns.remove(conn)
        if self.on_done is not None:
            self.on_done(conn)

    def failed(self, conn: Conn, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
        self.outstanding -= 1
        if conn in self.conns:
            self.conns.remove(conn)
        if self.on_done is not None:
            self.on_done(None)

    def close(self) -> None:
        for conn in self.conns:
            if conn.transport is not None:
                conn.transport.close()


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def summary(gen: Generator, elapsed: float, mode: dict) -> dict:
    lat = sorted(gen.latencies)
    lags = sorted(gen.lags)
    ok = sum(n for s, n in gen.status.items() if 200 <= s < 300)
    ms = 1000.0
    out = {**mode, "sent": gen.sent, "completed": len(lat), "ok": ok, "status": gen.status,
           "errors": sum(gen.errors.values()) + (len(lat) - ok), "socket_errors": gen.errors,
           "unanswered": gen.outstanding, "elapsed_s": round(elapsed, 3),
           "achieved_rps": round(len(lat) / elapsed, 1) if elapsed > 0 else None,
           "connections": len(gen.conns), "idle_closed_by_server": gen.unsolicited}
    for q in (50, 90, 99, 99.9):
        v = percentile(lat, q)
        out[f"p{q:g}_ms".replace(".", "")] = round(v * ms, 4) if v is not None else None
    out["max_ms"] = round(lat[-1] * ms, 4) if lat else None
    out["mean_ms"] = round(sum(lat) / len(lat) * ms, 4) if lat else None
    v = percentile(lags, 99)
    out["send_lag_p99_ms"] = round(v * ms, 4) if v is not None else None
    return out


async def open_loop(gen: Generator, rate: float, duration_s: float, connections: int, drain_s: float) -> dict:
    await gen.open(connections)
    n = int(rate * duration_s)
    t0 = time.perf_counter() + 0.05
    for i in range(n):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        gen.submit(due)
    deadline = time.perf_counter() + drain_s
    while gen.outstanding > 0 and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    # answered per second: over the sending window, or until the last answer when they fell behind
    elapsed = max(n / rate, gen.last_done - t0)
    return summary(gen, elapsed, {"mode": "open", "rate": rate, "duration_s": duration_s})


async def closed_loop(gen: Generator, concurrency: int, requests: int, timeout_s: float) -> dict:
    await gen.open(concurrency)
    done = asyncio.Event()
    remaining = [requests - min(requests, concurrency)]

    def next_request(conn: Conn | None) -> None:
        if gen.outstanding == 0 and remaining[0] <= 0:
            done.set()
        elif remaining[0] > 0:
            remaining[0] -= 1
            gen.submit(time.perf_counter())

    gen.on_done = next_request
    t0 = time.perf_counter()
    for _ in range(min(requests, concurrency)):
        gen.submit(time.perf_counter())
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    except TimeoutError:
        pass
    return summary(gen, time.perf_counter() - t0, {"mode": "closed", "concurrency": concurrency, "requests": requests})


async def main_async(args: argparse.Namespace) -> dict:
    headers = dict(h.split(":", 1) for h in args.header)
    headers = {k.strip(): v.strip() for k, v in headers.items()}
    body = args.body.encode() if args.body else open(args.body_file, "rb").read()
    gen = Generator(args.url, body, args.vary, headers, args.max_connections)
    try:
        if args.rate:
            return await open_loop(gen, args.rate, args.duration, args.connections, args.drain)
        return await closed_loop(gen, args.concurrency, args.requests, args.timeout)
    finally:
        gen.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("--body")
    p.add_argument("--body-file")
    p.add_argument("--header", action="append", default=["Authorization: Bearer sk-bench"])
    p.add_argument("--vary", action="store_true", help="make each request body distinct")
    p.add_argument("--rate", type=float, help="open loop: requests per second")
    p.add_argument("--duration", type=float, default=10.0, help="open loop: seconds of sending")
    p.add_argument("--connections", type=int, default=32, help="open loop: connections opened up front")
    p.add_argument("--max-connections", type=int, default=1024)
    p.add_argument("--drain", type=float, default=10.0, help="open loop: seconds to wait for the last answers")
    p.add_argument("--concurrency", type=int, default=16, help="closed loop: connections")
    p.add_argument("--requests", type=int, default=10000, help="closed loop: answers to collect")
    p.add_argument("--timeout", type=float, default=600.0, help="closed loop: give up after this many seconds")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not args.body and not args.body_file:
        p.error("give --body or --body-file")
    result = uvloop.run(main_async(args)) if uvloop is not None else asyncio.run(main_async(args))
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
