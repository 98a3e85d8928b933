"""Any OpenAI-compatible HTTP API, over one pooled aiohttp session per provider."""

from __future__ import annotations

import asyncio
import os

import aiohttp

from service.config import ProviderConfig
from service.upstream.base import TransportFailure, UpstreamReply

# Response headers worth passing back to the client.
FORWARD_HEADERS = ("content-type", "retry-after", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                   "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                   "x-ratelimit-reset-tokens", "openai-processing-ms")
# After a stream's last event, what is left of the body (its end, a ping) is read for this long at most
# so the connection goes back to the pool; a server that keeps sending gets its connection closed.
SETTLE_S = 0.5
SETTLE_BYTES = 64 * 1024


class OpenAICompatibleProvider:
    def __init__(self, name: str, cfg: ProviderConfig):
        self.name = name
        self.max_retries = cfg.max_retries
        self._base = cfg.base_url
        self._api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self._timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, connect=cfg.connect_timeout_s,
                                              sock_read=cfg.timeout_s)
        self._stream_timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s,
                                                     sock_read=cfg.timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                                  skip_auto_headers=("User-Agent",), auto_decompress=True)
        return self._session

    def auth_header(self, client_auth: str | None) -> str | None:
        """The provider's own key when configured, else the client's Authorization passes through."""
        if self._api_key:
            return f"Bearer {self._api_key}"
        return client_auth

    async def send(self, path: str, body: bytes, headers: dict[str, str], stream: bool,
                   method: str = "POST") -> UpstreamReply:
        session = self._get_session()
        url = self._base + path
        try:
            resp = await session.request(method, url, data=body or None, headers=headers,
                                         timeout=self._stream_timeout if stream else self._timeout)
        except (TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise TransportFailure("timeout", f"no answer from {self.name} in time") from e
        except aiohttp.ClientError as e:
            raise TransportFailure("connection_error", f"{self.name}: {type(e).__name__}") from e
        reply_headers = {k: v for k in FORWARD_HEADERS if (v := resp.headers.get(k)) is not None}
        if stream and resp.status == 200:
            return UpstreamReply(resp.status, reply_headers, _stream=_iter(resp, self.name), _release=resp.release,
                                 _settle=lambda: _read_rest(resp))
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise TransportFailure("timeout", f"{self.name} stopped answering mid-body") from e
        except aiohttp.ClientError as e:
            raise TransportFailure("connection_error", f"{self.name}: {type(e).__name__} mid-body") from e
        finally:
            resp.release()
        return UpstreamReply(resp.status, reply_headers, body=data)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _iter(resp: aiohttp.ClientResponse, name: str):
    """The body as it comes. The reader releases the response (`UpstreamReply.settle`/`release`),
    also when it stops before the body's end."""
    try:
        async for data in resp.content.iter_any():
            yield data
    except (TimeoutError, aiohttp.ServerTimeoutError) as e:
        raise TransportFailure("timeout", f"{name} stream stalled") from e
    except aiohttp.ClientError as e:
        raise TransportFailure("connection_error", f"{name} stream broke: {type(e).__name__}") from e


async def _read_rest(resp: aiohttp.ClientResponse) -> None:
    try:
        async with asyncio.timeout(SETTLE_S):
            size = 0
            while size <= SETTLE_BYTES and (data := await resp.content.readany()):
                size += len(data)
    except (TimeoutError, aiohttp.ClientError):
        pass  # released unfinished: aiohttp closes the connection instead of reusing it
