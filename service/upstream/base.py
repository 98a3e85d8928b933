"""The upstream provider extension point: who actually answers a proxied call."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class UpstreamReply:
    """A provider's HTTP answer. Non-streamed: `body` holds it all. Streamed: read `chunks()`, then
    `settle()` once the answer is over, or `release()` to abandon it."""

    status: int
    headers: dict[str, str]  # the answer's, names lower-case, the first of a repeated one
    body: bytes = b""
    _stream: AsyncIterator[bytes] | None = None
    _release: object = field(default=None, repr=False)
    _settle: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)

    def chunks(self) -> AsyncIterator[bytes]:
        assert self._stream is not None
        return self._stream

    def release(self) -> None:
        if self._release is not None:
            self._release()  # type: ignore[operator]
            self._release = None

    async def settle(self) -> None:
        """After the answer's last event: take in what is left of the body, if it comes at once, so the
        connection can serve another call; then release it (closed if the body has not ended)."""
        settle, self._settle = self._settle, None
        if settle is not None:
            await settle()
        self.release()


class TransportFailure(Exception):
    """No (whole) HTTP answer: cause is `timeout` or `connection_error`. `answered`: part of the answer
    had come, so the upstream took the request (it is never sent again)."""

    def __init__(self, cause: str, detail: str, answered: bool = False):
        super().__init__(detail)
        self.cause = cause
        self.detail = detail
        self.answered = answered


class Provider(Protocol):
    name: str
    max_retries: int

    def auth_header(self, client_auth: str | None) -> str | None:
        """The Authorization value to send upstream: the provider's own key, else the client's."""

    async def send(self, path: str, body: bytes, headers: dict[str, str], stream: bool,
                   method: str = "POST", timeout_s: float | None = None) -> UpstreamReply:
        """One attempt. Raises TransportFailure when no HTTP answer arrives. `timeout_s`: a shorter
        time than the provider's own for this attempt (what is left of the call's)."""

    def retire(self) -> None:
        """Replaced (a reload changed it): calls under way finish on their connections, which then
        close; idle connections close now."""

    async def close(self) -> None: ...
