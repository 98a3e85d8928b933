"""Following the rollouts and reports topics (Kafka mode): every replica adopts each route's latest
state and report.

A catch-up reads each route's latest record of both topics, not their whole history (see
`KafkaBus.follow`), then every new record. A state of an older leadership epoch than the book's
(a deposed controller's late publish) is ignored; the leading controller answers it by publishing
its own state again, so that its state stays the latest record of the compacted topic. The
exception is an operator's action that a replica derived from the state before the new leader's
(it had not seen that one yet): the leader keeps it, committed again under its own epoch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from service.records import Record, RolloutReport, RolloutState
from service.rollout.book import RolloutBook

if TYPE_CHECKING:
    from service.bus.kafka import KafkaBus

log = logging.getLogger("modelcanary.rollout")

CATCH_UP_MAX_S = 60.0
BATCH = 500


class Follower:
    def __init__(self, bus: KafkaBus, book: RolloutBook):
        self.book = book
        self.sub = bus.follow(["rollouts", "reports"], keys=list(book.states))
        self._reports: dict[str, tuple[int, float]] = {}  # route -> (epoch, ts) of the report kept
        self.adopted = 0

    def handle(self, records: list[Record]) -> None:
        book = self.book
        for rec in records:
            if isinstance(rec, RolloutState):
                if book.adopt(rec):
                    self.adopted += 1
                elif book.epoch is not None and rec.epoch <= book.epoch and rec.route in book.states:
                    if book.adopt_operator(rec):  # made on a state older than this leader's latest
                        log.info("route %s: kept an operator's %s made on epoch %d, version %d", rec.route,
                                 rec.last_decision.decision if rec.last_decision else "action", rec.epoch,
                                 rec.version - 1)
                        continue
                    if rec.epoch < book.epoch:
                        log.warning("route %s: ignored a state of epoch %d (version %d) from a deposed controller",
                                    rec.route, rec.epoch, rec.version)
                        book.republish(rec.route)
            elif isinstance(rec, RolloutReport):
                self._report(rec)

    def _report(self, rec: RolloutReport) -> None:
        state = self.book.states.get(rec.route)
        rank = (rec.epoch, rec.ts)
        if state is None or rank <= self._reports.get(rec.route, (-1, 0.0)):
            return
        if (rec.report.get("stable"), rec.report.get("candidate")) != (state.stable, state.candidate):
            return  # of another rollout
        self._reports[rec.route] = rank
        self.book.set_report(rec.route, rec.report)

    async def catch_up(self, stop: asyncio.Event) -> bool:
        """Adopt each route's latest state and report; False if that took over CATCH_UP_MAX_S."""
        deadline = time.monotonic() + CATCH_UP_MAX_S
        while not stop.is_set() and time.monotonic() < deadline:
            ready = self.sub.caught_up.is_set()  # before the batch: what it buffered comes in this one
            batch = await self.sub.get_batch(BATCH, 0.5)
            self.handle(batch)
            if ready and not batch:
                return True
        return False

    async def run(self, stop: asyncio.Event) -> None:
        """Adopt every new record until `stop`, then close."""
        try:
            while not stop.is_set():
                self.handle(await self.sub.get_batch(BATCH, 0.5))
        finally:
            await self.sub.close()


READY_WAIT_S = 10.0  # a replica waits this long for its catch-up before it serves on what it has


async def follow(bus: KafkaBus, book: RolloutBook, stop: asyncio.Event, caught_up: asyncio.Event) -> None:
    """A proxy replica's follower: adopt each route's latest state and report, then set `caught_up`
    (after READY_WAIT_S at most: a broker that is down must not keep the proxy from serving), then
    every new record until `stop`."""
    follower = Follower(bus, book)
    try:
        if not await asyncio.wait_for(follower.catch_up(stop), READY_WAIT_S):
            log.warning("rollouts: not caught up with the topic; routing on the states known so far")
    except TimeoutError:
        log.warning("rollouts: not caught up with the topic in %.0f s (is the broker down?); routing on the "
                    "states known so far", READY_WAIT_S)
    caught_up.set()
    await follower.run(stop)
