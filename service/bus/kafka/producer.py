"""Kafka event bus backend (DESIGN §8), on kafka-python.

Publishing: `publish()` runs on the event loop of the hot path, so it only puts
the record into a bounded queue (full → counted drop). One sender thread owns the
KafkaProducer: it serialises records, sends them, and learns each record's fate
from its send future. A failed send (timeout, broker gone, a replaced broker that
no longer knows the producer id) closes the producer and puts every unconfirmed
record, in send order, into the on-disk spool; records that come after go behind
them. The thread probes the broker; once it answers, it ensures the topics,
builds a new producer, refreshes metadata and replays the spool in order before
sending anything new directly.

`flush(timeout_s)` waits until every record published before it is settled: confirmed by the
broker or written to the spool (handed to the OS, so it survives a kill -9 of this process).
Each published record gets a ticket (publish order); the sender thread marks tickets settled
as the spool is flushed, and a ticket sent to the broker stays pending until its send future
says delivered, or its failure puts it in the spool.

Consuming: each subscription owns a KafkaConsumer polled without pause by its
own thread into a small buffer that `get_batch` reads, so the loop never blocks
on the network and group heartbeats and joins never wait for the caller.

Drop reasons counted in modelcanary_events_dropped_total: queue_full, spool_full,
spool_error, too_large (over the producer's max request size), bad_record
(unserialisable, or undecodable when consumed), closed (published after close).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

from service import metrics
from service.bus.base import KEYED_TOPICS, TOPICS, Topic, record_key
from service.bus.kafka.admin import (
    _TOO_LARGE,
    broker_reachable,
    build_client,
    check_compression,
    client_security,
    create_missing_topics,
    describe,
    topic_names,
)
from service.bus.kafka.consumer import KafkaSubscription
from service.bus.kafka.internals import force_close
from service.bus.kafka.leadership import KafkaLeadership
from service.bus.kafka.replay import replay
from service.bus.spool import Spool, SpoolBatch
from service.config import KafkaConfig, SpoolConfig
from service.records import Record, dump

log = logging.getLogger("modelcanary.bus.kafka")

REPLAY_WAIT_S = 0.5  # a spool replay waits for the broker in steps this long, checking for close()


@dataclass(frozen=True)
class _Pending:
    topic: Topic
    key: str
    value: bytes
    ticket: int = 0  # publish order (flush); 0 for records replayed from the spool


def _encoded(topic: Topic, record: Record) -> tuple[str, bytes]:
    """The record's key and JSON value as sent to the broker."""
    return record_key(topic, record), json.dumps(dump(record), separators=(",", ":")).encode()


def _partition(topic: Topic) -> int | None:
    """A keyed topic's records all go to partition 0, its one ordered history, also when another client
    made the topic with several partitions (the key would spread them); the others by their key."""
    return 0 if topic in KEYED_TOPICS else None


class KafkaBus:
    """The Kafka backend of EventBus. Timeouts default to production values; tests pass small ones."""

    def __init__(
        self,
        kafka: KafkaConfig,
        spool: SpoolConfig,
        queue_size: int = 65536,
        *,
        delivery_timeout_s: float = 15.0,
        request_timeout_s: float = 5.0,
        probe_interval_s: tuple[float, float] = (0.5, 5.0),
        close_timeout_s: float = 3.0,
        replay_chunk: int = 2000,
        lag_interval_s: float = 5.0,
        client_id: str = "modelcanary",
    ):
        self.kafka = kafka
        self.names = topic_names(kafka.topic_prefix)
        self._security = client_security(kafka.security)
        check_compression(kafka)
        self._spool = Spool(spool.dir, spool.max_bytes)
        self._queue: queue.Queue[tuple[Topic, Record, int]] = queue.Queue(maxsize=queue_size)
        self._delivery_timeout_s = delivery_timeout_s
        self._request_timeout_s = request_timeout_s
        self._probe_min, self._probe_max = probe_interval_s
        self._close_timeout_s = close_timeout_s
        self._replay_chunk = replay_chunk
        self.lag_interval_s = lag_interval_s
        self._client_id = client_id

        self._producer: KafkaProducer | None = None
        self._idempotent: bool | None = None
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._inflight: dict[int, _Pending] = {}
        self._failed: list[tuple[int, _Pending, BaseException]] = []
        self._spooling: list[_Pending] = []  # taken out of flight by _trip, not yet in the spool
        self._spooling_said = False  # logged that records go to the spool, since it was last empty
        # flush(): tickets in publish order; every ticket <= _settled has left the queue and, unless
        # still in flight, is confirmed or in the spool (flushed to the OS)
        self._publish_lock = threading.Lock()
        self._issued = 0
        self._handled = 0
        self._settled = 0
        self._lost = 0        # records dropped for a reason a later try could fix (queue, spool, closed)
        self._lost_seen = 0   # _lost when the previous flush returned
        self._tripped = threading.Event()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._probe_delay = self._probe_min
        self._next_probe = 0.0
        self._published = {t: metrics.events_published_total.labels(t) for t in TOPICS}

    # ---- EventBus -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the sender thread; wait (off the loop, briefly) for its first connection attempt."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="modelcanary-kafka-sender", daemon=True)
            self._thread.start()
        await asyncio.to_thread(self._ready.wait, self._request_timeout_s + 5.0)

    def publish(self, topic: Topic, record: Record) -> None:
        try:
            if self._closed:
                metrics.events_dropped_total.labels(topic, "closed").inc()
                self._count_lost()
                return
            with self._publish_lock:
                ticket = self._issued + 1
                self._queue.put_nowait((topic, record, ticket))
                self._issued = ticket
        except queue.Full:
            metrics.count_queue_full(topic, record)
            self._count_lost()
        except Exception:  # never raise into the hot path
            log.exception("publish failed")

    async def flush(self, timeout_s: float) -> bool:
        """True once every record published before this call is confirmed by the broker or written to
        the spool; False when that takes longer than `timeout_s`, or when a record published since the
        previous flush was dropped (a full queue or spool: counted in events_dropped_total). Records
        that can never be sent (too large, unserialisable) are dropped, counted, and not waited for."""
        target = self._issued
        deadline = time.monotonic() + timeout_s
        settled = self._flushed(target)
        while not settled and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            settled = self._flushed(target)
        lost, self._lost_seen = self._lost != self._lost_seen, self._lost
        return settled and not lost

    def _flushed(self, ticket: int) -> bool:
        if self._settled < ticket:
            return False
        with self._lock:
            # tickets are sent in order, so the oldest in flight is the first of the dict
            oldest = next(iter(self._inflight.values()), None)
            if oldest is not None and 0 < oldest.ticket <= ticket:
                return False
            return not any(0 < item.ticket <= ticket for _, item, _ in self._failed) and not any(
                0 < item.ticket <= ticket for item in self._spooling)

    def _count_lost(self) -> None:
        with self._publish_lock:
            self._lost += 1

    def subscribe(self, topics: list[Topic], group: str | None) -> KafkaSubscription:
        return KafkaSubscription(self, list(topics), group)

    def send_confirmed(self, topic: Topic, record: Record, timeout_s: float) -> bool:
        """Blocking (run it on a thread): send one record past the queue and the spool with a producer of
        its own, and wait for the broker's acknowledgement. False when it did not come in `timeout_s`;
        nothing is kept for later then. For a leader's claim: a claim in the spool is not a claim."""
        producer = None
        try:
            producer = build_client(KafkaProducer, client_id=f"{self._client_id}-claim", acks="all",
                                    allow_auto_create_topics=False, max_block_ms=int(timeout_s * 1000),
                                    **self._client_config())
            key, value = _encoded(topic, record)
            producer.send(self.names[topic], key=key.encode(), value=value,
                          partition=_partition(topic)).get(timeout_s)
            return True
        except Exception as e:
            log.warning("sending a %s record failed: %s", topic, describe(e))
            return False
        finally:
            if producer is not None:
                force_close(producer)

    def tail(self, topics: list[Topic], last: int) -> KafkaSubscription:
        """Every partition of the topics (no group), from about their `last` most recent records on
        (shared over the partitions), then every new record."""
        return KafkaSubscription(self, list(topics), None, tail=last)

    def follow(self, topics: list[Topic], keys: Collection[str]) -> KafkaSubscription:
        """Every partition of keyed topics (rollouts, reports): first each of `keys`' latest valid record
        (a newer tombstone or undecodable one is skipped and counted as bad_record), found reading back
        from the end whether or not the broker compacts, then every new record."""
        return KafkaSubscription(self, list(topics), None, latest_of=keys)

    def leadership(self, group: str) -> KafkaLeadership:
        """Membership of `group` on the control topic: the member holding its partition leads."""
        return KafkaLeadership(self, group)

    async def close(self) -> None:
        """Send what can be sent within `close_timeout_s`; the rest stays in the spool for the next start."""
        self._closed = True
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self._close_timeout_s + 10.0)
            if self._thread.is_alive():
                log.error("kafka sender thread did not stop in time")

    async def replay(self, topics: list[Topic], group: str, since_ts: float, handle: Callable[[Record], object],
                     stop: asyncio.Event | None = None, *, stall_timeout_s: float = 30.0) -> int:
        return await replay(self, topics, group, since_ts, handle, stop, stall_timeout_s=stall_timeout_s)

    # ---- introspection (tests, status) --------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._producer is not None

    @property
    def idempotent(self) -> bool | None:
        """Whether the current producer is idempotent (None before the first connection)."""
        return self._idempotent

    @property
    def spooled(self) -> int:
        return len(self._spool)

    # ---- sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._spool.open()
        except Exception:
            log.exception("cannot open the spool at %s; failed sends will be dropped", self._spool.root)
        try:
            self._connect()
        finally:
            self._ready.set()
        while True:
            try:
                stopping = self._stopping.is_set()
                busy = self._producer is not None and len(self._spool) > 0 and not stopping
                self._drain(block=not busy and not stopping)
                if self._tripped.is_set():
                    self._trip()
                if stopping and self._queue.empty():
                    break
                if self._producer is None:
                    if not stopping and time.monotonic() >= self._next_probe:
                        self._connect()
                elif busy:
                    self._replay_chunk_once()
                self._settled = self._handled  # what went to the spool is with the OS already
            except Exception:
                log.exception("kafka sender loop error")
                time.sleep(0.1)
        self._shutdown()

    def _drain(self, block: bool) -> None:
        try:
            item = self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        self._handle(*item)
        for _ in range(5000):
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)
            if self._tripped.is_set():
                return

    def _handle(self, topic: Topic, record: Record, ticket: int) -> None:
        try:
            self._handle_one(topic, record, ticket)
        finally:
            self._handled = ticket

    def _handle_one(self, topic: Topic, record: Record, ticket: int) -> None:
        if self._tripped.is_set():
            self._trip()  # spool the failed in-flight records first: order is kept
        try:
            key, value = _encoded(topic, record)
        except Exception as e:
            metrics.events_dropped_total.labels(topic, "bad_record").inc()
            log.warning("cannot serialise a %s record: %s", topic, e)
            return
        if self._producer is not None and len(self._spool) == 0:
            self._send(_Pending(topic, key, value, ticket))
        else:
            self._spool_one(topic, key, value)

    def _spool_one(self, topic: Topic, key: str, value: bytes) -> None:
        if not self._spooling_said:
            self._spooling_said = True
            log.warning("kafka not available at %s; spooling records in %s until it is back",
                        self.kafka.bootstrap_servers, self._spool.slot or self._spool.root)
        try:
            kept = self._spool.append(topic, key, value)
        except Exception:  # counted like any record the spool could not keep; the next ones go on
            log.exception("spooling a %s record failed", topic)
            metrics.events_dropped_total.labels(topic, "spool_error").inc()
            kept = False
        if not kept:
            self._count_lost()

    def _send(self, item: _Pending) -> None:
        seq = next(self._seq)
        with self._lock:
            self._inflight[seq] = item
        try:
            assert self._producer is not None
            future = self._producer.send(self.names[item.topic], key=item.key.encode(), value=item.value,
                                         partition=_partition(item.topic))
        except _TOO_LARGE as e:  # this record can never be sent; the producer is fine
            with self._lock:
                self._inflight.pop(seq, None)
            metrics.events_dropped_total.labels(item.topic, "too_large").inc()
            log.warning("dropped a %s record of %d bytes: %s", item.topic, len(item.value), describe(e))
            return
        except Exception as e:
            self._on_error(seq, e)
            return
        future.add_callback(self._on_delivered, seq)
        future.add_errback(self._on_error, seq)

    def _on_delivered(self, seq: int, _metadata: object) -> None:
        with self._lock:  # counted before it leaves flight: a flush that returned has it counted
            item = self._inflight.get(seq)
            if item is not None:
                self._published[item.topic].inc()
                del self._inflight[seq]

    def _on_error(self, seq: int, exc: BaseException) -> None:
        with self._lock:
            item = self._inflight.pop(seq, None)
            if item is None:
                return
            self._failed.append((seq, item, exc))
        self._tripped.set()

    def _trip(self, closing: bool = False) -> None:
        """A send failed (or we are closing): drop the producer, spool every unconfirmed record in send order."""
        producer, self._producer = self._producer, None
        if producer is not None:
            if not closing:
                first = self._failed[0][2] if self._failed else None
                log.warning("kafka send failed (%s); spooling until the broker is back", describe(first))
                self._spooling_said = True
            force_close(producer)
        deadline = time.monotonic() + 2.0
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            failed, self._failed = self._failed, []
            leftover, self._inflight = self._inflight, {}
            items: list[tuple[int, _Pending, BaseException | None]] = [(seq, item, exc) for seq, item, exc in failed]
            items += [(seq, item, None) for seq, item in leftover.items()]
            self._spooling = [item for _, item, _ in items]  # still unsettled for flush()
            self._tripped.clear()
        try:
            for _, item, exc in sorted(items, key=lambda x: x[0]):
                if isinstance(exc, _TOO_LARGE):
                    metrics.events_dropped_total.labels(item.topic, "too_large").inc()
                else:
                    self._spool_one(item.topic, item.key, item.value)
        finally:
            with self._lock:
                self._spooling = []
        self._schedule_probe()

    def _schedule_probe(self) -> None:
        self._next_probe = time.monotonic() + self._probe_delay
        self._probe_delay = min(self._probe_max, self._probe_delay * 2)

    def _client_config(self) -> dict[str, Any]:
        return {
            "bootstrap_servers": self.kafka.bootstrap_servers,
            "request_timeout_ms": int(self._request_timeout_s * 1000),
            "bootstrap_timeout_ms": int(self._request_timeout_s * 1000),
            "reconnect_backoff_max_ms": 1000,
            **self._security,
        }

    def _connect(self) -> bool:
        """Probe the broker; when it answers, ensure topics, build a producer and refresh its metadata."""
        if not broker_reachable(self.kafka.bootstrap_servers):
            self._schedule_probe()
            return False
        producer = None
        try:
            create_missing_topics(self._client_id, self._client_config(), self.names, self.kafka)
            producer = build_client(
                KafkaProducer,
                client_id=f"{self._client_id}-producer",
                acks="all",
                linger_ms=self.kafka.linger_ms,
                compression_type=self.kafka.compression_type,
                delivery_timeout_ms=int(self._delivery_timeout_s * 1000),
                max_block_ms=int(self._request_timeout_s * 1000),
                allow_auto_create_topics=False,
                **self._client_config(),
            )
            for name in self.names.values():  # refresh metadata for every topic now, not on first send
                producer.partitions_for(name)
        except Exception as e:
            log.warning("kafka not ready at %s: %s", self.kafka.bootstrap_servers, describe(e))
            if producer is not None:
                force_close(producer)
            self._schedule_probe()
            return False
        self._producer = producer
        self._idempotent = bool(producer.config.get("enable_idempotence"))
        self._probe_delay = self._probe_min
        waiting = len(self._spool)
        self._spooling_said = self._spooling_said and waiting > 0
        log.info("kafka connected at %s (idempotent=%s); %d spooled records to replay",
                 self.kafka.bootstrap_servers, self._idempotent, waiting)
        return True

    def _replay_chunk_once(self) -> None:
        batch = self._spool.read(self._replay_chunk)
        if batch is None:  # what was left could not be read (counted as bad_record)
            self._replayed()
            return
        producer = self._producer
        assert producer is not None
        futures = []
        failure: BaseException | None = None
        for entry in batch.entries:
            try:
                futures.append(producer.send(self.names[entry.topic], key=entry.key.encode(), value=entry.value,
                                             partition=_partition(entry.topic)))
            except _TOO_LARGE as e:
                futures.append(e)
            except Exception as e:
                failure = e
                break
        failure = failure or self._await_delivery(producer, time.monotonic() + self._delivery_timeout_s + 1.0)
        done = self._count_replayed(batch, futures)
        self._spool.commit(batch, done)
        if self._stopping.is_set() and done < len(batch.entries):  # closing: the rest replays at the next start
            self._producer = None
            force_close(producer)
            return
        if done < len(batch.entries):
            if failure is None:
                bad = futures[done]
                failure = bad.exception if hasattr(bad, "exception") else None
            self._failed_replay(failure)
        elif len(self._spool) == 0:
            self._replayed()

    def _replayed(self) -> None:
        log.info("spool replayed; sending directly again")
        self._spooling_said = False

    def _await_delivery(self, producer: KafkaProducer, deadline: float) -> BaseException | None:
        """Flush until `deadline`, in short waits so that `close()` is not held up by a silent broker
        (the chunk stays in the spool; records published meanwhile must still reach it). The error
        that ended it, if any."""
        while True:
            try:
                producer.flush(timeout=max(0.0, min(REPLAY_WAIT_S, deadline - time.monotonic())))
                return None
            except KafkaTimeoutError as e:
                if self._stopping.is_set() or time.monotonic() >= deadline:
                    timed_out: BaseException = e  # kafka-python ships no type hints
                    return timed_out
            except Exception as e:
                return e

    def _count_replayed(self, batch: SpoolBatch, futures: list) -> int:
        """How many entries from the front are settled (delivered, or dropped as too large)."""
        done = 0
        for entry, fut in zip(batch.entries, futures, strict=False):
            if isinstance(fut, BaseException):
                metrics.events_dropped_total.labels(entry.topic, "too_large").inc()
            elif fut.is_done and fut.exception is None:
                self._published[entry.topic].inc()
            elif fut.is_done and isinstance(fut.exception, _TOO_LARGE):
                metrics.events_dropped_total.labels(entry.topic, "too_large").inc()
            else:
                break
            done += 1
        return done

    def _failed_replay(self, failure: BaseException | None) -> None:
        producer, self._producer = self._producer, None
        log.warning("spool replay failed (%s); retrying when the broker is back", describe(failure))
        if producer is not None:
            force_close(producer)
        self._schedule_probe()

    def _shutdown(self) -> None:
        producer = self._producer
        if producer is not None and len(self._spool) == 0:
            try:
                producer.flush(timeout=self._close_timeout_s)
            except Exception:
                pass
        # whatever is not confirmed now goes to the spool
        if producer is not None or self._inflight or self._failed:
            self._trip(closing=True)
        self._producer = None
        try:
            self._spool.close()
        except Exception:
            log.exception("closing the spool failed")
        self._settled = self._handled
        if len(self._spool):
            log.info("%d records left in the spool for the next start", len(self._spool))


