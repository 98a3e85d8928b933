"""Any OpenAI-compatible HTTP API, over the pooled HTTP/1.1 connections of `http1.Origin`."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from service.config import ProviderConfig
from service.upstream.base import TransportFailure, UpstreamReply
from service.upstream.http1 import Connection, HTTPFailure, Origin

# After a stream's last event, what is left of the body (its end, a ping) is read for this long at most
# so the connection goes back to the pool; a server that keeps sending gets its connection closed.
SETTLE_S = 0.5
SETTLE_BYTES = 64 * 1024


class OpenAICompatibleProvider:
    def __init__(self, name: str, cfg: ProviderConfig):
        self.name = name
        self.max_retries = cfg.max_retries
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self._api_key = key.strip() if key else None  # a key file's trailing newline is not part of it
        self._timeout_s = cfg.timeout_s
        self._origin = Origin(cfg.base_url, cfg.connect_timeout_s)

    def auth_header(self, client_auth: str | None) -> str | None:
        """The provider's own key when configured, else the client's Authorization passes through."""
        if self._api_key:
            return f"Bearer {self._api_key}"
        return client_auth

    async def send(self, path: str, body: bytes, headers: dict[str, str], stream: bool,
                   method: str = "POST", timeout_s: float | None = None) -> UpstreamReply:
        timeout = self._timeout_s if timeout_s is None else min(timeout_s, self._timeout_s)
        try:
            conn = await self._origin.request(method, path, body, headers, timeout, stream)
        except HTTPFailure as e:
            raise self._failure(e, f"no answer from {self.name} in time") from None
        reply_headers = conn.headers  # the connection starts a new dict for its next answer
        if stream and conn.status == 200:
            return UpstreamReply(conn.status, reply_headers, _stream=self._chunks(conn), _release=conn.release,
                                 _settle=lambda: _read_rest(conn))
        try:
            data = await conn.read()
        except HTTPFailure as e:
            raise self._failure(e, f"{self.name} stopped answering mid-body") from None
        finally:
            conn.release()
        return UpstreamReply(conn.status, reply_headers, body=data)

    def retire(self) -> None:
        self._origin.retire()

    async def close(self) -> None:
        await self._origin.close()

    def _failure(self, e: HTTPFailure, timed_out: str) -> TransportFailure:
        if e.timeout:
            return TransportFailure("timeout", timed_out, e.answered)
        return TransportFailure("connection_error", f"{self.name}: {e.detail}", e.answered)

    async def _chunks(self, conn: Connection) -> AsyncIterator[bytes]:
        """The body as it comes. The reader releases the connection (`UpstreamReply.settle`/`release`),
        also when it stops before the body's end."""
        try:
            while data := await conn.next_chunk():
                yield data
        except HTTPFailure as e:
            if e.timeout:
                raise TransportFailure("timeout", f"{self.name} stream stalled") from None
            raise TransportFailure("connection_error", f"{self.name} stream broke: {e.detail}") from None


async def _read_rest(conn: Connection) -> None:
    try:
        async with asyncio.timeout(SETTLE_S):
            size = 0
            while size <= SETTLE_BYTES and (data := await conn.next_chunk()):
                size += len(data)
    except (TimeoutError, HTTPFailure):
        pass  # released unfinished: the connection is closed instead of reused
