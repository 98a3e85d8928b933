"""Memory mode: `events.queue_size` bounds what waits for the shadow workers, not the controller's
evidence or capture's recent traffic. A burst published in one loop turn (a shadow child's batch of
evaluations) reaches the controller whole, even with the smallest queue_size."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from service.admin.traffic import RecentTraffic
from service.bus import make_bus
from service.bus.base import SHADOW_GROUP
from service.records import PrimaryResult, TrafficEvent
from service.rollout.book import RolloutBook
from service.rollout.controller import MAX_BATCH, Controller
from tests.judge_traffic import evaluation, make_config

BURST = 100
ROUTE = "burst-bot"


def dropped(topic: str) -> float:
    return REGISTRY.get_sample_value("modelcanary_events_dropped_total", {"topic": topic, "reason": "queue_full"}) or 0.0


def shadow_dropped() -> float:
    return REGISTRY.get_sample_value("modelcanary_shadow_dropped_total", {"route": ROUTE, "reason": "queue_full"}) or 0.0


def traffic(i: int) -> TrafficEvent:
    return TrafficEvent(request_id=f"burst-{i}", ts=float(i), route=ROUTE, segment="chat", request={"messages": []},
                        primary=PrimaryResult(model="m", status=200, latency_s=0.01, outcome="completed"),
                        config_version="v")


def test_a_burst_of_evaluations_reaches_the_controller_whole_whatever_events_queue_size():
    cfg = make_config(events={"queue_size": 16})
    bus = make_bus(cfg.events)
    controller = Controller(cfg, bus, RolloutBook(cfg))

    async def main() -> int:
        sub = controller.subscribe()
        before = dropped("evaluations")
        for _ in range(BURST):  # one loop turn: the shadow child's results, published together
            bus.publish("evaluations", evaluation("chat", True))
        assert dropped("evaluations") == before, "evidence dropped by the controller's queue"
        controller.ingest_batch(await sub.get_batch(MAX_BATCH, 0))
        return controller.evidence["bot"].windows[-1].shadow_records

    assert asyncio.run(main()) == BURST


def test_capture_keeps_a_burst_while_the_shadow_workers_queue_stays_bounded_by_queue_size():
    cfg = make_config(events={"queue_size": 16})
    bus = make_bus(cfg.events)
    recent = RecentTraffic()

    async def main() -> None:
        stop = asyncio.Event()
        shadow = bus.subscribe(["traffic"], group=SHADOW_GROUP)
        reading = asyncio.create_task(recent.run(bus, stop))
        await asyncio.sleep(0)  # capture's reader has subscribed and waits for records
        for i in range(BURST):
            bus.publish("traffic", traffic(i))
        stop.set()
        await reading  # takes what it was woken for, then stops
        assert len(await shadow.get_batch(MAX_BATCH, 0)) == 16

    events, shadowed = dropped("traffic"), shadow_dropped()
    asyncio.run(main())
    assert len(recent.lines()) == BURST
    assert (dropped("traffic") - events, shadow_dropped() - shadowed) == (BURST - 16, BURST - 16)  # the workers' only
