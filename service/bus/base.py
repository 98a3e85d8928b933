"""The event bus extension point: where records go off the hot path (DESIGN §8)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal, Protocol

from service.records import Record

Topic = Literal["outcomes", "traffic", "evaluations", "rollouts", "reports", "control"]
TOPICS: tuple[Topic, ...] = ("outcomes", "traffic", "evaluations", "rollouts", "reports", "control")
SHADOW_GROUP = "modelcanary-shadow"  # the consumer group the shadow workers read traffic in
# One partition each, compacted: the latest record per key is all a reader needs.
KEYED_TOPICS: tuple[Topic, ...] = ("rollouts", "reports", "control")
LEADER_KEY = "leader"


def record_key(topic: Topic, record: Record) -> str:
    """Key = request_id for outcomes/traffic/evaluations (feedback by session: its session), route for
    rollouts and reports, one key for control."""
    if topic == "control":
        return LEADER_KEY
    # `Record` itself has no fields; every record type published on these topics has this one (records.py)
    key: str = getattr(record, "route" if topic in ("rollouts", "reports") else "request_id")
    return key


class Subscription(Protocol):
    async def get_batch(self, max_records: int, timeout_s: float) -> list[Record]:
        """Records not yet returned, oldest first; [] when none arrived within timeout_s."""

    async def commit(self) -> None:
        """Mark everything returned so far as done (at-least-once: call after the work is written)."""

    async def close(self) -> None: ...


class EventBus(Protocol):
    async def start(self) -> None: ...

    def publish(self, topic: Topic, record: Record) -> None:
        """Hand a record over. Never blocks the event loop and never raises; drops are counted."""

    def subscribe(self, topics: list[Topic], group: str | None) -> Subscription:
        """A consumer. `group` shares records among its members (each record to one member, from the
        oldest uncommitted); `group=None` follows every record from the start of the topic (the
        Kafka backend's `follow` reads keyed topics from each key's latest record instead)."""

    async def flush(self, timeout_s: float) -> bool:
        """True once every record published before the call is confirmed by the backend (Kafka: the
        broker acknowledged it, or it is in the local spool); False if that takes over `timeout_s` or
        one of them was dropped. Call before committing work whose results were published."""

    async def replay(self, topics: list[Topic], group: str, since_ts: float, handle: Callable[[Record], object],
                     stop: asyncio.Event | None = None) -> int:
        """Hand `handle` every record of `topics` that `group` already consumed since `since_ts` (how a
        restarted consumer rebuilds what it kept in memory); returns how many. A backend that keeps
        nothing once consumed (memory) hands nothing and returns 0."""

    async def close(self) -> None:
        """Flush what can be flushed within a short time, then stop."""
