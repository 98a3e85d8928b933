"""The embedded bus's subscriptions: a waiting get_batch wakes on the next record, times out empty,
and leaves nothing behind when cancelled; groups share one queue; a full queue drops and counts."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from service.bus.base import SHADOW_GROUP
from service.bus.memory import MemoryBus
from service.records import OutcomeEvent, PrimaryResult, TrafficEvent


def outcome(rid: str) -> OutcomeEvent:
    return OutcomeEvent(request_id=rid, ts=0.0, route="bot", model="m", role="stable", segment="chat",
                        outcome="completed", kind="request")


def test_a_waiting_get_batch_wakes_on_a_record_and_times_out_empty():
    async def main() -> None:
        bus = MemoryBus(queue_size=10)
        sub = bus.subscribe(["outcomes"], group="g")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await sub.get_batch(10, 0.05) == []
        assert loop.time() - t0 >= 0.05
        waiting = asyncio.ensure_future(sub.get_batch(10, 30))
        await asyncio.sleep(0.01)
        bus.publish("outcomes", outcome("a"))
        batch = await asyncio.wait_for(waiting, 1)  # woken by the record, not by the 30 s timeout
        assert [r.request_id for r in batch] == ["a"]
        assert bus.subscribe(["outcomes"], group="g") is sub  # a group shares one queue

    asyncio.run(main())


def test_a_cancelled_get_batch_leaves_no_waiter_and_loses_no_record():
    async def main() -> None:
        bus = MemoryBus(queue_size=10)
        sub = bus.subscribe(["outcomes"], group=None)
        waiting = asyncio.ensure_future(sub.get_batch(10, 30))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert not sub._waiters
        bus.publish("outcomes", outcome("b"))
        assert [r.request_id for r in await sub.get_batch(10, 1)] == ["b"]

    asyncio.run(main())


def traffic(rid: str) -> TrafficEvent:
    return TrafficEvent(request_id=rid, ts=0.0, route="drops-bot", segment="chat", request={"messages": []},
                        primary=PrimaryResult(model="m", status=200, latency_s=0.01, outcome="completed"),
                        config_version="v")


def drops() -> tuple[float, float]:
    """(traffic events dropped for a full queue, sampled requests not shadowed for one) so far."""
    events = REGISTRY.get_sample_value("modelcanary_events_dropped_total", {"topic": "traffic", "reason": "queue_full"})
    shadow = REGISTRY.get_sample_value("modelcanary_shadow_dropped_total", {"route": "drops-bot", "reason": "queue_full"})
    return events or 0.0, shadow or 0.0


def test_a_full_traffic_queue_is_a_shadow_drop_only_when_it_is_the_shadow_workers():
    """Capture's recent traffic falling behind loses events, not shadow evaluations: the shadow
    workers still got every request, and shadow_dropped_total must not say otherwise."""
    bus = MemoryBus(queue_size=2, reader_queue_size=2)  # capture's own bound as small, to fill it
    shadow = bus.subscribe(["traffic"], group=SHADOW_GROUP)
    bus.subscribe(["traffic", "outcomes"], group="modelcanary-capture")  # never read here: it fills up

    async def read_all() -> None:
        await shadow.get_batch(10, 0.01)

    start = drops()
    for i in range(5):
        bus.publish("traffic", traffic(f"t{i}"))
        asyncio.run(read_all())  # the shadow workers keep up
    after_capture = drops()
    assert after_capture[0] - start[0] == 3  # capture missed three events: an event drop
    assert after_capture[1] == start[1], "capture's full queue was counted as sampled requests not shadowed"
    for i in range(5):
        bus.publish("traffic", traffic(f"u{i}"))  # now nobody reads: the shadow workers' queue is full too
    events, shadowed = drops()
    assert (events - after_capture[0], shadowed - after_capture[1]) == (5 + 3, 3)  # capture's 5, the workers' 3
