"""Embedded event bus: bounded in-process queues, drops counted."""

from __future__ import annotations

import asyncio
from collections import deque

from service import metrics
from service.bus.base import Topic
from service.records import Record


class MemorySubscription:
    def __init__(self, bus: MemoryBus, topics: list[Topic], maxsize: int):
        self._bus = bus
        self._topics = topics
        self._items: deque[Record] = deque()
        self._maxsize = maxsize
        self._ready = asyncio.Event()

    def offer(self, topic: Topic, record: Record) -> bool:
        if len(self._items) >= self._maxsize:
            metrics.events_dropped_total.labels(topic, "queue_full").inc()
            return False
        self._items.append(record)
        self._ready.set()
        return True

    async def get_batch(self, max_records: int, timeout_s: float) -> list[Record]:
        if not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except TimeoutError:
                return []
        n = min(max_records, len(self._items))
        return [self._items.popleft() for _ in range(n)]

    async def commit(self) -> None:
        return None

    async def close(self) -> None:
        self._bus._unsubscribe(self)

    @property
    def topics(self) -> list[Topic]:
        return self._topics


class MemoryBus:
    """One process: each subscription gets its own bounded queue; groups share one queue.

    Rollout states are kept (latest per route) so a late follower still sees them.
    """

    def __init__(self, queue_size: int = 65536):
        self._queue_size = queue_size
        self._subs: dict[Topic, list[MemorySubscription]] = {}
        self._groups: dict[tuple[str, tuple[Topic, ...]], MemorySubscription] = {}
        self._latest_rollouts: dict[str, Record] = {}

    async def start(self) -> None:
        return None

    def publish(self, topic: Topic, record: Record) -> None:
        if topic == "rollouts":
            self._latest_rollouts[record.route] = record
        delivered = False
        for sub in self._subs.get(topic, ()):
            delivered = sub.offer(topic, record) or delivered
        if delivered or not self._subs.get(topic):
            metrics.events_published_total.labels(topic).inc()

    def subscribe(self, topics: list[Topic], group: str | None) -> MemorySubscription:
        key = (group, tuple(topics)) if group else None
        if key and key in self._groups:
            return self._groups[key]
        sub = MemorySubscription(self, list(topics), self._queue_size)
        for t in topics:
            self._subs.setdefault(t, []).append(sub)
        if key:
            self._groups[key] = sub
        if "rollouts" in topics:
            for record in self._latest_rollouts.values():
                sub.offer("rollouts", record)
        return sub

    def _unsubscribe(self, sub: MemorySubscription) -> None:
        for t in sub.topics:
            if sub in self._subs.get(t, []):
                self._subs[t].remove(sub)
        self._groups = {k: v for k, v in self._groups.items() if v is not sub}

    async def close(self) -> None:
        return None
