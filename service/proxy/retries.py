"""Recognise a client's retry: the SDK's retry counter, or the same request seen again lately.

A request is known by its fingerprint: the client's credential and session with the body's bytes."""

from __future__ import annotations

import time

from service.recent import Recent

WINDOW_S = 300.0
MAX_ENTRIES = 100_000


def fingerprint(client: str, body: bytes) -> int:
    return hash((client, body))


class RetryDetector:
    def __init__(self, window_s: float = WINDOW_S, max_entries: int = MAX_ENTRIES):
        self._window_us = round(window_s * 1e6)
        self._seen = Recent(max_entries, width=1)  # fingerprint -> last seen, µs of time.monotonic()

    def is_retry(self, sdk_retry_count: str | None, fingerprint: int, now: float | None = None) -> bool:
        now_us = round((now or time.monotonic()) * 1e6)
        last = self._seen.put(fingerprint, now_us)
        if sdk_retry_count and sdk_retry_count not in ("0", ""):
            return True
        return last is not None and now_us - last[0] <= self._window_us
