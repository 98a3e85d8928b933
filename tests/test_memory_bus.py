"""The embedded bus's subscriptions: a waiting get_batch wakes on the next record, times out empty,
and leaves nothing behind when cancelled; groups share one queue."""

from __future__ import annotations

import asyncio

from service.bus.memory import MemoryBus
from service.records import OutcomeEvent


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
