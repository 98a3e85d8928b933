"""Consuming: one KafkaConsumer per subscription, polled without pause by its own thread."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future as ConcurrentFuture
from typing import TYPE_CHECKING, Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from service import metrics
from service.bus.base import KEYED_TOPICS, Topic
from service.bus.kafka.admin import broker_reachable, build_client, create_missing_topics, describe, key_text
from service.bus.kafka.internals import finish_join, finish_stalled_join, known_partitions, topic_id
from service.records import LeaderRecord, Record, RolloutReport, RolloutState, load

log = logging.getLogger("modelcanary.bus.kafka")

if TYPE_CHECKING:
    from service.bus.kafka.producer import KafkaBus

# what a keyed topic's records must decode as for a follower to take one as its key's latest
KEYED_RECORDS: dict[Topic, type[Record]] = {"rollouts": RolloutState, "reports": RolloutReport,
                                            "control": LeaderRecord}

UNREACHABLE_WARN_S = 60.0  # how often a subscription that can't reach the broker says so

_lag_lock = threading.Lock()
_lag_parts: dict[tuple[str, str], dict[int, int]] = {}


def _set_lag(topic: str, group: str, sub_id: int, lag: int | None) -> None:
    """consumer_lag is the sum over this process's members of a group (each sees its own partitions)."""
    with _lag_lock:
        parts = _lag_parts.setdefault((topic, group), {})
        if lag is None:
            parts.pop(sub_id, None)
        else:
            parts[sub_id] = lag
        metrics.consumer_lag.labels(topic, group).set(sum(parts.values()))


class KafkaSubscription:
    """One KafkaConsumer, polled without pause by its own thread; records wait in a small buffer.

    Polling all the time (not only inside get_batch) keeps heartbeats and group joins going however
    slowly the caller works, so `max_poll_interval_ms` is never exceeded by slow work (a shadow worker
    may hold records for minutes while upstream calls retry; only this thread's own calls, each
    bounded well below the interval, come between two polls). A join under way is waited for in
    back-to-back waits of `join_wait_ms`, so none ends in the gap between two polls (kafka-python
    3.0 drops such a join and joins again: `internals.finish_join`). The interval is also the
    rebalance timeout a join waits for, which is why it stays small: joins take ~3 s.
    When the buffer is full (`max_poll_records` × 4, or `batch`: the most records the caller takes
    at a time, when it takes more) the partitions are paused. `group=None`: every partition, no group, no
    commits; from the beginning, or, with `latest_of` (keys), first each of those keys' latest record
    (read back from the end, see `_latest`) and then every new record; `caught_up` is set once those
    are buffered; with `tail` (a number of records), from about that many before each partition's end.

    `sole_member_after_s` (a group with one member by design, the leading controller's): once the group
    has given this member no partition for that long, the group's assignment is given up for good and
    this member reads every partition itself (`consumer.assign`), each from the group's committed
    offset, and commits as before. A broker can keep a group rebalancing for good (Tansu 0.6 does when
    a member leaves in the middle of a join); a member that waited on it would take in nothing while
    its caller goes on as if the topics were quiet. Its lag then counts every partition, against the
    group's committed offsets, so a member without partitions never reads 0 behind.
    """

    max_poll_records = 50
    max_poll_interval_ms = 10000
    session_timeout_ms = 6000
    heartbeat_interval_ms = 1000
    poll_timeout_ms = 100
    join_wait_ms = 1000
    metadata_max_age_ms = 5000
    assignors: tuple[type, ...] | None = None  # kafka-python's default (eager range, round robin)

    def __init__(self, bus: KafkaBus, topics: list[Topic], group: str | None,
                 latest_of: Collection[str] | None = None, tail: int | None = None,
                 sole_member_after_s: float | None = None, batch: int | None = None):
        self._bus = bus
        self.topics = topics
        self.group = group
        self.latest_of = frozenset(latest_of) if latest_of is not None else None
        self.tail = tail
        self.caught_up = threading.Event()
        self.sole_member_after_s = sole_member_after_s if group is not None else None
        self.manual = False  # a sole member reading every partition itself (see above)
        self.partitions = 0  # held after the last poll
        self.unassigned_since: float | None = None  # monotonic; None while partitions are held
        self._names = {bus.names[t]: t for t in topics}
        self._label = group or "none"
        if batch is not None:  # polls bring a quarter of it: a full batch waits while the previous one is worked on
            self.max_poll_records = max(self.max_poll_records, batch // 4)
        self._max_buffer = max(self.max_poll_records * 4, batch or 0)
        # (partition, offset, record); None for a record that does not decode: taken in its turn, unreturned
        self._buffer: deque[tuple[TopicPartition, int, Record | None]] = deque()
        self._lock = threading.Lock()
        # next offset to commit, per partition, with the id of the topic it was read from
        self._returned: dict[TopicPartition, tuple[int, object]] = {}
        self._orphans: deque[tuple[TopicPartition, int, Record | None]] = deque()  # fetched from a topic since replaced
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], ConcurrentFuture]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None
        self._consumer: KafkaConsumer | None = None
        self._retry_at = 0.0
        self._unreachable_warned_at = -UNREACHABLE_WARN_S
        self._next_lag = 0.0
        self._next_check = 0.0
        self._partitions_seen: dict[str, int] = {}  # each topic's partitions when last seen in the metadata
        self.topic_ids: dict[str, object] = {}
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            pass
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"modelcanary-kafka-consumer-{self._label}")
        self._thread.start()

    # ---- Subscription -------------------------------------------------------------------------

    async def get_batch(self, max_records: int, timeout_s: float) -> list[Record]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._arrived is None:
            self._loop, self._arrived = loop, asyncio.Event()
        deadline = loop.time() + timeout_s
        while True:
            batch = self._take(max_records)
            remaining = deadline - loop.time()
            if batch or self._closed or remaining <= 0:
                return batch
            self._arrived.clear()
            if self._buffer:
                continue
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                pass

    async def commit(self) -> None:
        with self._lock:
            offsets, self._returned = self._returned, {}
        if self.group is None or not offsets:
            return
        await self._call(lambda: self._commit(offsets))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._notify()  # a get_batch waiting elsewhere returns now
        await asyncio.to_thread(self._thread.join, 15.0)

    async def assignment(self) -> set[tuple[str, int]]:
        """The (topic, partition) pairs this member holds now (introspection for tests and status)."""
        def assigned() -> set[tuple[str, int]]:
            c = self._consumer
            return {(self._names[tp.topic], tp.partition) for tp in c.assignment()} if c is not None else set()

        return await self._call(assigned) or set()

    # ---- loop side ----------------------------------------------------------------------------

    def _take(self, max_records: int) -> list[Record]:
        with self._lock:
            out: list[Record] = []
            while self._orphans and len(out) < max_records:  # still worked on; nothing to commit of them
                if (orphan := self._orphans.popleft()[2]) is not None:
                    out.append(orphan)
            while self._buffer and len(out) < max_records:
                tp, offset, record = self._buffer.popleft()
                self._returned[tp] = (offset + 1, self.topic_ids.get(tp.topic))  # past an undecodable one too
                if record is not None:
                    out.append(record)
            return out

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the consumer thread (KafkaConsumer is not thread-safe)."""
        fut: ConcurrentFuture = ConcurrentFuture()
        if self._closed or not self._thread.is_alive():
            return None
        self._commands.put((fn, fut))
        return await asyncio.wrap_future(fut)

    def _notify(self) -> None:
        loop, event = self._loop, self._arrived
        if loop is None or event is None:
            return
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # loop closed
            pass

    # ---- consumer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands()
            consumer = self._ensure_consumer()
            if consumer is None:
                self._stop.wait(0.2)
                continue
            try:
                self._replacement_check(consumer)
                self._maybe_export_lag(consumer)  # also while a join never ends
                if self._watch_assignment(consumer):
                    continue  # the next turn builds a consumer that assigns itself every partition
                if self._joins and finish_join(consumer, self.join_wait_ms):
                    continue  # commands and stop are checked between two waits
                self._backpressure(consumer)
                raw = consumer.poll(timeout_ms=self.poll_timeout_ms, max_records=self.max_poll_records)
            except Exception as e:
                log.warning("kafka consumer (%s) failed: %s; reconnecting", self._label, describe(e))
                self._drop_consumer()
                self._retry_at = time.monotonic() + 1.0
                continue
            if raw:
                self._buffer_records(raw)
            if self._joins and finish_stalled_join(consumer):
                log.info("consumer group %s: a join kafka-python left unfinished is started again", self.group)
            self._after_poll(consumer)
        self._run_commands()
        self._drop_consumer()
        for topic in self.topics:
            _set_lag(topic, self._label, id(self), None)

    @property
    def _joins(self) -> bool:
        """Partitions come from the group's assignment (not `consumer.assign`)."""
        return self.group is not None and not self.manual

    def _after_poll(self, consumer: KafkaConsumer) -> None:
        """Called on the consumer thread after every poll (a subclass watches its group here)."""

    def _watch_assignment(self, consumer: KafkaConsumer) -> bool:
        """Note since when no partition is held; past `sole_member_after_s`, give the group's assignment
        up (the consumer is dropped: True)."""
        self.partitions = len(consumer.assignment())
        now = time.monotonic()
        if self.partitions:
            self.unassigned_since = None
            return False
        if self.unassigned_since is None:
            self.unassigned_since = now
        if not self._joins or self.sole_member_after_s is None or now - self.unassigned_since < self.sole_member_after_s:
            return False
        log.warning("consumer group %s: no partition assigned for %.0f s (the broker may keep the group rebalancing "
                    "for good); as its only member, reading every partition itself from the group's committed "
                    "offsets", self.group, now - self.unassigned_since)
        self.manual = True
        self._drop_consumer()
        return True

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

    def _buffer_records(self, raw: dict) -> None:
        decoded: list[tuple[TopicPartition, int, Record | None]] = []
        for tp, messages in raw.items():
            for m in messages:
                try:
                    decoded.append((tp, m.offset, load(json.loads(m.value))))
                except Exception:
                    metrics.events_dropped_total.labels(self._names.get(tp.topic, tp.topic), "bad_record").inc()
                    log.warning("skipped an undecodable record at %s[%d]@%d", tp.topic, tp.partition, m.offset)
                    decoded.append((tp, m.offset, None))  # committed past in its turn: counted once
        if decoded:
            with self._lock:
                self._buffer.extend(decoded)
            self._notify()

    def _backpressure(self, consumer: KafkaConsumer) -> None:
        full = len(self._buffer) >= self._max_buffer
        paused = consumer.paused()
        if full:
            todo = consumer.assignment() - paused
            if todo:
                consumer.pause(*todo)
        elif paused:
            consumer.resume(*paused)

    def _unreachable(self) -> None:
        """No broker answers: try again in a second, and say so at once, then each minute."""
        now = time.monotonic()
        self._retry_at = now + 1.0
        if now - self._unreachable_warned_at >= UNREACHABLE_WARN_S:
            self._unreachable_warned_at = now
            log.warning("no Kafka broker reachable at %s (events.kafka.bootstrap_servers); consumer group %s "
                        "waits for it, trying every second", self._bus.kafka.bootstrap_servers, self._label)

    def _ensure_consumer(self) -> KafkaConsumer | None:
        if self._consumer is not None:
            return self._consumer
        if time.monotonic() < self._retry_at:
            return None
        bus = self._bus
        if not broker_reachable(bus.kafka.bootstrap_servers):
            self._unreachable()
            return None
        consumer = None
        try:
            create_missing_topics(bus._client_id, bus._client_config(), bus.names, bus.kafka)
            config = dict(
                client_id=f"{bus._client_id}-consumer",
                auto_offset_reset="earliest",
                enable_auto_commit=False,
                allow_auto_create_topics=False,  # topics are created with our partition count, not the broker's
                max_poll_records=self.max_poll_records,
                # A broker that came back empty recreates the topics later: fresh metadata within seconds
                # (not kafka-python's 5 min) lets the group see them and rejoin, and topic ids be compared.
                metadata_max_age_ms=self.metadata_max_age_ms,
                **bus._client_config(),
            )
            if self.group is not None:
                config.update(
                    group_id=self.group,
                    max_poll_interval_ms=self.max_poll_interval_ms,
                    session_timeout_ms=self.session_timeout_ms,
                    heartbeat_interval_ms=self.heartbeat_interval_ms,
                    request_timeout_ms=max(config["request_timeout_ms"], self.session_timeout_ms + 5000),
                )
                if self.assignors is not None:
                    config["partition_assignment_strategy"] = list(self.assignors)
            consumer = build_client(KafkaConsumer, **config)
            self._take_partitions(consumer)
        except Exception as e:
            log.warning("kafka consumer (%s) not ready: %s", self._label, describe(e))
            if consumer is not None:
                try:
                    consumer.close(autocommit=False)
                except Exception:
                    pass
            self._retry_at = time.monotonic() + 1.0
            return None
        self._consumer = consumer
        return consumer

    def _take_partitions(self, consumer: KafkaConsumer) -> None:
        if self._joins:
            consumer.subscribe(list(self._names), listener=_Revoked(self))
        elif self.manual:
            consumer.assign(self._every_partition(consumer))  # each from the group's committed offset
            self.topic_ids = {name: topic_id(consumer, name) for name in self._names}
        else:
            self._assign_all(consumer)

    def _drop_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        self._partitions_seen.clear()  # a new consumer's metadata starts empty: nothing is lost then
        with self._lock:
            self._buffer.clear()  # not returned yet: they are fetched again from the committed offsets
        if consumer is not None:
            try:
                consumer.close(autocommit=False)
            except Exception as e:
                log.debug("consumer close failed: %s", e)

    def _purge(self, revoked: set[TopicPartition]) -> None:
        """Partitions went to another member: drop what we buffered of them (it gets it from the commit)."""
        with self._lock:
            self._buffer = deque(x for x in self._buffer if x[0] not in revoked)

    def _every_partition(self, consumer: KafkaConsumer) -> list[TopicPartition]:
        return [TopicPartition(name, p) for name in self._names for p in sorted(consumer.partitions_for_topic(name) or ())]

    def _assign_all(self, consumer: KafkaConsumer) -> None:
        tps = self._every_partition(consumer)
        with self._lock:
            self._buffer.clear()
        consumer.assign(tps)
        if tps and self.latest_of is not None:
            expected = {name: (topic, KEYED_RECORDS.get(topic, Record)) for name, topic in self._names.items()}
            latest = _latest(consumer, tps, self.latest_of, expected)
            with self._lock:
                self._buffer.extend(latest)
            self._notify()
        elif tps and self.tail is not None:
            per_partition = max(1, self.tail // len(tps))
            starts, ends = consumer.beginning_offsets(tps), consumer.end_offsets(tps)
            for tp in tps:
                consumer.seek(tp, max(starts[tp], ends[tp] - per_partition))
        elif tps:
            consumer.seek_to_beginning(*tps)
        if self.latest_of is not None:
            self.caught_up.set()
        self.topic_ids = {name: topic_id(consumer, name) for name in self._names}
        self._next_check = time.monotonic() + 1.0

    def _replacement_check(self, consumer: KafkaConsumer) -> None:
        """Once a second: was a topic replaced (a replaced, empty broker: a new topic id, offsets from 0
        again)? The old positions would skip the new records, so those partitions are read from the
        beginning; a follower re-reads everything (it must see every record). Detection uses topic ids
        (brokers >= 2.8); end offsets are not trusted for it (Tansu reports the last batch's base)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + 1.0
        self._watch_topics(consumer)
        assigned = consumer.assignment()
        replaced: set[str] = set()
        ids: dict[str, object] = {}
        for name in self._names:
            tid = topic_id(consumer, name)
            if tid is None:
                continue
            if self.topic_ids.get(name) not in (None, tid):
                replaced.add(name)
            ids[name] = tid
        stale = {tp for tp in assigned if tp.topic in replaced}
        with self._lock:  # what is taken from now on is of the new topics; fetched before, of the old
            self.topic_ids.update(ids)
            if self.group is not None and stale:
                self._orphans.extend(x for x in self._buffer if x[0] in stale)
                self._buffer = deque(x for x in self._buffer if x[0] not in stale)
        if self.group is None:
            if replaced or self._shape_changed(consumer, assigned):
                log.info("follower: %s changed; reading from the beginning", ", ".join(sorted(self._names)))
                self._assign_all(consumer)
            return
        if stale:
            log.info("consumer group %s: %s was replaced; reading it from the beginning",
                     self.group, ", ".join(sorted(replaced)))
            consumer.seek_to_beginning(*stale)
        if self.manual and self._shape_changed(consumer, assigned):
            log.info("consumer group %s: %s changed; reading every partition", self.group, ", ".join(sorted(self._names)))
            consumer.assign(self._every_partition(consumer))  # those held keep their positions

    def _watch_topics(self, consumer: KafkaConsumer) -> None:
        """A topic seen before and gone from the broker's metadata (a broker that came back empty) is
        created again as the service creates it (admin.topic_settings), before any client's request
        makes the broker create it with its own defaults; a keyed topic (rollouts, reports, control:
        one ordered history) with several partitions, made by another client, is logged as an error."""
        lost = []
        for name in self._names:
            parts = known_partitions(consumer, name)
            if parts is None:
                if self._partitions_seen.pop(name, None) is not None:
                    lost.append(name)
            elif self._partitions_seen.get(name) != len(parts):
                self._partitions_seen[name] = len(parts)
                if self._names[name] in KEYED_TOPICS and len(parts) > 1:
                    log.error("%s has %d partitions, not 1 (not created by modelcanary: by the broker or another "
                              "client); its records go to partition 0 only. Delete it, or recreate it with 1 "
                              "partition and cleanup.policy=compact", name, len(parts))
        if lost:
            bus = self._bus
            log.warning("%s gone from the broker (it came back empty?); creating the topics again",
                        ", ".join(sorted(lost)))
            create_missing_topics(bus._client_id, bus._client_config(), bus.names, bus.kafka)

    def _shape_changed(self, consumer: KafkaConsumer, assigned: set[TopicPartition]) -> bool:
        """Not every partition of every topic is assigned (a topic appeared, or came back with more)."""
        return {tp.topic for tp in assigned} != set(self._names) or any(
            (parts := consumer.partitions_for_topic(name)) is not None
            and len(parts) != sum(1 for tp in assigned if tp.topic == name)
            for name in self._names
        )

    def _maybe_export_lag(self, consumer: KafkaConsumer) -> None:
        now = time.monotonic()
        if now < self._next_lag:
            return
        self._next_lag = now + self._bus.lag_interval_s
        try:
            lag = self._lag(consumer, int(self._bus._request_timeout_s * 1000))
        except Exception as e:
            log.debug("consumer lag unavailable: %s", e)
            return
        for topic, n in lag.items():
            _set_lag(topic, self._label, id(self), n)

    def _lag(self, consumer: KafkaConsumer, timeout_ms: int) -> dict[str, int]:
        """Records behind each topic's end: from the position in each partition held; a sole member
        holding none counts every partition from the group's committed offset (else its beginning)."""
        assigned = consumer.assignment()
        held = assigned or self.sole_member_after_s is None
        tps = list(assigned) if held else self._every_partition(consumer)
        ends = consumer.end_offsets(tps, timeout_ms=timeout_ms) if tps else {}
        starts = {} if held or not tps else consumer.beginning_offsets(tps, timeout_ms=timeout_ms)
        lag: dict[str, int] = {t: 0 for t in self.topics}
        with self._lock:
            buffered = Counter(tp for tp, _, _ in self._buffer)
        for tp, end in ends.items():
            if held:  # records buffered here but not yet returned are still behind, for the caller
                lag[self._names[tp.topic]] += max(0, end - consumer.position(tp, timeout_ms=1000) + buffered[tp])
            else:
                committed = consumer.committed(tp, timeout_ms=timeout_ms)
                lag[self._names[tp.topic]] += max(0, end - (starts[tp] if committed is None else committed))
        return lag

    def _commit(self, offsets: dict[TopicPartition, tuple[int, object]]) -> None:
        consumer = self._consumer
        if consumer is None:
            return  # reconnected since: those records come again (at least once)
        owned = consumer.assignment()
        # an offset of a topic replaced since (an empty broker came back) would skip the new topic's records
        mine = {tp: OffsetAndMetadata(off, "", -1) for tp, (off, tid) in offsets.items()
                if tp in owned and tid in (None, self.topic_ids.get(tp.topic))}
        if not mine:
            return
        try:
            # bounded well inside max_poll_interval_ms: this thread must get back to polling (a
            # coordinator that is away would otherwise hold it for the whole request timeout)
            consumer.commit(mine, timeout_ms=self.max_poll_interval_ms // 2)
        except Exception as e:
            log.warning("kafka commit (%s) failed: %s; those records will be delivered again",
                        self._label, describe(e))


LATEST_CHUNK = 200          # records read back at a time when looking for each key's latest
LATEST_MAX_RECORDS = 5000
LATEST_STALL_S = 10.0


def _latest(consumer: KafkaConsumer, tps: list[TopicPartition], keys: frozenset[str],
            expected: dict[str, tuple[Topic, type[Record]]]) -> list[tuple[TopicPartition, int, Record]]:
    """Each of `keys`' latest valid record in every partition, oldest first, leaving each partition's
    position just past its end (where following goes on). `expected`: each topic name's Topic and the
    record type its records must decode as.

    A compacted topic holds little more than that anyway, but a broker may not compact (Tansu does
    not), so the partition is read back from the end a chunk at a time, newest chunk first, until
    every key has a valid record or the beginning is reached: the cost is that of the records written
    since the oldest of those keys' latest, whatever the topic's length. A newer record of a key that
    does not decode as the expected type (a tombstone, garbage) is skipped and counted as bad_record."""
    out: list[tuple[TopicPartition, int, Record]] = []
    ends = consumer.end_offsets(tps)
    for tp in tps:
        consumer.pause(*[t for t in tps if t != tp])
        consumer.resume(tp)
        found: dict[str, tuple[int, Record]] = {}
        start = max(0, ends[tp] - LATEST_CHUNK)
        stop: int | None = None  # the tail is read to wherever the partition ends now
        while True:
            chunk = list(_read_range(consumer, tp, start, stop, ends[tp]))
            if stop is None:
                resume_at = consumer.position(tp)
            _newest_valid(chunk, tp, keys, expected[tp.topic], found)
            if start == 0 or keys <= found.keys():
                break
            start, stop = max(0, start - LATEST_CHUNK), start
        out += [(tp, offset, record) for offset, record in sorted(found.values(), key=lambda x: x[0])]
        consumer.seek(tp, resume_at)
    consumer.resume(*tps)
    return out


def _newest_valid(chunk: list[tuple[int, str | None, bytes | None]], tp: TopicPartition, keys: frozenset[str],
                  expected: tuple[Topic, type[Record]], found: dict[str, tuple[int, Record]]) -> None:
    """Add to `found` each key's newest valid record in `chunk` (read newest first), for keys not found
    in a newer chunk; the undecodable ones newer than it are counted."""
    topic, kind = expected
    for offset, key, value in reversed(chunk):
        if key is None or key not in keys or key in found:
            continue
        record = _decoded(value, kind)
        if record is not None:
            found[key] = (offset, record)
            continue
        metrics.events_dropped_total.labels(topic, "bad_record").inc()
        log.warning("skipped an undecodable record of %r at %s[%d]@%d", key, tp.topic, tp.partition, offset)


def _decoded(value: bytes | None, kind: type[Record]) -> Record | None:
    """The record `value` holds if it is a `kind`; None for a tombstone, garbage or another type."""
    if value is None:
        return None
    try:
        record = load(json.loads(value))
    except Exception:
        return None
    return record if isinstance(record, kind) else None


def _read_range(consumer: KafkaConsumer, tp: TopicPartition, start: int, stop: int | None,
                end: int) -> Iterator[tuple[int, str | None, bytes | None]]:
    """(offset, key, value) of `tp` from `start` up to `stop`, or (stop=None) until caught up with
    `end`: Tansu reports one past the first record of the last batch as the end, and a poll not cut
    short by max_records returns the rest of that batch with it (see replay.read_messages)."""
    consumer.seek(tp, start)
    last_progress = time.monotonic()
    while True:
        if stop is not None and consumer.position(tp) >= stop:
            return
        raw = consumer.poll(timeout_ms=300, max_records=LATEST_MAX_RECORDS)
        got = 0
        for message in raw.get(tp, ()):
            got += 1
            if stop is not None and message.offset >= stop:
                return
            yield message.offset, key_text(message.key), message.value
        if stop is None and got < LATEST_MAX_RECORDS and consumer.position(tp) >= end:
            return
        if got:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > LATEST_STALL_S:
            raise TimeoutError(f"reading {tp.topic}[{tp.partition}] back: nothing for {LATEST_STALL_S:.0f} s")


class _Revoked(ConsumerRebalanceListener):  # type: ignore[misc]  # kafka-python ships no type hints
    def __init__(self, sub: KafkaSubscription):
        self._sub = sub

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self._sub._purge(set(revoked))

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        pass

