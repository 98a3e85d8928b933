"""Reading topics back: a restarted consumer's evidence (replay) and whole topics for tests and tools."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kafka import KafkaConsumer, TopicPartition

from service.bus.base import Topic
from service.bus.kafka.admin import build_client, client_security, describe, key_text
from service.config import KafkaSecurity
from service.records import Record, load

log = logging.getLogger("modelcanary.bus.kafka")

if TYPE_CHECKING:
    from service.bus.kafka.producer import KafkaBus


async def replay(bus: KafkaBus, topics: list[Topic], group: str, since_ts: float, handle: Callable[[Record], object],  # noqa: C901 - one hand-off loop between the reader thread and the event loop
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
            for chunk in _read_back(bus, topics, group, since_ts, halt, stall_timeout_s):
                put(chunk)
        except Exception as e:
            put(e)
        finally:
            put(None)

    def take() -> list[Record] | BaseException | None | Literal[False]:
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
                            ", ".join(topics), describe(item), n)
                break
            for record in item:
                handle(record)
            n += len(item)
    finally:
        halt.set()
        await asyncio.to_thread(thread.join, 10.0)
    return n

def _read_back(bus: KafkaBus, topics: list[Topic], group: str, since_ts: float, halt: threading.Event,  # noqa: C901 - seek, read and stall detection share one consumer's state
               stall_timeout_s: float) -> Iterator[list[Record]]:
    """replay()'s reader (its own thread and consumer): chunks of records, in each partition's order."""
    consumer = build_client(
        KafkaConsumer, client_id=f"{bus._client_id}-replay", group_id=group, enable_auto_commit=False,
        auto_offset_reset="earliest", allow_auto_create_topics=False, **bus._client_config())
    try:
        names = {bus.names[t]: t for t in topics}
        tps = [TopicPartition(name, p) for name in names for p in sorted(consumer.partitions_for_topic(name) or ())]
        if not tps:
            return
        timeout_ms = int(bus._request_timeout_s * 1000)
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
                  security: KafkaSecurity | None = None) -> list[Message]:
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
        allow_auto_create_topics=False,  # asking a missing topic's partitions would create it, with the broker's count
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
                    out.append(Message(tp.topic, tp.partition, m.offset, key_text(m.key), _json_or_raw(m.value)))
            if behind and got < READ_MAX_RECORDS:  # nothing fetched was held back: each batch came whole
                behind = {tp for tp in behind if consumer.position(tp) < ends[tp]}
        return sorted(out, key=lambda m: (m.partition, m.offset))
    finally:
        consumer.close(autocommit=False)


def read_topic(bootstrap: str, topic: str, timeout_s: float = 10.0, security: KafkaSecurity | None = None) -> list[dict]:
    """The values (record dicts) of a whole topic from the beginning, without a group."""
    return [m.value for m in read_messages(bootstrap, topic, timeout_s, security)]


def _json_or_raw(value: bytes | None) -> dict:
    try:
        data = json.loads(value) if value is not None else None
    except ValueError:
        data = None
    return data if isinstance(data, dict) else {"_raw": value.decode("utf-8", "replace") if value else None}

