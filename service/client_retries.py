"""Recognise a client's retry: the SDK's retry counter, or the same request seen again lately."""

from __future__ import annotations

import time
from collections import OrderedDict

WINDOW_S = 300.0
MAX_ENTRIES = 100_000


class RetryDetector:
    def __init__(self, window_s: float = WINDOW_S, max_entries: int = MAX_ENTRIES):
        self._window_s = window_s
        self._max = max_entries
        self._seen: OrderedDict[int, float] = OrderedDict()

    def is_retry(self, sdk_retry_count: str | None, client: str | None, body: bytes, now: float | None = None) -> bool:
        now = now or time.monotonic()
        fingerprint = hash((client, body))
        last = self._seen.get(fingerprint)
        self._seen[fingerprint] = now
        self._seen.move_to_end(fingerprint)
        if len(self._seen) > self._max:
            self._seen.popitem(last=False)
        if sdk_retry_count and sdk_retry_count not in ("0", ""):
            return True
        return last is not None and now - last <= self._window_s
