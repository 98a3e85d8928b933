"""Event bus backends behind one Protocol: memory (embedded) and kafka."""

from __future__ import annotations

from service import metrics
from service.bus.base import TOPICS, EventBus, Subscription, Topic, record_key
from service.config import EventsConfig

__all__ = ["TOPICS", "EventBus", "Subscription", "Topic", "make_bus", "record_key"]


def make_bus(events: EventsConfig) -> EventBus:
    metrics.start_event_counters(TOPICS)
    if events.backend == "kafka":
        from service.bus.kafka import KafkaBus

        return KafkaBus(events.kafka, events.spool, events.queue_size)
    from service.bus.memory import MemoryBus

    return MemoryBus(events.queue_size)
