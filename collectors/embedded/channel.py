"""Frames between the proxy and its shadow child over one socket, read and written on the event loop.

Each side registers the socket with its running loop (`add_reader`; `add_writer` only while a
write is left over), so no thread takes the GIL from the proxy's loop to move a frame. A frame is
a 4-byte big-endian length, one byte of kind, and the payload. Sending never blocks: what the
socket does not take now waits in memory until it is writable (the parent bounds what it sends).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Callable

READ_SIZE = 1 << 18


class Channel:
    def __init__(self, sock: socket.socket, on_frame: Callable[[bytes, bytes], None],
                 on_closed: Callable[[], None]) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._on_frame = on_frame
        self._on_closed = on_closed
        self._loop = asyncio.get_running_loop()
        self._in = bytearray()
        self._out: deque[memoryview] = deque()
        self._drained = asyncio.Event()
        self._drained.set()
        self.closed = False
        self._broken = False  # writing failed: the peer is gone; what it sent is still read, up to EOF
        self._loop.add_reader(sock.fileno(), self._readable)

    def send(self, kind: bytes, payload: bytes) -> None:
        """Queue one frame; written now if the socket takes it (dropped once the channel is closed or
        broken)."""
        if self.closed or self._broken:
            return
        frame = memoryview(b"".join(((len(payload) + 1).to_bytes(4, "big"), kind, payload)))
        if self._out:
            self._out.append(frame)
            return
        try:
            sent = self._sock.send(frame)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._break()
            return
        if sent < len(frame):
            self._out.append(frame[sent:])
            self._drained.clear()
            self._loop.add_writer(self._sock.fileno(), self._writable)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every queued frame is written (or the channel closed); False after `timeout_s`."""
        try:
            await asyncio.wait_for(self._drained.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self._close(notify=False)

    def _readable(self) -> None:
        try:
            data = self._sock.recv(READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close()
            return
        buf = self._in
        buf += data
        start = 0
        while len(buf) - start >= 5:
            size = int.from_bytes(buf[start:start + 4], "big")
            end = start + 4 + size
            if len(buf) < end:
                break
            self._on_frame(bytes(buf[start + 4:start + 5]), bytes(buf[start + 5:end]))
            start = end
            if self.closed:  # on_frame closed it
                return
        del buf[:start]

    def _writable(self) -> None:
        while self._out:
            head = self._out[0]
            try:
                sent = self._sock.send(head)
            except BlockingIOError:
                return
            except OSError:
                self._break()
                return
            if sent < len(head):
                self._out[0] = head[sent:]
                return
            self._out.popleft()
        self._loop.remove_writer(self._sock.fileno())
        self._drained.set()

    def _break(self) -> None:
        """The peer cannot be written to: stop writing, and leave closing to the reader (at EOF), so the
        frames the peer sent before it went are not lost."""
        self._broken = True
        self._out.clear()
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_writer(self._sock.fileno())
        self._drained.set()

    def _close(self, notify: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        for remove in (self._loop.remove_reader, self._loop.remove_writer):
            with contextlib.suppress(ValueError, OSError):
                remove(self._sock.fileno())
        self._out.clear()
        self._drained.set()
        self._sock.close()
        if notify:
            self._on_closed()
