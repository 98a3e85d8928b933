"""Upstream retries: exponential backoff with full jitter, Retry-After, and a per-route budget."""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.upstream.base import Provider, TransportFailure, UpstreamReply
from service.upstream.errors import RETRYABLE_STATUS, error_cause, json_object

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
RETRY_AFTER_CAP_S = 10.0


class RetryBudget:
    """Retries may add at most `ratio` of the route's requests over a sliding window, plus a reserve."""

    def __init__(self, ratio: float = 0.2, window_s: int = 10, reserve: int = 3):
        self.ratio = ratio
        self.window_s = window_s
        self.reserve = reserve
        self._requests = [0] * window_s
        self._retries = [0] * window_s
        self._stamp = [0] * window_s

    def _slot(self, now: float) -> int:
        sec = int(now)
        i = sec % self.window_s
        if self._stamp[i] != sec:
            self._stamp[i], self._requests[i], self._retries[i] = sec, 0, 0
        return i

    def _totals(self, now: float) -> tuple[int, int]:
        oldest = int(now) - self.window_s + 1
        reqs = sum(r for r, s in zip(self._requests, self._stamp) if s >= oldest)
        rets = sum(r for r, s in zip(self._retries, self._stamp) if s >= oldest)
        return reqs, rets

    def on_request(self, now: float | None = None) -> None:
        self._requests[self._slot(now or time.monotonic())] += 1

    def try_spend(self, now: float | None = None) -> float | None:
        """The time the retry was paid at (for `refund`), or None when the budget is spent."""
        now = now or time.monotonic()
        reqs, rets = self._totals(now)
        if rets >= self.ratio * reqs + self.reserve:
            return None
        self._retries[self._slot(now)] += 1
        return now

    def refund(self, paid_at: float) -> None:
        """Give back a retry that was never sent (its second left the window: nothing to give back)."""
        i = int(paid_at) % self.window_s
        if self._stamp[i] == int(paid_at) and self._retries[i] > 0:
            self._retries[i] -= 1


def hinted_delay_s(headers: dict[str, str]) -> float | None:
    """The upstream's own wait: `retry-after-ms` first (OpenAI's), then `retry-after`."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    return retry_after_s(headers.get("retry-after"))


def retry_after_s(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(slots=True)
class Attempted:
    """The last attempt's result and how many retries it took."""

    reply: UpstreamReply | None
    failure: TransportFailure | None
    retries: int


def _retryable_reply(reply: UpstreamReply) -> bool:
    return reply.status in RETRYABLE_STATUS


async def _paid_wait(budget: RetryBudget, delay: float) -> bool:
    """Wait before a retry the budget pays for; False (no wait) when it is spent. A client that leaves
    during the wait gets the retry back: it was never made."""
    paid_at = budget.try_spend()
    if paid_at is None:
        return False
    try:
        await asyncio.sleep(delay)
    except asyncio.CancelledError:
        budget.refund(paid_at)
        raise
    return True


async def send_with_retries(
    provider: Provider,
    path: str,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    budget: RetryBudget,
    on_retry: Callable[[str, int, int], None] | None = None,
    method: str = "POST",
    deadline_s: float | None = None,
) -> Attempted:
    """Send, retrying connection errors before any of the answer came, 429 and 502/503/504 while the
    budget allows.

    A stream is retried only before its first byte: a 200 reply is returned unread.
    `on_retry(cause, start_ns, end_ns)` is called for each failed attempt that is retried.
    """
    budget.on_request()
    retries = 0
    started = time.monotonic()
    while True:
        t0 = time.time_ns()
        failure: TransportFailure | None = None
        reply: UpstreamReply | None = None
        # a retried plain call gets what is left of the call's time (a stream's limit is on each gap)
        left = None if stream or deadline_s is None or not retries else deadline_s - (time.monotonic() - started)
        try:
            reply = await provider.send(path, body, headers, stream, method, left)
        except TransportFailure as e:
            failure = e
        if reply is not None and not _retryable_reply(reply):
            return Attempted(reply, None, retries)
        if failure is not None and (failure.cause == "timeout" or failure.answered):
            # a hung upstream already used the time budget; one that took the request (part of an
            # answer came) could do it twice
            return Attempted(None, failure, retries)
        cause = failure.cause if failure else error_cause(reply.status, json_object(reply.body))  # type: ignore[union-attr]
        if retries >= provider.max_retries or cause == "quota_exceeded":  # no quota comes back in seconds
            return Attempted(reply, failure, retries)
        delay = random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**retries))
        hinted = hinted_delay_s(reply.headers) if reply is not None else None
        if hinted is not None:
            delay = max(delay, hinted)
        if delay > RETRY_AFTER_CAP_S or (deadline_s is not None and time.monotonic() - started + delay > deadline_s):
            return Attempted(reply, failure, retries)
        failed_ns = time.time_ns()
        if not await _paid_wait(budget, delay):  # last: the budget pays only for a retry that is made
            return Attempted(reply, failure, retries)
        if on_retry is not None:
            on_retry(cause, t0, failed_ns)
        retries += 1
