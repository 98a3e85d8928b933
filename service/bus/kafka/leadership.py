"""Leadership through Kafka: the member of a consumer group that holds partition 0 of
`{prefix}.control` leads; the others stand by and get the partition when it leaves or dies.
Only partition 0 counts: the service creates the topic with one partition, but another client may
have made it with several (a broker's auto-creation: Tansu makes 4), and then every member would
hold one (the subscription logs that as an error; the control records go to partition 0).

The group uses the cooperative sticky assignor, so a member that joins or leaves does not take the
partition away from the one that holds it (a standby starting up never interrupts the leader).
The holder `owns` the partition until it is revoked or lost (then its term is over), and may act
(`held`) only while its lease is current too: the group coordinator answered one of its
heartbeats within `lease_s`, well inside the session timeout after which the broker would give the
partition to another member (a new holder so starts acting with its first heartbeat, ~1 s after
its join). A leader cut off from the broker, or whose consumer thread is
stuck, so stops acting before anybody else can start; the lease also lapses for a moment while a
rebalance runs (no heartbeats then), which only pauses the holder.

A member leaves (`close`) only once no join is under way: a broker may keep a group rebalancing for
good when its elected leader leaves in the middle of one (Tansu 0.6 does, new members included).

Each new leader claims the next epoch: it reads the control topic to its end, takes one more than
the highest epoch written there (or than `floor`), and writes a LeaderRecord before it acts: the
broker's acknowledgement confirms it (never the spool, which holds records for later). A leader
that sees a higher epoch than its own (`newer_epoch`) was deposed without being told; it `rejoin`s
as a new member, so that it leads again only if the group gives it the partition afresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from kafka import KafkaConsumer, TopicPartition
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor

from service.bus.kafka.consumer import KafkaSubscription
from service.bus.kafka.internals import group_settled, session_age
from service.bus.kafka.replay import read_messages
from service.records import LeaderRecord

if TYPE_CHECKING:
    from service.bus.kafka.producer import KafkaBus

log = logging.getLogger("modelcanary.bus.kafka")


class KafkaLeadership(KafkaSubscription):
    # failover after a kill -9: the session timeout, a heartbeat, then a join (~3 s): ~9 s
    session_timeout_ms = 5000
    heartbeat_interval_ms = 1000
    # also the rebalance timeout: how long a join waits for a member that died during a rebalance
    max_poll_interval_ms = 5000
    assignors = (CooperativeStickyAssignor,)
    settle_s = 6.0  # the longest `close` waits for a join under way: a heartbeat, then the join

    def __init__(self, bus: KafkaBus, group: str):
        super().__init__(bus, ["control"], group)
        self.lease_s = (self.session_timeout_ms - 2 * self.heartbeat_interval_ms) / 1000
        self._assigned = False
        self._revoked = False  # since the last claim
        self.joined = False    # a member of the group (its first join is complete)
        self._lease_until = 0.0
        self._warned = False

    def owned(self) -> bool:
        """The control partition (0) is this member's, and was not revoked since the last claim."""
        return self._assigned and not self._revoked

    def held(self) -> bool:
        """Owned, and the lease is current: this member may act as the leader now."""
        return self.owned() and self.leased()

    def leased(self) -> bool:
        """The control partition is this member's and its lease is current: it may `claim`."""
        return self._assigned and time.monotonic() < self._lease_until

    async def wait_held(self, stop: asyncio.Event, poll_s: float = 0.2) -> bool:
        """Until this member holds the partition with a current lease, so it may `claim` (True), or
        `stop` is set or the subscription closed (False). Control records are read and dropped
        meanwhile: `claim` reads the topic itself."""
        while not stop.is_set() and not self._closed:  # a closed one's get_batch returns at once
            if self.leased():
                return True
            await self.get_batch(self.max_poll_records, poll_s)
        return False

    async def claim(self, instance: str, floor: int = 0, timeout_s: float = 10.0) -> int | None:
        """The next epoch, written to the control topic and confirmed; None when that fails or the
        lease ran out meanwhile (the caller waits to lead again)."""
        bus = self._bus
        self._revoked = False
        try:
            messages = await asyncio.to_thread(read_messages, bus.kafka.bootstrap_servers, bus.names["control"],
                                               timeout_s, bus.kafka.security)
        except Exception as e:
            log.warning("reading %s failed: %s", bus.names["control"], e)
            return None
        epochs = [m.value.get("epoch") for m in messages]
        epoch = max([floor, *(e for e in epochs if isinstance(e, int))]) + 1
        record = LeaderRecord(instance=instance, epoch=epoch, ts=time.time())
        if not await asyncio.to_thread(bus.send_confirmed, "control", record, timeout_s) or not self.held():
            log.warning("could not confirm leadership epoch %d in time; standing by", epoch)
            return None
        return epoch

    async def newer_epoch(self, epoch: int) -> int | None:
        """The highest epoch above `epoch` in the control records buffered since the last call (they
        are dropped), or None. Only the partitions this member holds are read."""
        records = await self.get_batch(self._max_buffer, 0)
        newer = [r.epoch for r in records if isinstance(r, LeaderRecord) and r.epoch > epoch]
        return max(newer, default=None)

    async def rejoin(self) -> None:
        """Leave the group (once settled, as `close`) and join it again as a new member: a deposed
        leader holds no partition until the group assigns it one again."""
        await self._settle()
        await self._call(self._leave)

    async def close(self) -> None:
        """Leave the group, once a heartbeat answered since the call shows no join under way (at most
        `settle_s` later)."""
        await self._settle()
        await super().close()

    async def _settle(self) -> None:
        since = time.monotonic()
        consumer = self._consumer
        while (consumer is not None and time.monotonic() < since + self.settle_s
               and not await self._call(lambda: self._consumer is None or group_settled(self._consumer, since))):
            await asyncio.sleep(0.1)

    def _leave(self) -> None:
        """On the consumer thread: the next turn of its loop builds a new consumer, which joins anew."""
        self._drop_consumer()
        self._assigned = False
        self._lease_until = 0.0

    def _lead_partition(self) -> TopicPartition:
        return TopicPartition(self._bus.names["control"], 0)

    def _purge(self, revoked: set[TopicPartition]) -> None:
        super()._purge(revoked)
        if self._lead_partition() in revoked:
            self._revoked = True

    def _after_poll(self, consumer: KafkaConsumer) -> None:
        now = time.monotonic()
        self.joined = self.joined or group_settled(consumer, 0.0)
        self._assigned = self._lead_partition() in consumer.assignment()
        if not self._assigned:
            self._lease_until = 0.0
            return
        age = session_age(consumer)
        if age is None:
            if not self._warned:
                log.warning("kafka-python does not show the group session; the leader lease follows polls only")
                self._warned = True
            age = 0.0
        self._lease_until = now - age + self.lease_s
