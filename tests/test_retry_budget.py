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
                   method: str = "POST") -> UpstreamReply:
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
        retried = Upstream(503, {})
        attempted = await send_with_retries(retried, "/x", b"{}", {}, False, budget)
        assert attempted.retries == 1 and retried.calls == 2  # the budget's one retry is still there
    asyncio.run(go())


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
