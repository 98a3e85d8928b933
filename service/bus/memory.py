"""Embedded event bus: bounded in-process queues, drops counted.

Consumer lag in embedded mode is a subscription's queue depth: records offered but not
yet returned by `get_batch`, per topic and consumer group (`group=None` reads "none",
as in Kafka mode). It is exported on `get_batch` and every `LAG_EVERY` offers, so a
stalled consumer still shows its growing lag without a metrics call per publish.

`events.queue_size` bounds the shadow workers' queue (what waits for them is sampled work they may
drop). The other readers, the controller (its evidence) and capture's recent traffic, each get at
least `READER_QUEUE_SIZE`: a small publish queue must not make them lose a burst they read a moment later.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from service import metrics
from service.bus.base import SHADOW_GROUP, Topic
from service.records import Record, RolloutState

if TYPE_CHECKING:
    from prometheus_client import Gauge

LAG_EVERY = 256   # offers between two lag exports while nobody calls get_batch
READER_QUEUE_SIZE = 65536  # the least a subscription other than the shadow workers' holds


class MemorySubscription:
    def __init__(self, bus: MemoryBus, topics: list[Topic], maxsize: int, group: str | None = None):
        self._bus = bus
        self._topics = topics
        self._group = group or "none"
        self._items: deque[tuple[Topic, Record]] = deque()
        self._maxsize = maxsize
        self._waiters: list[asyncio.Future[None]] = []  # get_batch calls waiting for a record
        self._depth: dict[Topic, int] = {t: 0 for t in topics}
        self._offers = 0

    def offer(self, topic: Topic, record: Record) -> bool:
        if len(self._items) >= self._maxsize:
            # only the shadow workers' full queue loses a sampled request; capture's is an event drop
            metrics.count_queue_full(topic, record, shadow=self._group == SHADOW_GROUP)
            return False
        self._items.append((topic, record))
        self._depth[topic] += 1
        if self._waiters:
            self._wake()
        self._offers += 1
        if self._offers >= LAG_EVERY:
            self._export_lag()
        return True

    async def get_batch(self, max_records: int, timeout_s: float) -> list[Record]:
        if not self._items:
            # a bare future and a timer: `wait_for` would start a task per wait (one per record at low load)
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            timer = loop.call_later(timeout_s, _release, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if not self._items:
                return []
        n = min(max_records, len(self._items))
        batch = []
        depth = self._depth
        for _ in range(n):
            topic, record = self._items.popleft()
            depth[topic] -= 1
            batch.append(record)
        self._export_lag()
        return batch

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _release(waiter)

    def _export_lag(self) -> None:
        self._offers = 0
        self._bus._export_lag(self)

    async def commit(self) -> None:
        return None

    async def close(self) -> None:
        self._bus._unsubscribe(self)

    @property
    def topics(self) -> list[Topic]:
        return self._topics

    @property
    def group(self) -> str:
        return self._group


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class MemoryBus:
    """One process: each subscription gets its own bounded queue; groups share one queue. The shadow
    workers' holds `queue_size` records, every other at least `reader_queue_size`.

    Rollout states are kept (latest per route) so a late follower still sees them.
    """

    def __init__(self, queue_size: int = 65536, reader_queue_size: int = READER_QUEUE_SIZE):
        self._queue_size = queue_size
        self._reader_queue_size = max(queue_size, reader_queue_size)
        self._subs: dict[Topic, list[MemorySubscription]] = {}
        self._groups: dict[tuple[str, tuple[Topic, ...]], MemorySubscription] = {}
        self._latest_rollouts: dict[str, Record] = {}
        self._published = metrics.LabelCache(metrics.events_published_total)
        # (topic, group label) -> its gauge child and the subscriptions it sums (followers share "none")
        self._lag: dict[tuple[Topic, str], tuple[Gauge, list[MemorySubscription]]] = {}

    async def start(self) -> None:
        return None

    def publish(self, topic: Topic, record: Record) -> None:
        if topic == "rollouts" and isinstance(record, RolloutState):
            self._latest_rollouts[record.route] = record
        delivered = False
        for sub in self._subs.get(topic, ()):
            delivered = sub.offer(topic, record) or delivered
        if delivered or not self._subs.get(topic):
            self._published.get(topic).inc()

    def subscribe(self, topics: list[Topic], group: str | None) -> MemorySubscription:
        key = (group, tuple(topics)) if group else None
        if key and key in self._groups:
            return self._groups[key]
        maxsize = self._queue_size if group == SHADOW_GROUP else self._reader_queue_size
        sub = MemorySubscription(self, list(topics), maxsize, group)
        for t in topics:
            self._subs.setdefault(t, []).append(sub)
            entry = self._lag.get((t, sub.group))
            if entry is None:
                entry = self._lag[(t, sub.group)] = (metrics.consumer_lag.labels(t, sub.group), [])
            entry[1].append(sub)
        if key:
            self._groups[key] = sub
        if "rollouts" in topics:
            for record in self._latest_rollouts.values():
                sub.offer("rollouts", record)
        self._export_lag(sub)
        return sub

    def _export_lag(self, sub: MemorySubscription) -> None:
        """Set consumer_lag for each of `sub`'s topics: the queue depth summed over the subscriptions
        sharing that (topic, group) label."""
        for t in sub.topics:
            entry = self._lag.get((t, sub.group))
            if entry is not None:
                gauge, members = entry
                gauge.set(sum(m._depth[t] for m in members))

    def _unsubscribe(self, sub: MemorySubscription) -> None:
        for t in sub.topics:
            if sub in self._subs.get(t, []):
                self._subs[t].remove(sub)
            entry = self._lag.get((t, sub.group))
            if entry is not None and sub in entry[1]:
                entry[1].remove(sub)
        self._export_lag(sub)
        self._groups = {k: v for k, v in self._groups.items() if v is not sub}

    async def replay(self, topics: list[Topic], group: str, since_ts: float, handle: Callable[[Record], object],
                     stop: asyncio.Event | None = None) -> int:
        return 0

    async def flush(self, timeout_s: float) -> bool:
        """Records are in the subscribers' queues as soon as `publish` returns: nothing to wait for."""
        return True

    async def close(self) -> None:
        return None
