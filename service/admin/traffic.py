"""Memory mode: the recent sampled traffic and feedback, for `modelcanary capture`.

In memory mode the bus lives inside the proxy process, so nothing outside it can read the traffic
topic. `RecentTraffic` follows the bus (its own group on `traffic` and `outcomes`) and keeps, as
the JSON lines it will serve, the most recent TrafficEvents (at most `max_bytes` of them) and
feedback events (at most `max_feedback`); `GET /admin/traffic?since=&until=` streams them
(`lines`). Request outcomes are read and dropped: only feedback is kept. Kafka mode has no such
memory: capture reads the topics.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque

from service.bus.base import EventBus
from service.records import OutcomeEvent, TrafficEvent, dump

log = logging.getLogger("modelcanary.capture")

GROUP = "modelcanary-capture"
MAX_BYTES = 32 * 1024 * 1024    # serialized TrafficEvents kept (the oldest are forgotten first)
MAX_FEEDBACK = 50_000
BATCH = 500
GATHER_S = 0.25  # records are taken in batches at most this often: a wake-up per batch, not per request


class RecentTraffic:
    def __init__(self, max_bytes: int = MAX_BYTES, max_feedback: int = MAX_FEEDBACK):
        self.max_bytes = max_bytes
        self._traffic: deque[tuple[float, bytes]] = deque()
        self._bytes = 0
        self._feedback: deque[tuple[float, bytes]] = deque(maxlen=max_feedback)
        self.forgotten = 0

    def add(self, record: object) -> None:
        if isinstance(record, TrafficEvent):
            line = _line(record)
            self._traffic.append((record.ts, line))
            self._bytes += len(line)
            while self._bytes > self.max_bytes and len(self._traffic) > 1:
                self._bytes -= len(self._traffic.popleft()[1])
                self.forgotten += 1
        elif isinstance(record, OutcomeEvent) and record.kind == "feedback":
            self._feedback.append((record.ts, _line(record)))

    def lines(self, since: float | None = None, until: float | None = None) -> list[bytes]:
        """A snapshot: the kept traffic in [since, until), then all kept feedback (it may come after
        its request's window)."""
        out = [line for ts, line in self._traffic
               if (since is None or ts >= since) and (until is None or ts < until)]
        out += [line for _, line in self._feedback]
        return out

    async def run(self, bus: EventBus, stop: asyncio.Event) -> None:
        sub = bus.subscribe(["traffic", "outcomes"], group=GROUP)
        try:
            while not stop.is_set():
                batch = await sub.get_batch(BATCH, 0.5)
                for record in batch:
                    self.add(record)
                if batch and len(batch) < BATCH:
                    await asyncio.sleep(GATHER_S)
        finally:
            await sub.close()


def _line(record: TrafficEvent | OutcomeEvent) -> bytes:
    data = dump(record)
    try:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
    except UnicodeEncodeError:  # a lone surrogate (an upstream's answer may hold one): kept as its escape
        return json.dumps(data, separators=(",", ":")).encode() + b"\n"
