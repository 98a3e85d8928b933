"""service/upstream/http1.py, the upstream HTTP/1.1 client, against small servers on real sockets:
each test's server answers with the bytes a real server could send (keep-alive, close, chunks, a
stall, garbage), and the client must do what the proxy relies on."""

from __future__ import annotations

import asyncio
import gzip
import socket
import struct
import time
from collections.abc import Awaitable, Callable

import pytest

from service.upstream.http1 import HIGH_WATER, HTTPFailure, Origin

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), b"".join(h + b"\r\n" for h in extra), body)


class Server:
    """An asyncio server on 127.0.0.1 counting its connections; `handler` serves each one."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> Server:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                pass  # the client left, or the test is over
            finally:
                writer.close()
        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def keep_alive_server(server_box: list[Server], answer: bytes = ok(b'{"ok":true}')) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            server_box[0].requests.append(await read_request(reader))
            writer.write(answer)
            await writer.drain()
    return handler


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


async def get(origin: Origin, body: bytes = b"{}", timeout_s: float = 5.0, stream: bool = False):
    return await origin.request("POST", "/chat/completions", body, {"Content-Type": "application/json"},
                                timeout_s, stream)


async def fails_as(handler: Handler, detail: str, answered: bool) -> None:
    """A call answered by `handler` fails, not for lack of time, with `detail` in its reason; `answered`:
    whether some of the answer had come (the server took the request: never to be sent again)."""
    async with Server(handler) as server:
        with pytest.raises(HTTPFailure) as failure:
            conn = await get(Origin(server.url, 5))
            await conn.read()
    assert not failure.value.timeout and detail in failure.value.detail, failure.value.detail
    assert failure.value.answered == answered, detail


def test_calls_reuse_one_connection_and_send_a_well_formed_request():
    async def go():
        box: list[Server] = []
        async with Server(keep_alive_server(box)) as server:
            box.append(server)
            origin = Origin(server.url, 5)
            for _ in range(3):
                conn = await get(origin, b'{"model":"m"}')
                assert conn.status == 200 and conn.headers["content-type"] == "application/json"
                assert await conn.read() == b'{"ok":true}'
                conn.release()
            assert server.connections == 1
            port = server.url.split(":")[2].split("/")[0]
            assert server.requests[0] == (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:" + port.encode()
                                          + b"\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n"
                                          + b'{"model":"m"}')
            await origin.close()
    run(go())


def test_a_connection_the_server_closes_is_not_reused():
    async def go():
        async def answer_then_close(reader, writer):
            await read_request(reader)
            writer.write(ok(b"1", b"connection: close"))
            await writer.drain()

        async with Server(answer_then_close) as server:
            origin = Origin(server.url, 5)
            for _ in range(2):
                conn = await get(origin)
                assert await conn.read() == b"1"
                conn.release()
            assert server.connections == 2

        async def idle_timeout(reader, writer):  # keeps the connection open, then closes it idle
            await read_request(reader)
            writer.write(ok(b"2"))
            await writer.drain()
            await asyncio.sleep(0.05)

        async with Server(idle_timeout) as server:
            origin = Origin(server.url, 5)
            conn = await get(origin)
            assert await conn.read() == b"2"
            conn.release()
            assert len(origin._idle) == 1
            while not origin._idle[-1].closed:
                await asyncio.sleep(0.01)
            conn = await get(origin)  # the closed idle one is skipped, not written to
            assert await conn.read() == b"2"
            conn.release()
            assert server.connections == 2
    run(go())


def test_a_stream_comes_chunk_by_chunk_and_a_slow_reader_pauses_the_socket():
    async def go():
        go_on = asyncio.Event()
        big = b"x" * (HIGH_WATER * 3)

        async def chunked(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"a\r\ndata: 1\n\n\n\r\n")
            await writer.drain()
            await go_on.wait()
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
            await writer.drain()

        async with Server(chunked) as server:
            origin = Origin(server.url, 5)
            conn = await get(origin, stream=True)
            assert conn.status == 200
            assert await conn.next_chunk() == b"data: 1\n\n\n"
            go_on.set()
            while not conn.done and not conn._paused:
                await asyncio.sleep(0.01)
            assert conn._paused, "a reader far behind must stop the socket's reads"
            got = b""
            while chunk := await conn.next_chunk():
                got += chunk
            assert got == big and conn.done
            conn.release()
            assert len(origin._idle) == 1
    run(go())


def test_bodies_that_end_at_close_or_come_gzipped_are_read_whole():
    async def go():
        async def until_close(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\nall of it")
            await writer.drain()

        async with Server(until_close) as server:
            origin = Origin(server.url, 5)
            conn = await get(origin)
            assert await conn.read() == b"all of it"
            conn.release()
            assert not origin._idle

        packed = gzip.compress(b'{"answer":"' + b"z" * 5000 + b'"}')
        box: list[Server] = []
        async with Server(keep_alive_server(box, ok(packed, b"content-encoding: gzip"))) as server:
            box.append(server)
            origin = Origin(server.url, 5)
            conn = await get(origin)
            assert await conn.read() == b'{"answer":"' + b"z" * 5000 + b'"}'
            conn.release()
    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_silent_server_times_out(stream: bool):
    async def go():
        async def stall(reader, writer):
            await read_request(reader)
            if stream:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
                await writer.drain()
            await asyncio.sleep(30)

        async with Server(stall) as server:
            origin = Origin(server.url, 5)
            started = time.monotonic()
            with pytest.raises(HTTPFailure) as failure:
                conn = await get(origin, timeout_s=0.3, stream=stream)
                assert await conn.next_chunk() == b"abc"
                await conn.next_chunk()
            assert failure.value.timeout
            assert time.monotonic() - started < 5
            assert not origin._open  # the timed-out connection is closed
    run(go())


def test_a_stream_that_keeps_sending_does_not_time_out_on_its_total_length():
    async def go():
        async def trickle(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(6):
                writer.write(b"1\r\n.\r\n")
                await writer.drain()
                await asyncio.sleep(0.1)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        async with Server(trickle) as server:
            origin = Origin(server.url, 5)
            conn = await get(origin, timeout_s=0.35, stream=True)
            got = b""
            while chunk := await conn.next_chunk():
                got += chunk
            assert got == b"......"
            conn.release()
    run(go())


def test_broken_answers_are_connection_errors():
    async def go():
        async def cut_short(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")
            await writer.drain()

        async def garbage(reader, writer):
            await read_request(reader)
            writer.write(b"SMTP ready\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(5)

        async def hang_up(reader, writer):
            await read_request(reader)

        async def huge_head(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (1 << 20))
            await writer.drain()
            await asyncio.sleep(5)

        for handler, where, answered in ((cut_short, "mid-body", True), (garbage, "malformed", True),
                                         (hang_up, "before answering", False), (huge_head, "over 64 KiB", True)):
            await fails_as(handler, where, answered)

        closed = Origin("http://127.0.0.1:1/v1", 5)
        with pytest.raises(HTTPFailure) as failure:
            await get(closed)
        assert not failure.value.timeout and "could not connect" in failure.value.detail
    run(go())


def test_an_unfinished_answer_closes_its_connection_and_header_injection_is_refused():
    async def go():
        async def part_then_stall(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nfirst part")
            await writer.drain()
            await asyncio.sleep(5)

        async with Server(part_then_stall) as server:
            origin = Origin(server.url, 5)
            conn = await get(origin, stream=True)
            conn.release()  # abandoned before its end: never handed to the next call
            assert conn.closed and not origin._idle
            with pytest.raises(ValueError, match="line break"):
                await origin.request("POST", "/x", b"", {"Authorization": "Bearer k\r\nX-Evil: 1"}, 5, False)
    with pytest.raises(ValueError, match="base_url"):
        Origin("ftp://example.com", 5)
    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_whole_body_above_the_high_water_is_read(stream: bool):
    """read() takes the whole body: no backpressure stops the socket, also on a stream's connection (a
    stream's error answer is read whole), paused before."""
    async def go():
        big = b'{"data":"' + b"x" * (HIGH_WATER * 8) + b'"}'
        status = b"500 Internal Server Error" if stream else b"200 OK"

        async def in_pieces(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n" % (status, len(big)))
            for i in range(0, len(big), 64 * 1024):
                writer.write(big[i:i + 64 * 1024])
                await writer.drain()
                await asyncio.sleep(0.001)
            await asyncio.sleep(30)

        async with Server(in_pieces) as server:
            origin = Origin(server.url, 5)
            conn = await get(origin, timeout_s=2, stream=stream)
            while stream and not conn._paused:  # a stream's socket has paused before read() is called
                await asyncio.sleep(0.01)
            async with asyncio.timeout(5):  # a paused socket that read() leaves paused: a stall
                assert await conn.read() == big
            conn.release()
            assert len(origin._idle) == 1
    run(go())


def test_a_connection_paused_at_its_answers_end_serves_the_next_call():
    """An answer that completes while its socket is paused (a gzip body decoding past the high water
    in one read, unread): the connection goes back to the pool reading again."""
    async def go():
        big = b"x" * (HIGH_WATER * 2)
        box: list[Server] = []

        async def gzip_then_small(reader, writer):
            await read_request(reader)
            packed = gzip.compress(big)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(packed), packed))
            await writer.drain()
            await keep_alive_server(box)(reader, writer)

        async with Server(gzip_then_small) as server:
            box.append(server)
            origin = Origin(server.url, 5)
            conn = await get(origin, stream=True)
            while not conn.done:
                await asyncio.sleep(0.01)
            assert conn._paused
            conn.release()  # the reader stopped before the (complete) body's end
            conn = await get(origin, timeout_s=1)
            assert await conn.read() == b'{"ok":true}'
            conn.release()
            assert server.connections == 1
    run(go())


def test_a_stream_paused_for_its_slow_reader_times_out_only_on_the_upstreams_silence():
    async def go():
        event = b"data: " + b"y" * 10_000 + b"\n\n"
        sent = event * 100  # 1 MB at once, then nothing more: not the body's end

        async def burst_then_silence(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"".join(b"%x\r\n%s\r\n" % (len(event), event) for _ in range(100)))
            await writer.drain()
            await asyncio.sleep(30)

        async with Server(burst_then_silence) as server:
            origin = Origin(server.url, 5)
            conn = await get(origin, timeout_s=0.3, stream=True)
            got = await conn.next_chunk()
            await asyncio.sleep(0.9)  # the reader is slow: the socket waits for it, not for the upstream
            assert conn._paused
            while len(got) < len(sent):
                got += await conn.next_chunk()
            assert got == sent
            started = time.monotonic()
            with pytest.raises(HTTPFailure) as failure:
                await conn.next_chunk()
            assert failure.value.timeout and time.monotonic() - started < 1
            conn.release()
    run(go())


def test_a_reset_or_a_gzip_stream_cut_short_is_not_a_whole_body():
    async def go():
        async def reset_mid_body(reader, writer):
            await read_request(reader)
            writer.write(b'HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{"choices":[{"message":{"content":"Hel')
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # a RST, not an orderly close

        packed = gzip.compress(b'{"answer":"' + bytes(range(256)) * 200 + b'"}')
        half = packed[:len(packed) // 2]

        async def gzip_with_length_cut(reader, writer):
            await read_request(reader)
            writer.write(ok(half, b"content-encoding: gzip"))
            await writer.drain()
            await asyncio.sleep(5)

        async def gzip_until_close_cut(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\nconnection: close\r\n\r\n" + half)
            await writer.drain()

        for handler, where in ((reset_mid_body, "mid-body"), (gzip_with_length_cut, "does not decode"),
                               (gzip_until_close_cut, "does not decode")):
            await fails_as(handler, where, answered=True)

        box: list[Server] = []
        empty = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 0\r\n\r\n"
        async with Server(keep_alive_server(box, empty)) as server:  # no bytes: an empty body, not a cut one
            box.append(server)
            origin = Origin(server.url, 5)
            conn = await get(origin)
            assert await conn.read() == b""
            conn.release()
            assert len(origin._idle) == 1
    run(go())


def test_interim_answers_are_read_past_to_the_final_one():
    """100 Continue and 103 Early Hints come before the answer: the caller gets the final status."""
    async def go():
        async def interim(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(ok(b'{"ok":true}'))
            await writer.drain()
            await asyncio.sleep(1)

        async with Server(interim) as server:
            conn = await get(Origin(server.url, 5))
            assert conn.status == 200 and "link" not in conn.headers
            assert await conn.read() == b'{"ok":true}'
            conn.release()
    run(go())
