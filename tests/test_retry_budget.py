"""service/upstream/retry.py: the route's retry budget pays only for retries that are made."""

from __future__ import annotations

import asyncio

from service.upstream.base import UpstreamReply
from service.upstream.retry import RetryBudget, send_with_retries


class Upstream:
    name = "p"
    max_retries = 2

    def __init__(self, status: int, headers: dict[str, str], body: bytes = b"{}"):
        self.status, self.headers, self.body, self.calls = status, headers, body, 0

    def auth_header(self, client_auth: str | None) -> str | None:
        return client_auth

    async def send(self, path: str, body: bytes, headers: dict[str, str], stream: bool,
                   method: str = "POST", timeout_s: float | None = None) -> UpstreamReply:
        self.calls += 1
        return UpstreamReply(self.status, dict(self.headers), body=self.body)

    async def close(self) -> None:
        pass


def test_a_retry_ruled_out_by_retry_after_or_the_deadline_spends_no_budget():
    async def go():
        budget = RetryBudget(ratio=0.0, reserve=1)  # one retry in all
        for upstream, deadline_s in ((Upstream(429, {"retry-after": "60"}), None),  # over RETRY_AFTER_CAP_S
                                     (Upstream(429, {"retry-after": "1"}), 0.5),
                                     (Upstream(503, {}), 0.0)):
            for _ in range(3):
                attempted = await send_with_retries(upstream, "/x", b"{}", {}, False, budget,
                                                    deadline_s=deadline_s)
                assert attempted.retries == 0 and attempted.reply is not None
            assert upstream.calls == 3
        await _one_retry_left(budget)
    asyncio.run(go())


async def _one_retry_left(budget: RetryBudget) -> None:
    retried = Upstream(503, {})
    attempted = await send_with_retries(retried, "/x", b"{}", {}, False, budget)
    assert attempted.retries == 1 and retried.calls == 2  # the budget's one retry is still there


def test_a_429_is_retried_as_rate_limited_but_never_one_that_says_the_quota_is_spent():
    async def go():
        causes: list[str] = []
        limited = Upstream(429, {}, b'{"error": {"type": "requests", "code": "rate_limit_exceeded"}}')
        attempted = await send_with_retries(limited, "/x", b"{}", {}, False, RetryBudget(),
                                            on_retry=lambda cause, t0, t1: causes.append(cause))
        assert (attempted.retries, limited.calls, causes) == (2, 3, ["rate_limited", "rate_limited"])
        spent = Upstream(429, {}, b'{"error": {"type": "insufficient_quota", "code": "insufficient_quota"}}')
        attempted = await send_with_retries(spent, "/x", b"{}", {}, False, RetryBudget(),
                                            on_retry=lambda cause, t0, t1: causes.append(cause))
        assert (attempted.retries, spent.calls, attempted.reply.status) == (0, 1, 429)
    asyncio.run(go())


async def _serving(handler) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


def test_a_call_the_upstream_began_to_answer_is_never_sent_again():
    """A connection that breaks once part of the answer came (a cut body, a bad chunk): the upstream
    took the request, so sending it again could do it twice (a batch, a stored response). One that
    breaks before any byte came back is retried."""
    from service.config import ProviderConfig
    from service.upstream.openai_compatible import OpenAICompatibleProvider

    async def go():
        seen: list[str] = []

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
            kind = head.split(b" ")[1].decode().rsplit("/", 1)[1]
            seen.append(kind)
            if kind == "cut":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"id\":")
            elif kind == "chunk":
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")
            await writer.drain()
            writer.close()  # "silent" closes without a byte

        server, url = await _serving(handler)
        provider = OpenAICompatibleProvider("p", ProviderConfig(base_url=url, max_retries=2))
        try:
            for kind, calls in (("cut", 1), ("chunk", 1), ("silent", 3)):
                seen.clear()
                attempted = await send_with_retries(provider, "/" + kind, b"{}", {}, False, RetryBudget())
                assert attempted.failure is not None and attempted.failure.cause == "connection_error"
                assert (len(seen), attempted.retries) == (calls, calls - 1), kind
        finally:
            await provider.close()
            server.close()
    asyncio.run(go())


def test_a_retried_call_ends_within_the_calls_time():
    """The first attempt's 503 comes late; the retry gets what is left of `timeout_s`, not all of it."""
    import time

    from service.config import ProviderConfig
    from service.upstream.openai_compatible import OpenAICompatibleProvider

    async def go():
        calls = 0

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal calls
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
            calls += 1
            if calls == 1:
                await asyncio.sleep(1.0)
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
                await writer.drain()
                writer.close()
            else:
                await asyncio.sleep(10)  # hangs

        server, url = await _serving(handler)
        provider = OpenAICompatibleProvider("p", ProviderConfig(base_url=url, timeout_s=2.0, max_retries=2))
        try:
            t0 = time.monotonic()
            attempted = await send_with_retries(provider, "/x", b"{}", {}, False, RetryBudget(), deadline_s=2.0)
            elapsed = time.monotonic() - t0
        finally:
            await provider.close()
            server.close()
        assert attempted.failure is not None and attempted.failure.cause == "timeout" and calls == 2
        assert elapsed < 2.5, elapsed
    asyncio.run(go())


def test_a_retry_the_client_cut_short_during_the_wait_is_not_counted_or_paid():
    """The client leaves while the proxy waits out a Retry-After: the second attempt is never sent, so
    no retry is counted (metric, outcome) and the route's budget keeps it."""
    async def go():
        budget = RetryBudget(ratio=0.0, reserve=1)
        causes: list[str] = []
        limited = Upstream(429, {"retry-after": "1"})
        call = asyncio.ensure_future(send_with_retries(limited, "/x", b"{}", {}, False, budget,
                                                       on_retry=lambda c, t0, t1: causes.append(c)))
        while limited.calls == 0:
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        call.cancel()
        try:
            await call
        except asyncio.CancelledError:
            pass
        assert (limited.calls, causes) == (1, [])
        await _one_retry_left(budget)
    asyncio.run(go())


def test_retry_after_ms_is_honoured_before_retry_after():
    async def go():
        limited = Upstream(429, {"retry-after-ms": "300", "retry-after": "0"})
        started = asyncio.get_running_loop().time()
        attempted = await send_with_retries(limited, "/x", b"{}", {}, False, RetryBudget())
        waited = asyncio.get_running_loop().time() - started
        assert attempted.retries == 2 and waited >= 0.6, waited
    asyncio.run(go())
