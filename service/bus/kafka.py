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
import os
import queue
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import MessageSizeTooLargeError, RecordListTooLargeError
from kafka.structs import OffsetAndMetadata

from service import metrics
from service.bus.base import TOPICS, Topic, record_key
from service.bus.spool import Spool, SpoolBatch
from service.config import KafkaConfig, SpoolConfig
from service.records import Record, dump, load

log = logging.getLogger("modelcanary.bus.kafka")

# Keys accepted in `events.kafka.security`, passed to kafka-python as they are.
# `<key>_env` names an environment variable that holds the value instead (how secrets are given).
SECURITY_KEYS = frozenset({
    "security_protocol", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password",
    "sasl_kerberos_name", "sasl_kerberos_service_name", "sasl_kerberos_domain_name",
    "ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_crlfile", "ssl_password", "ssl_ciphers",
    "ssl_check_hostname",
})

_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)


def client_security(security: dict | None) -> dict[str, Any]:
    """kafka-python keyword arguments from `events.kafka.security`. Errors name the key, never a value."""
    out: dict[str, Any] = {}
    for key, value in (security or {}).items():
        if key.endswith("_env") and key[:-4] in SECURITY_KEYS:
            resolved = os.environ.get(str(value))
            if resolved is None:
                raise ValueError(f"events.kafka.security.{key}: environment variable {value!r} is not set")
            out[key[:-4]] = resolved
        elif key in SECURITY_KEYS:
            out[key] = value
        else:
            raise ValueError(
                f"events.kafka.security: unknown key {key!r} "
                f"(accepted: {', '.join(sorted(SECURITY_KEYS))}, each also as <key>_env naming an environment variable)"
            )
    return out


_CODEC_PACKAGES = {"gzip": ("has_gzip", "(standard library)"), "snappy": ("has_snappy", "python-snappy"),
                   "lz4": ("has_lz4", "lz4"), "zstd": ("has_zstd", "zstandard")}


def check_compression(compression_type: str | None) -> None:
    """Fail at start, naming the field, when the codec's library is missing (kafka-python would only
    fail when the producer is built, and every record would wait in the spool)."""
    if compression_type is None:
        return
    from kafka import codec

    check, package = _CODEC_PACKAGES[compression_type]
    if not getattr(codec, check)():
        raise ValueError(f"events.kafka.compression_type: {compression_type!r} needs the Python package "
                         f"{package!r}, which is not installed (or use gzip)")


def topic_names(prefix: str) -> dict[Topic, str]:
    return {t: f"{prefix}.{t}" for t in TOPICS}


def ensure_topics(admin: KafkaAdminClient, names: dict[Topic, str], partitions: int) -> list[str]:
    """Create the missing topics (rollouts gets one partition: one ordered history). Returns those created."""
    existing = set(admin.list_topics())
    missing = {
        name: {"num_partitions": 1 if t == "rollouts" else partitions, "replication_factor": -1}
        for t, name in names.items() if name not in existing
    }
    if not missing:
        return []
    result = admin.create_topics(missing, raise_errors=False)
    created = []
    for t in result.get("topics", []):
        code = t.get("error_code", 0)
        if code == 0:
            created.append(t["name"])
        elif code != 36:  # 36: TOPIC_ALREADY_EXISTS (another replica won the race)
            raise RuntimeError(f"cannot create topic {t['name']}: {t.get('error_message') or code}")
    if created:
        log.info("created topics %s", ", ".join(sorted(created)))
    return created


def build_client(cls: type, **config: Any) -> Any:
    """A kafka-python KafkaAdminClient, KafkaProducer or KafkaConsumer that leaks nothing when it fails.

    Their constructors make a network client (an epoll fd, a wake-up socket pair, an I/O thread) and
    then connect; when the connection fails (a broker that is down or answers nothing) they raise
    without closing it, and nothing can close it later. Every failed reconnect during an outage
    would leak those. Here the network client is captured as it is made and closed on failure."""
    base = getattr(cls, "DEFAULT_CONFIG", {}).get("kafka_client")
    if base is None or "kafka_client" in config:
        return cls(**config)
    made: list = []

    def network_client(**kw: Any) -> Any:
        client = base(**kw)
        made.append(client)
        return client

    try:
        return cls(kafka_client=network_client, **config)
    except BaseException:
        for client in made:
            try:
                client.close()
            except Exception as e:
                log.debug("closing a half-built kafka client: %s", _describe(e))
        raise


def broker_reachable(bootstrap_servers: str, timeout_s: float = 0.5) -> bool:
    """A cheap TCP check before a full Kafka handshake (which retries and logs for seconds)."""
    for server in bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        if not host:
            host, port = server.strip(), "9092"
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            continue
    return False


@dataclass(frozen=True)
class _Pending:
    topic: Topic
    key: str
    value: bytes
    ticket: int = 0  # publish order (flush); 0 for records replayed from the spool


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
        check_compression(kafka.compression_type)
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
        """Hand `handle` (on the event loop) every record of `topics` that `group` already consumed and
        that was written at or after `since_ts`: in each partition, from the first offset whose
        timestamp is >= since_ts (offsets_for_times) up to the group's committed offset. This is how a
        restarted consumer rebuilds state it kept in memory; the group itself goes on from its commits,
        so nothing is handed twice. Partitions the group never committed are skipped (the group reads
        them from the beginning anyway). Returns how many records were handed over; stops early (with a
        warning) when the broker gives nothing for `stall_timeout_s`, or when `stop` is set."""
        chunks: queue.Queue[list[Record] | BaseException | None] = queue.Queue(maxsize=4)
        halt = threading.Event()

        def put(item: list[Record] | BaseException | None) -> None:
            while not halt.is_set():
                try:
                    chunks.put(item, timeout=0.2)
                    return
                except queue.Full:
                    continue

        def run() -> None:
            try:
                for chunk in self._read_back(topics, group, since_ts, halt, stall_timeout_s):
                    put(chunk)
            except Exception as e:
                put(e)
            finally:
                put(None)

        def take() -> list[Record] | BaseException | None | bool:
            try:
                return chunks.get(timeout=0.5)
            except queue.Empty:
                return False

        thread = threading.Thread(target=run, name="modelcanary-kafka-replay", daemon=True)
        thread.start()
        n = 0
        try:
            while stop is None or not stop.is_set():
                item = await asyncio.to_thread(take)
                if item is False:
                    continue
                if item is None:
                    break
                if isinstance(item, BaseException):
                    log.warning("reading %s back failed: %s; going on with %d records",
                                ", ".join(topics), _describe(item), n)
                    break
                for record in item:
                    handle(record)
                n += len(item)
        finally:
            halt.set()
            await asyncio.to_thread(thread.join, 10.0)
        return n

    def _read_back(self, topics: list[Topic], group: str, since_ts: float, halt: threading.Event,
                   stall_timeout_s: float):
        """replay()'s reader (its own thread and consumer): chunks of records, in each partition's order."""
        consumer = build_client(
            KafkaConsumer, client_id=f"{self._client_id}-replay", group_id=group, enable_auto_commit=False,
            auto_offset_reset="earliest", allow_auto_create_topics=False, **self._client_config())
        try:
            names = {self.names[t]: t for t in topics}
            tps = [TopicPartition(name, p) for name in names for p in sorted(consumer.partitions_for_topic(name) or ())]
            if not tps:
                return
            timeout_ms = int(self._request_timeout_s * 1000)
            found = consumer.offsets_for_times({tp: int(since_ts * 1000) for tp in tps}, timeout_ms=timeout_ms)
            ends: dict[TopicPartition, int] = {}
            for tp in tps:
                start = found.get(tp)
                # no record that new: None, or (Tansu) offset 0 with timestamp -1
                if start is None or start.timestamp < 0:
                    continue
                committed = consumer.committed(tp, timeout_ms=timeout_ms)
                if committed is not None and start.offset < committed:
                    ends[tp] = committed
                    log.debug("reading %s[%d] back from %d to %d", tp.topic, tp.partition, start.offset, committed)
            if not ends:
                return
            consumer.assign(list(ends))
            for tp in ends:
                consumer.seek(tp, found[tp].offset)
            last_progress = time.monotonic()
            while ends and not halt.is_set():
                raw = consumer.poll(timeout_ms=300, max_records=2000)
                chunk: list[Record] = []
                for tp, messages in raw.items():
                    end = ends.get(tp)
                    if end is None:
                        continue
                    for m in messages:
                        if m.offset >= end:
                            break
                        try:
                            chunk.append(load(json.loads(m.value)))
                        except Exception:
                            log.warning("skipped an undecodable record at %s[%d]@%d", tp.topic, tp.partition, m.offset)
                for tp in [tp for tp, end in ends.items() if consumer.position(tp) >= end]:
                    del ends[tp]
                    consumer.pause(tp)
                if raw:
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > stall_timeout_s:
                    log.warning("reading %s back: nothing for %.0f s; going on without the rest",
                                ", ".join(topics), stall_timeout_s)
                    return
                if chunk:
                    yield chunk
        finally:
            consumer.close(autocommit=False)

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
                self._spool.flush()
                self._settled = self._handled
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
            key = record_key(topic, record)
            value = json.dumps(dump(record), separators=(",", ":")).encode()
        except Exception as e:
            metrics.events_dropped_total.labels(topic, "bad_record").inc()
            log.warning("cannot serialise a %s record: %s", topic, e)
            return
        if self._producer is not None and len(self._spool) == 0:
            self._send(_Pending(topic, key, value, ticket))
        else:
            self._spool_one(topic, key, value)

    def _spool_one(self, topic: Topic, key: str, value: bytes) -> None:
        if not self._spool.append(topic, key, value):
            self._count_lost()

    def _send(self, item: _Pending) -> None:
        seq = next(self._seq)
        with self._lock:
            self._inflight[seq] = item
        try:
            assert self._producer is not None
            future = self._producer.send(self.names[item.topic], key=item.key.encode(), value=item.value)
        except _TOO_LARGE as e:  # this record can never be sent; the producer is fine
            with self._lock:
                self._inflight.pop(seq, None)
            metrics.events_dropped_total.labels(item.topic, "too_large").inc()
            log.warning("dropped a %s record of %d bytes: %s", item.topic, len(item.value), _describe(e))
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
                log.warning("kafka send failed (%s); spooling until the broker is back", _describe(first))
            _force_close(producer)
        deadline = time.monotonic() + 2.0
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            failed, self._failed = self._failed, []
            leftover, self._inflight = self._inflight, {}
            items = [(seq, item, exc) for seq, item, exc in failed]
            items += [(seq, item, None) for seq, item in leftover.items()]
            self._spooling = [item for _, item, _ in items]  # still unsettled for flush()
            self._tripped.clear()
        try:
            for _, item, exc in sorted(items, key=lambda x: x[0]):
                if isinstance(exc, _TOO_LARGE):
                    metrics.events_dropped_total.labels(item.topic, "too_large").inc()
                else:
                    self._spool_one(item.topic, item.key, item.value)
            self._spool.flush()
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
            admin = build_client(KafkaAdminClient, client_id=f"{self._client_id}-admin", **self._client_config())
            try:
                ensure_topics(admin, self.names, self.kafka.partitions)
            finally:
                admin.close()
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
            log.warning("kafka not ready at %s: %s", self.kafka.bootstrap_servers, _describe(e))
            if producer is not None:
                _force_close(producer)
            self._schedule_probe()
            return False
        self._producer = producer
        self._idempotent = bool(producer.config.get("enable_idempotence"))
        self._probe_delay = self._probe_min
        waiting = len(self._spool)
        log.info("kafka connected at %s (idempotent=%s); %d spooled records to replay",
                 self.kafka.bootstrap_servers, self._idempotent, waiting)
        return True

    def _replay_chunk_once(self) -> None:
        batch = self._spool.read(self._replay_chunk)
        if batch is None:
            return
        producer = self._producer
        assert producer is not None
        futures = []
        failure: BaseException | None = None
        for entry in batch.entries:
            try:
                futures.append(producer.send(self.names[entry.topic], key=entry.key.encode(), value=entry.value))
            except _TOO_LARGE as e:
                futures.append(e)
            except Exception as e:
                failure = e
                break
        try:
            producer.flush(timeout=self._delivery_timeout_s + 1.0)
        except Exception as e:
            failure = failure or e
        done = self._count_replayed(batch, futures)
        self._spool.commit(batch, done)
        if done < len(batch.entries):
            if failure is None:
                bad = futures[done]
                failure = bad.exception if hasattr(bad, "exception") else None
            self._failed_replay(failure)
        else:
            self._spool.flush()
            if len(self._spool) == 0:
                log.info("spool replayed; sending directly again")

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
        log.warning("spool replay failed (%s); retrying when the broker is back", _describe(failure))
        if producer is not None:
            _force_close(producer)
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


def _describe(e: BaseException | None) -> str:
    if e is None:
        return "no confirmation"
    text = str(e)
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def _force_close(producer: KafkaProducer) -> None:
    """Close a producer now, failing its unconfirmed sends (their errbacks run before this returns).

    kafka-python's `close(timeout=0)` raises from its flush while batches are pending and leaves the
    I/O thread running, so the sender is force-closed first (a private attribute, guarded)."""
    sender = getattr(producer, "_sender", None)
    try:
        if sender is not None:
            sender.force_close()
            sender.join(2.0)
        producer.close(timeout=0 if sender is not None else 1)
    except Exception as e:
        log.debug("producer close: %s", _describe(e))


# ---- consuming -----------------------------------------------------------------------------------

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
    bounded well below the interval, come between two polls), and a join that completes between two
    short polls is not lost (kafka-python 3.0 drops such a join and re-joins). The interval is also
    the rebalance timeout a join waits for, which is why it stays small: joins take ~3 s.
    When the buffer is full the partitions are paused. `group=None`: every partition from the
    beginning, no group, no commits.
    """

    max_poll_records = 50
    max_poll_interval_ms = 10000
    session_timeout_ms = 6000
    heartbeat_interval_ms = 1000
    poll_timeout_ms = 100
    metadata_max_age_ms = 5000

    def __init__(self, bus: KafkaBus, topics: list[Topic], group: str | None):
        self._bus = bus
        self.topics = topics
        self.group = group
        self._names = {bus.names[t]: t for t in topics}
        self._label = group or "none"
        self._max_buffer = self.max_poll_records * 4
        self._buffer: deque[tuple[TopicPartition, int, Record]] = deque()
        self._lock = threading.Lock()
        self._returned: dict[TopicPartition, int] = {}  # next offset to commit, per partition
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], ConcurrentFuture]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None
        self._consumer: KafkaConsumer | None = None
        self._retry_at = 0.0
        self._next_lag = 0.0
        self._next_check = 0.0
        self._topic_ids: dict[str, object] = {}
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
            n = min(max_records, len(self._buffer))
            out = []
            for _ in range(n):
                tp, offset, record = self._buffer.popleft()
                self._returned[tp] = offset + 1
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
                self._backpressure(consumer)
                raw = consumer.poll(timeout_ms=self.poll_timeout_ms, max_records=self.max_poll_records)
            except Exception as e:
                log.warning("kafka consumer (%s) failed: %s; reconnecting", self._label, _describe(e))
                self._drop_consumer()
                self._retry_at = time.monotonic() + 1.0
                continue
            if raw:
                self._buffer_records(raw)
            self._maybe_export_lag(consumer)
        self._run_commands()
        self._drop_consumer()
        for topic in self.topics:
            _set_lag(topic, self._label, id(self), None)

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
        decoded = []
        for tp, messages in raw.items():
            for m in messages:
                try:
                    decoded.append((tp, m.offset, load(json.loads(m.value))))
                except Exception:
                    metrics.events_dropped_total.labels(self._names.get(tp.topic, tp.topic), "bad_record").inc()
                    log.warning("skipped an undecodable record at %s[%d]@%d", tp.topic, tp.partition, m.offset)
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

    def _ensure_consumer(self) -> KafkaConsumer | None:
        if self._consumer is not None:
            return self._consumer
        if time.monotonic() < self._retry_at:
            return None
        bus = self._bus
        if not broker_reachable(bus.kafka.bootstrap_servers):
            self._retry_at = time.monotonic() + 1.0
            return None
        consumer = None
        try:
            admin = build_client(KafkaAdminClient, client_id=f"{bus._client_id}-admin", **bus._client_config())
            try:
                ensure_topics(admin, bus.names, bus.kafka.partitions)
            finally:
                admin.close()
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
            consumer = build_client(KafkaConsumer, **config)
            if self.group is not None:
                consumer.subscribe(list(self._names), listener=_Revoked(self))
            else:
                self._assign_all(consumer)
        except Exception as e:
            log.warning("kafka consumer (%s) not ready: %s", self._label, _describe(e))
            if consumer is not None:
                try:
                    consumer.close(autocommit=False)
                except Exception:
                    pass
            self._retry_at = time.monotonic() + 1.0
            return None
        self._consumer = consumer
        return consumer

    def _drop_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
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

    def _assign_all(self, consumer: KafkaConsumer) -> None:
        tps = []
        for name in self._names:
            parts = consumer.partitions_for_topic(name) or set()
            tps += [TopicPartition(name, p) for p in sorted(parts)]
        with self._lock:
            self._buffer.clear()
        consumer.assign(tps)
        if tps:
            consumer.seek_to_beginning(*tps)
        self._topic_ids = {name: _topic_id(consumer, name) for name in self._names}
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
        assigned = consumer.assignment()
        replaced: set[str] = set()
        for name in self._names:
            tid = _topic_id(consumer, name)
            if tid is None:
                continue
            if self._topic_ids.get(name) not in (None, tid):
                replaced.add(name)
            self._topic_ids[name] = tid
        if self.group is None:
            shape = {tp.topic for tp in assigned} != set(self._names) or any(
                (parts := consumer.partitions_for_topic(name)) is not None
                and len(parts) != sum(1 for tp in assigned if tp.topic == name)
                for name in self._names
            )
            if replaced or shape:
                log.info("follower: %s changed; reading from the beginning", ", ".join(sorted(self._names)))
                self._assign_all(consumer)
            return
        stale = [tp for tp in assigned if tp.topic in replaced]
        if stale:
            log.info("consumer group %s: %s was replaced; reading it from the beginning",
                     self.group, ", ".join(sorted(replaced)))
            consumer.seek_to_beginning(*stale)

    def _maybe_export_lag(self, consumer: KafkaConsumer) -> None:
        now = time.monotonic()
        if now < self._next_lag:
            return
        self._next_lag = now + self._bus.lag_interval_s
        try:
            assigned = list(consumer.assignment())
            timeout_ms = int(self._bus._request_timeout_s * 1000)
            ends = consumer.end_offsets(assigned, timeout_ms=timeout_ms) if assigned else {}
            lag: dict[str, int] = {t: 0 for t in self.topics}
            with self._lock:
                buffered = Counter(tp for tp, _, _ in self._buffer)
            for tp, end in ends.items():
                # records buffered here but not yet returned are still behind, for the caller
                lag[self._names[tp.topic]] += max(0, end - consumer.position(tp, timeout_ms=1000) + buffered[tp])
        except Exception as e:
            log.debug("consumer lag unavailable: %s", e)
            return
        for topic, n in lag.items():
            _set_lag(topic, self._label, id(self), n)

    def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        consumer = self._consumer
        if consumer is None:
            return  # reconnected since: those records come again (at least once)
        owned = consumer.assignment()
        mine = {tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items() if tp in owned}
        if not mine:
            return
        try:
            # bounded well inside max_poll_interval_ms: this thread must get back to polling (a
            # coordinator that is away would otherwise hold it for the whole request timeout)
            consumer.commit(mine, timeout_ms=self.max_poll_interval_ms // 2)
        except Exception as e:
            log.warning("kafka commit (%s) failed: %s; those records will be delivered again",
                        self._label, _describe(e))


class _Revoked(ConsumerRebalanceListener):
    def __init__(self, sub: KafkaSubscription):
        self._sub = sub

    def on_partitions_revoked(self, revoked):
        self._sub._purge(set(revoked))

    def on_partitions_assigned(self, assigned):
        pass


def _topic_id(consumer: KafkaConsumer, name: str) -> object | None:
    cluster = getattr(getattr(consumer, "_client", None), "cluster", None)
    getter = getattr(cluster, "topic_id", None)
    try:
        return getter(name) if getter else None
    except Exception:
        return None


# ---- sync helpers for tests and tools ----------------------------------------------------------


@dataclass(frozen=True)
class Message:
    topic: str
    partition: int
    offset: int
    key: str | None
    value: dict


READ_MAX_RECORDS = 10000
READ_SETTLE_POLLS = 2


def read_messages(bootstrap: str, topic: str, timeout_s: float = 10.0,
                  security: dict | None = None) -> list[Message]:
    """Every message of a topic from the beginning (no group), in partition/offset order.

    Reads until caught up with what the topic held when the call started, then polls twice more (up
    to 0.3 s each: a record written just before the call still comes, as it always did), so a topic
    being written returns about as promptly as an idle one; `timeout_s` bounds the whole call.

    End offsets are snapshot first. Tansu reports one past the *first* record of a partition's last
    batch, not one past its last record; once a poll returns that record, the rest of its batch came
    in the same fetch, and a poll not cut short by `max_records` returns all of it. So a partition is
    caught up when its position reaches the snapshot after such a poll.
    """
    consumer = build_client(
        KafkaConsumer,
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
        request_timeout_ms=int(timeout_s * 1000), bootstrap_timeout_ms=int(timeout_s * 1000),
        **client_security(security),
    )
    try:
        deadline = time.monotonic() + timeout_s
        parts = consumer.partitions_for_topic(topic)
        while parts is None and time.monotonic() < deadline:
            time.sleep(0.1)
            parts = consumer.partitions_for_topic(topic)
        if not parts:
            return []
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out: list[Message] = []
        behind = {tp for tp in tps if consumer.position(tp) < ends[tp]}
        settling = 0  # polls since caught up
        while settling < READ_SETTLE_POLLS and time.monotonic() < deadline:
            settling += 0 if behind else 1
            batch = consumer.poll(timeout_ms=300, max_records=READ_MAX_RECORDS)
            got = 0
            for tp, messages in batch.items():
                got += len(messages)
                for m in messages:
                    out.append(Message(tp.topic, tp.partition, m.offset,
                                       m.key.decode() if m.key is not None else None, _json_or_raw(m.value)))
            if behind and got < READ_MAX_RECORDS:  # nothing fetched was held back: each batch came whole
                behind = {tp for tp in behind if consumer.position(tp) < ends[tp]}
        return sorted(out, key=lambda m: (m.partition, m.offset))
    finally:
        consumer.close(autocommit=False)


def read_topic(bootstrap: str, topic: str, timeout_s: float = 10.0, security: dict | None = None) -> list[dict]:
    """The values (record dicts) of a whole topic from the beginning, without a group."""
    return [m.value for m in read_messages(bootstrap, topic, timeout_s, security)]


def _json_or_raw(value: bytes | None) -> dict:
    try:
        data = json.loads(value) if value is not None else None
    except ValueError:
        data = None
    return data if isinstance(data, dict) else {"_raw": value.decode("utf-8", "replace") if value else None}


__all__ = ["KafkaBus", "KafkaSubscription", "Message", "client_security", "ensure_topics",
           "read_messages", "read_topic", "topic_names"]
