"""The Kafka event bus against a real broker (Tansu): delivery, groups, followers, outage, spool."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from service.bus.kafka import (
    KafkaBus,
    KafkaSubscription,
    check_compression,
    client_security,
    read_messages,
    read_topic,
)
from service.bus.spool import Spool
from service.config import ConfigError, KafkaConfig, KafkaSecurity, SpoolConfig, environment_problems, parse_config
from service.records import (
    Agreement,
    CandidateResult,
    EvaluationRecord,
    OutcomeEvent,
    PrimaryResult,
    Repro,
    RolloutState,
    TrafficEvent,
)
from tests.fixtures.broker import TansuBroker, free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
PARTITIONS = 3


# ---- helpers ---------------------------------------------------------------------------------------


def make_bus(bootstrap: str, spool_dir: Path, prefix: str, max_bytes: int = 64 * 1024 * 1024) -> KafkaBus:
    return KafkaBus(
        KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=PARTITIONS, linger_ms=5),
        SpoolConfig(dir=str(spool_dir), max_bytes=max_bytes),
        queue_size=10000,
        delivery_timeout_s=3.0,
        request_timeout_s=2.0,
        probe_interval_s=(0.2, 0.5),
        close_timeout_s=2.0,
        lag_interval_s=0.3,
    )


def prefix() -> str:
    return "t" + uuid.uuid4().hex[:8]


def outcome(tag: str, i: int) -> OutcomeEvent:
    return OutcomeEvent(request_id=f"{tag}-{i}", ts=time.time(), route="support-bot", model="stable-m",
                        role="stable", segment="chat", outcome="completed", latency_s=0.1)


def evaluation(tag: str, i: int) -> EvaluationRecord:
    return EvaluationRecord(
        request_id=f"{tag}-e{i}", ts=time.time(), route="support-bot", segment="chat", stable_model="stable-m",
        candidate_model="candidate-m", candidate=CandidateResult(outcome="completed", latency_s=0.2),
        agreement=Agreement(candidate_vs_stable=True), repro=Repro(modelcanary_version="0", config_version="x"),
    )


def rollout(route: str, version: int) -> RolloutState:
    return RolloutState(route=route, stable="stable-m", candidate="candidate-m", phase="canary",
                        canary_weight=version / 100, step_index=version, since=time.time(), version=version)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def published(topic: str = "outcomes") -> float:
    return sample("modelcanary_events_published_total", topic=topic)


def dropped(reason: str, topic: str = "outcomes") -> float:
    return sample("modelcanary_events_dropped_total", topic=topic, reason=reason)


def spooled_gauge(topic: str = "outcomes") -> float:
    return sample("modelcanary_events_spooled", topic=topic)


async def wait_for(cond, timeout_s: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        await asyncio.sleep(step)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def collect(sub, n: int, timeout_s: float) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += await sub.get_batch(100, 0.5)
    return got


def ids(records) -> list[str]:
    return [r.request_id for r in records]


# ---- delivery and consuming --------------------------------------------------------------------------


async def test_round_trip_through_a_group(kafka_broker, tmp_path):
    p, tag = prefix(), "rt"
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        assert bus.connected and bus.idempotent is True  # idempotence works against this broker
        sub = bus.subscribe(["outcomes", "evaluations"], group="rt-group")
        before_o, before_e = published("outcomes"), published("evaluations")
        for i in range(200):
            bus.publish("outcomes", outcome(tag, i))
        for i in range(20):
            bus.publish("evaluations", evaluation(tag, i))
        got = await collect(sub, 220, 30)
        await sub.commit()
        assert sorted(ids(got)) == sorted([f"{tag}-{i}" for i in range(200)] + [f"{tag}-e{i}" for i in range(20)])
        assert {type(r).__name__ for r in got} == {"OutcomeEvent", "EvaluationRecord"}
        await wait_for(lambda: published("outcomes") - before_o == 200, 10, "delivery confirmations")
        assert published("evaluations") - before_e == 20

        messages = read_messages(kafka_broker.bootstrap, f"{p}.outcomes", timeout_s=10)
        assert len(messages) == 200
        assert all(m.key == m.value["request_id"] for m in messages)
        assert {m.value["schema"] for m in messages} == {"modelcanary.outcome/v1"}
        assert len({m.partition for m in messages}) == PARTITIONS  # keyed by request_id: spread out
        assert {m["request_id"] for m in read_topic(kafka_broker.bootstrap, f"{p}.evaluations", 10)} == {
            f"{tag}-e{i}" for i in range(20)
        }
        # every topic exists; rollouts has one partition (one ordered history)
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
        try:
            described = {t["name"]: len(t["partitions"]) for t in admin.describe_topics(
                [f"{p}.{t}" for t in ("outcomes", "traffic", "evaluations", "rollouts")])}
        finally:
            admin.close()
        assert described == {f"{p}.outcomes": 3, f"{p}.traffic": 3, f"{p}.evaluations": 3, f"{p}.rollouts": 1}

        # consumer lag is exported per (topic, group) and drains to 0
        await sub.get_batch(10, 0.5)
        await wait_for(lambda: REGISTRY.get_sample_value(
            "modelcanary_consumer_lag", {"topic": "outcomes", "group": "rt-group"}) == 0.0, 5, "lag gauge")
        await sub.close()
    finally:
        await bus.close()


async def test_two_group_members_split_the_partitions(kafka_broker, tmp_path):
    p, tag = prefix(), "split"
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    a = bus.subscribe(["outcomes"], group="split-group")
    b = bus.subscribe(["outcomes"], group="split-group")
    try:
        got_a: list = []
        got_b: list = []

        async def settle():
            # both members poll until the group has given each of them partitions, together all of them
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ra, rb = await asyncio.gather(a.get_batch(100, 0.3), b.get_batch(100, 0.3))
                got_a.extend(ra)
                got_b.extend(rb)
                pa, pb = await a.assignment(), await b.assignment()
                if pa and pb and len(pa | pb) == PARTITIONS and not pa & pb:
                    return
            raise AssertionError("group never split the partitions")

        await settle()
        for i in range(300):
            bus.publish("outcomes", outcome(tag, i))
        deadline = time.monotonic() + 30
        while len(got_a) + len(got_b) < 300 and time.monotonic() < deadline:
            ra, rb = await asyncio.gather(a.get_batch(100, 0.3), b.get_batch(100, 0.3))
            got_a.extend(ra)
            got_b.extend(rb)
        assert got_a and got_b
        assert not set(ids(got_a)) & set(ids(got_b))
        assert sorted(ids(got_a) + ids(got_b)) == sorted(f"{tag}-{i}" for i in range(300))
    finally:
        await a.close()
        await b.close()
        await bus.close()


async def test_at_least_once_until_committed(kafka_broker, tmp_path):
    p, tag = prefix(), "alo"
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        expected = sorted(f"{tag}-{i}" for i in range(40))
        for i in range(40):
            bus.publish("outcomes", outcome(tag, i))

        first = bus.subscribe(["outcomes"], group="alo-group")
        assert sorted(ids(await collect(first, 40, 20))) == expected
        await first.close()  # no commit: everything comes again

        second = bus.subscribe(["outcomes"], group="alo-group")
        assert sorted(ids(await collect(second, 40, 20))) == expected
        await second.commit()
        await second.close()

        third = bus.subscribe(["outcomes"], group="alo-group")
        for i in range(40, 45):
            bus.publish("outcomes", outcome(tag, i))
        got = ids(await collect(third, 5, 20))
        got += ids(await third.get_batch(100, 1.0))
        assert sorted(got) == sorted(f"{tag}-{i}" for i in range(40, 45))  # only what was not committed
        await third.close()
    finally:
        await bus.close()


async def test_follower_reads_rollouts_from_the_beginning(kafka_broker, tmp_path):
    p = prefix()
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        before = published("rollouts")
        for v in (1, 2, 3):
            bus.publish("rollouts", rollout("support-bot", v))
        bus.publish("rollouts", rollout("search-bot", 7))
        # written before any follower exists: followers start from the beginning
        await wait_for(lambda: published("rollouts") - before == 4, 10, "rollout states delivered")

        followers = [bus.subscribe(["rollouts"], group=None) for _ in range(2)]  # e.g. two replicas
        for follower in followers:
            got = await collect(follower, 4, 15)
            assert [(r.route, r.version) for r in got] == [
                ("support-bot", 1), ("support-bot", 2), ("support-bot", 3), ("search-bot", 7)]
            latest = {r.route: r.version for r in got}
            assert latest == {"support-bot": 3, "search-bot": 7}
        bus.publish("rollouts", rollout("support-bot", 4))
        for follower in followers:
            assert [r.version for r in await collect(follower, 1, 10)] == [4]
            await follower.close()
    finally:
        await bus.close()


async def test_a_tail_starts_near_the_end_of_a_long_topic(kafka_broker, tmp_path):
    """What a starting replica reads to learn recent Responses owners: the last records, not the history."""
    p, tag = prefix(), "tail"
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        for i in range(600):
            bus.publish("outcomes", outcome(tag, i))
            if i % 100 == 99:  # in several batches, as traffic comes
                assert await bus.flush(10)
        sub = bus.tail(["outcomes"], 60)
        got = ids(await collect(sub, 600, 5))
        assert {f"{tag}-{i}" for i in range(590, 600)} <= set(got)  # the newest of every partition
        assert 60 <= len(got) < 300  # ~60, plus what Tansu's end offsets (a batch's start) add
        bus.publish("outcomes", outcome(tag, 600))
        assert ids(await collect(sub, 1, 10)) == [f"{tag}-600"]  # then every new record
        await sub.close()
    finally:
        await bus.close()


async def test_flush_waits_until_the_broker_confirms_or_the_spool_holds_them(fresh_kafka_broker, tmp_path):
    broker = fresh_kafka_broker
    p, tag = prefix(), "flush"
    bus = make_bus(broker.bootstrap, tmp_path / "spool", p)
    assert await bus.flush(1)  # nothing published: nothing to wait for
    for i in range(5):
        bus.publish("outcomes", outcome(tag, i))
    assert not await bus.flush(0.5)  # not started: nothing is confirmed
    await bus.start()
    try:
        assert await bus.flush(10)
        base = published()
        for i in range(5, 305):
            bus.publish("outcomes", outcome(tag, i))
        t0 = time.monotonic()
        assert await bus.flush(10)
        assert published() - base == 300  # every one acknowledged by the broker when flush returned
        print(f"flush of 300 records took {time.monotonic() - t0:.3f} s")

        broker.stop()
        for i in range(305, 345):
            bus.publish("outcomes", outcome(tag, i))
        t0 = time.monotonic()
        assert await bus.flush(15)  # the sends fail after the delivery timeout; then they are spooled
        waited = time.monotonic() - t0
        assert bus.spooled >= 40 and published() - base == 300
        assert waited >= 1.0, waited  # it did wait for their fate, not return at once
        for i in range(345, 350):  # while the spool is not empty, new records go behind it
            bus.publish("outcomes", outcome(tag, i))
        assert await bus.flush(5)
        assert bus.spooled >= 45

        broker.start()
        await wait_for(lambda: bus.spooled == 0, 30, "spool replayed")
        got = {m["request_id"] for m in read_topic(broker.bootstrap, f"{p}.outcomes", 10)}
        assert got == {f"{tag}-{i}" for i in range(305, 350)}  # the broker came back empty
    finally:
        await bus.close()


async def test_memory_bus_flush_is_immediate():
    from service.bus.memory import MemoryBus

    bus = MemoryBus()
    bus.publish("outcomes", outcome("mem", 0))
    assert await bus.flush(0) is True


async def test_slow_work_past_max_poll_interval_keeps_the_membership(kafka_broker, tmp_path, monkeypatch):
    """The consumer thread polls however long the caller holds its records (a shadow worker waits for
    upstream calls that retry), so holding them past max_poll_interval_ms neither drops the member
    from the group nor makes the records come again; the late commit lands."""
    interval_s = 3.0
    monkeypatch.setattr(KafkaSubscription, "max_poll_interval_ms", int(interval_s * 1000))
    p, tag = prefix(), "slow"
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    sub = bus.subscribe(["outcomes"], group="slow-group")
    try:
        for i in range(30):
            bus.publish("outcomes", outcome(tag, i))
        first = await collect(sub, 30, 30)
        assert len(first) == 30
        held = await sub.assignment()
        assert len(held) == PARTITIONS
        await asyncio.sleep(3 * interval_s)  # "slow work": no get_batch, no commit
        assert await sub.assignment() == held
        await sub.commit()
        for i in range(30, 35):
            bus.publish("outcomes", outcome(tag, i))
        later = await collect(sub, 5, 20)
        later += await sub.get_batch(100, 1.0)
        assert sorted(ids(later)) == sorted(f"{tag}-{i}" for i in range(30, 35))  # nothing came again
        await sub.commit()
    finally:
        await sub.close()
    again = bus.subscribe(["outcomes"], group="slow-group")  # a new member starts from the commits
    try:
        bus.publish("outcomes", outcome(tag, 99))
        got = await collect(again, 1, 30)
        got += await again.get_batch(100, 1.0)
        assert ids(got) == [f"{tag}-99"]
    finally:
        await again.close()
        await bus.close()


# read_topic stops once caught up with the snapshot it took; only a read that chases the writer
# (or waits on an idle topic) runs into its timeout. Speed itself is measured in benchmarks/.
READ_TIMEOUT = 30.0


async def test_read_topic_returns_promptly_while_the_topic_is_written(kafka_broker, tmp_path):
    p, tag = prefix(), "busy"
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    stop = asyncio.Event()
    written = 0

    async def writer():
        nonlocal written
        while not stop.is_set():
            for _ in range(50):
                bus.publish("outcomes", outcome(tag, written))
                written += 1
            await asyncio.sleep(0.01)

    try:
        for i in range(2000):
            bus.publish("outcomes", outcome(tag, -i - 1))
        assert await bus.flush(10)
        task = asyncio.create_task(writer())
        await asyncio.sleep(1.0)
        for _ in range(3):
            assert await bus.flush(10)
            confirmed = written  # all of these were on the broker when the read started
            t0 = time.monotonic()
            got = {m["request_id"] for m in await asyncio.to_thread(read_topic, kafka_broker.bootstrap,
                                                                    f"{p}.outcomes", READ_TIMEOUT)}
            took = time.monotonic() - t0
            print(f"read {len(got)} records in {took:.2f} s while the topic was written")
            assert took < READ_TIMEOUT / 2, f"read_topic chased the writer to its timeout ({took:.1f} s)"
            assert got >= {f"{tag}-{-i - 1}" for i in range(2000)} | {f"{tag}-{i}" for i in range(confirmed)}
        stop.set()
        await task
        assert await bus.flush(10)
        t0 = time.monotonic()  # an idle topic: everything, at once
        got = [m["request_id"] for m in read_topic(kafka_broker.bootstrap, f"{p}.outcomes", READ_TIMEOUT)]
        assert sorted(got) == sorted([f"{tag}-{-i - 1}" for i in range(2000)] + [f"{tag}-{i}" for i in range(written)])
        t1 = time.monotonic()
        assert read_topic(kafka_broker.bootstrap, f"{p}.traffic", READ_TIMEOUT) == []  # an empty topic
        print(f"idle read {t1 - t0:.2f} s, empty read {time.monotonic() - t1:.2f} s")
        assert time.monotonic() - t0 < READ_TIMEOUT / 2, "an idle or empty read waited for its timeout"
    finally:
        stop.set()
        await bus.close()


async def test_undecodable_records_are_skipped_and_counted(kafka_broker, tmp_path):
    from kafka import KafkaProducer

    p, tag = prefix(), "bad"
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
        for value in (b"not json", b'{"schema": "modelcanary.unknown/v9"}', b'{"schema": "modelcanary.outcome/v1"}'):
            producer.send(f"{p}.outcomes", key=b"x", value=value)
        producer.flush()
        producer.close()
        bus.publish("outcomes", outcome(tag, 1))
        before = dropped("bad_record")
        sub = bus.subscribe(["outcomes"], group="bad-group")
        got = await collect(sub, 1, 20)
        got += await sub.get_batch(100, 0.5)
        assert ids(got) == [f"{tag}-1"]
        assert dropped("bad_record") - before == 3
        await sub.close()
    finally:
        await bus.close()


async def test_undecodable_records_at_the_end_are_committed_past_and_counted_once(kafka_broker, tmp_path):
    from kafka import KafkaProducer

    p, tag, group = prefix(), "tail-bad", "tail-bad-group"
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        for i in range(5):
            bus.publish("outcomes", outcome(tag, i))
        assert await bus.flush(10)
        producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
        for _ in range(3):
            producer.send(f"{p}.outcomes", key=f"{tag}-0".encode(), value=b"not json")  # behind a good one
        producer.flush()
        producer.close()
        before = dropped("bad_record")
        first = bus.subscribe(["outcomes"], group=group)
        assert sorted(ids(await collect(first, 5, 20))) == [f"{tag}-{i}" for i in range(5)]
        await wait_for(lambda: dropped("bad_record") - before == 3, 10, "the bad records counted")
        await first.get_batch(100, 0.5)  # takes what is left in turn (nothing to hand out)
        await first.commit()
        await first.close()
        second = bus.subscribe(["outcomes"], group=group)  # a restart: from the group's commits
        assert await second.get_batch(100, 5) == []
        assert dropped("bad_record") - before == 3  # read past once, counted once
        await second.close()
    finally:
        await bus.close()


async def test_a_key_that_is_not_utf8_stops_no_reader_of_the_topic(kafka_broker, tmp_path):
    from kafka import KafkaProducer

    p = prefix()
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        bus.publish("rollouts", rollout("support-bot", 1))
        assert await bus.flush(10)
        producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)  # any client may write to a topic
        producer.send(f"{p}.rollouts", key=b"\xff\xfe", value=b'{"hello": 1}').get(10)
        producer.close()
        assert [v.get("route", v) for v in read_topic(kafka_broker.bootstrap, f"{p}.rollouts")] == [
            "support-bot", {"hello": 1}]  # what `capture` and leadership read with
        follower = bus.follow(["rollouts"], ["support-bot"])  # every proxy's rollouts follower
        got = await collect(follower, 1, 15)
        assert [(r.route, r.version) for r in got] == [("support-bot", 1)]
        await wait_for(follower.caught_up.is_set, 10, "the follower caught up")
        await follower.close()
    finally:
        await bus.close()


async def test_a_follower_skips_undecodable_latest_records_for_the_latest_valid_state(kafka_broker, tmp_path):
    """A tombstone, garbage or another record type as a route's newest record on the rollouts topic is
    skipped and counted; a new replica follows the route's latest valid state before it, also when
    that one is further back than one chunk of reading back."""
    from kafka import KafkaProducer

    from service.bus.kafka.consumer import LATEST_CHUNK
    from service.records import dump

    p = prefix()
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        for v in (1, 2):
            bus.publish("rollouts", rollout("support-bot", v))
        bus.publish("rollouts", rollout("search-bot", 7))
        for v in range(LATEST_CHUNK + 50):  # another route's history: the bad records are a chunk later
            bus.publish("rollouts", rollout("busy-bot", v))
        assert await bus.flush(10)
        producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)  # any client may write to a topic
        for value in (json.dumps(dump(outcome("wrong-type", 0))).encode(), b"garbage", None):  # None: a tombstone
            producer.send(f"{p}.rollouts", key=b"support-bot", value=value)
        producer.flush()
        producer.close()
        before = dropped("bad_record", topic="rollouts")
        follower = bus.follow(["rollouts"], ["support-bot", "search-bot"])  # a new replica
        got = await collect(follower, 2, 15)
        got += await follower.get_batch(100, 0.5)
        assert [(r.route, r.version) for r in got] == [("support-bot", 2), ("search-bot", 7)]
        assert dropped("bad_record", topic="rollouts") - before == 3
        await wait_for(follower.caught_up.is_set, 10, "the follower caught up")
        bus.publish("rollouts", rollout("support-bot", 3))
        assert [(r.route, r.version) for r in await collect(follower, 1, 10)] == [("support-bot", 3)]
        await follower.close()
    finally:
        await bus.close()


async def test_a_record_too_large_for_kafka_is_dropped_and_counted(kafka_broker, tmp_path):
    p, tag = prefix(), "big"
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        huge = TrafficEvent(request_id=f"{tag}-0", ts=time.time(), route="support-bot", segment="chat",
                            request={"messages": [{"role": "user", "content": "x" * 2_000_000}]},
                            primary=PrimaryResult(model="stable-m", status=200, latency_s=0.1, outcome="completed"),
                            config_version="x")
        before_drop, before_pub = dropped("too_large", "traffic"), published()
        bus.publish("traffic", huge)
        bus.publish("outcomes", outcome(tag, 1))
        await wait_for(lambda: published() - before_pub == 1, 10, "the next record delivered")
        assert dropped("too_large", "traffic") - before_drop == 1
        assert bus.connected and bus.spooled == 0  # one bad record does not take the producer down
    finally:
        await bus.close()


# ---- outage, spool and replay -------------------------------------------------------------------------


async def test_broker_outage_spools_and_replays_into_a_replaced_broker(fresh_kafka_broker, tmp_path):
    broker = fresh_kafka_broker
    p, tag = prefix(), "outage"
    bus = make_bus(broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    try:
        base = published()
        for i in range(50):
            bus.publish("outcomes", outcome(tag, i))
        await wait_for(lambda: published() - base == 50, 10, "first records delivered")

        broker.stop()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        slowest = 0.0
        for i in range(50, 250):
            t0 = time.perf_counter()
            bus.publish("outcomes", outcome(tag, i))  # returns at once: a queue put, never I/O
            slowest = max(slowest, time.perf_counter() - t0)
            if i % 20 == 0:
                await asyncio.sleep(0.01)
        await wait_for(lambda: bus.spooled == 200, 15, "records spooled while the broker is down")
        assert spooled_gauge() >= 200 and spooled_gauge() > 0
        assert ticks > 20  # the loop kept running the whole time
        tick_task.cancel()
        print(f"slowest publish() while the broker was down: {slowest * 1e6:.0f} µs")
        assert published() - base == 50

        broker.start()  # memory storage: an empty, replaced broker (no topics, no producer ids)
        await wait_for(lambda: published() - base == 250, 30, "spool replayed")
        assert bus.spooled == 0 and spooled_gauge() == 0
        for i in range(250, 260):  # after the replay, records go straight through again
            bus.publish("outcomes", outcome(tag, i))
        await wait_for(lambda: published() - base == 260, 10, "direct sends after recovery")

        messages = read_messages(broker.bootstrap, f"{p}.outcomes", timeout_s=10)
        got = Counter(m.value["request_id"] for m in messages)
        assert set(got) == {f"{tag}-{i}" for i in range(50, 260)}  # the first 50 died with the old broker
        # replay kept the order: within each partition, the numbers only grow
        for part in {m.partition for m in messages}:
            seq = [int(m.value["request_id"].rsplit("-", 1)[1]) for m in messages if m.partition == part]
            first_seen = list(dict.fromkeys(seq))
            assert first_seen == sorted(first_seen)
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        try:
            assert {f"{p}.{t}" for t in ("outcomes", "traffic", "evaluations", "rollouts")} <= set(admin.list_topics())
        finally:
            admin.close()
    finally:
        await bus.close()
    assert not list((tmp_path / "spool").glob("slot-*/seg-*.log"))  # replayed segments are deleted


async def test_group_consumer_and_follower_survive_a_replaced_broker(fresh_kafka_broker, tmp_path):
    broker = fresh_kafka_broker
    p, tag = prefix(), "survive"
    bus = make_bus(broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    group = bus.subscribe(["outcomes"], group="survive-group")
    follower = bus.subscribe(["rollouts"], group=None)
    try:
        for i in range(10):
            bus.publish("outcomes", outcome(tag, i))
        for v in range(1, 6):
            bus.publish("rollouts", rollout("support-bot", v))
        assert len(await collect(group, 10, 20)) == 10
        await group.commit()
        assert [r.version for r in await collect(follower, 5, 10)] == [1, 2, 3, 4, 5]

        broker.restart()  # comes back empty
        for i in range(10, 20):
            bus.publish("outcomes", outcome(tag, i))
        bus.publish("rollouts", rollout("support-bot", 6))
        got = await collect(group, 10, 40)
        assert set(ids(got)) >= {f"{tag}-{i}" for i in range(10, 20)}
        assert 6 in [r.version for r in await collect(follower, 1, 20)]
    finally:
        await group.close()
        await follower.close()
        await bus.close()


async def test_work_taken_before_the_broker_was_replaced_commits_nothing_on_the_new_topic(fresh_kafka_broker, tmp_path):
    broker = fresh_kafka_broker
    p, group = prefix(), "replaced-commit"
    bus = make_bus(broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    worker = bus.subscribe(["outcomes"], group=group)
    try:
        for i in range(60):
            bus.publish("outcomes", outcome("old", i))
        assert len(await collect(worker, 60, 20)) == 60  # taken, still being worked on: not committed
        old_ids = dict(worker.topic_ids)
        broker.restart()  # comes back empty: the topics are new, their offsets start at 0 again
        for i in range(80):
            bus.publish("outcomes", outcome("new", i))
        await wait_for(lambda: worker.topic_ids not in ({}, old_ids), 40, "the worker sees the new topic")
        await worker.commit()  # the old work is done
        again = await collect(worker, 80, 30)
        assert {f"new-{i}" for i in range(80)} <= set(ids(again))
        await worker.close()
        after = bus.subscribe(["outcomes"], group=group)  # a restart: from the group's commits
        got = await collect(after, 80, 30)
        assert {f"new-{i}" for i in range(80)} <= set(ids(got))  # the old offsets skipped none of them
        await after.close()
    finally:
        await bus.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.requires("procfs")
async def test_broker_outages_leak_no_file_descriptors(tmp_path):
    """A broker that accepts connections and closes them (the soak's "broker down"): every reconnect
    attempt builds Kafka clients whose constructors fail; each must close what it opened (epoll fd,
    wake-up socket pair, sockets, I/O thread). After the outages the process is back where it was."""
    from tests.faults.fault_proxy import FaultProxy, ProxiedBroker

    port = free_port()
    fault = FaultProxy("127.0.0.1", port).start()
    broker = ProxiedBroker(fault.port, port=port, log_path=tmp_path / "tansu.log")
    p, tag = prefix(), "fds"
    bus = make_bus(fault.address, tmp_path / "spool", p)
    group = follower = None
    received: list = []
    stop = asyncio.Event()

    async def drive():  # what the controller does: publish, consume in a group, follow rollouts
        i = 0
        while not stop.is_set():
            bus.publish("outcomes", outcome(tag, i))
            i += 1
            received.extend(await group.get_batch(100, 0.02))
            await group.commit()
            await follower.get_batch(100, 0.01)

    try:
        broker.start()
        await bus.start()
        group = bus.subscribe(["outcomes"], group="fds-group")
        follower = bus.subscribe(["rollouts"], group=None)
        driver = asyncio.create_task(drive())
        await wait_for(lambda: received, 30, "the group consuming")
        await asyncio.sleep(2.0)
        threads_before, fds_before = threading.active_count(), open_fds()
        for _ in range(3):
            fault.set_mode("drop")  # accepts and closes: the clients' constructors fail at bootstrap
            await asyncio.sleep(6.0)
            fault.set_mode("pass")
            await wait_for(lambda: bus.connected and bus.spooled == 0, 40, "the producer back, spool replayed")
            await wait_for(lambda n=len(received): len(received) > n + 20, 40, "the group consuming again")
        await asyncio.sleep(2.0)
        threads_after, fds_after = threading.active_count(), open_fds()
        print(f"fds {fds_before} -> {fds_after}, threads {threads_before} -> {threads_after}")
        assert fds_after - fds_before <= 4, (fds_before, fds_after)
        assert threads_after - threads_before <= 1, (threads_before, threads_after)
        stop.set()
        await driver
    finally:
        stop.set()
        for sub in (group, follower):
            if sub is not None:
                await sub.close()
        await bus.close()
        broker.stop()
        fault.stop()


async def test_spool_limit_drops_are_counted_exactly(tmp_path):
    port = free_port()
    broker = TansuBroker(port, log_path=tmp_path / "tansu.log")
    p, tag = prefix(), "limit"
    bus = make_bus(broker.bootstrap, tmp_path / "spool", p, max_bytes=20_000)  # room for ~50 outcomes
    await bus.start()  # nothing listens yet
    try:
        assert not bus.connected
        base_pub, base_drop = published(), dropped("spool_full")
        sent = 200
        for i in range(sent):
            bus.publish("outcomes", outcome(tag, i))
        await wait_for(lambda: bus.spooled + dropped("spool_full") - base_drop == sent, 10, "records handled")
        assert not await bus.flush(5)  # some were dropped: not all confirmed or spooled
        assert await bus.flush(5)  # nothing dropped since the previous flush
        kept = bus.spooled
        assert 0 < kept < sent
        assert spooled_gauge() == kept

        broker.start()
        await wait_for(lambda: bus.spooled == 0, 30, "spool replayed")
        assert published() - base_pub == kept
        assert published() - base_pub + dropped("spool_full") - base_drop == sent
        got = {m["request_id"] for m in read_topic(broker.bootstrap, f"{p}.outcomes", 10)}
        assert got == {f"{tag}-{i}" for i in range(kept)}  # the oldest were kept, the overflow dropped
    finally:
        await bus.close()
        broker.stop()


@pytest.mark.parametrize("ending", ["close", "crash"])
async def test_spool_survives_a_process_restart(tmp_path, ending):
    port = free_port()
    spool_dir = tmp_path / "spool"
    p, tag = prefix(), "restart"
    script = textwrap.dedent(f"""
        import asyncio, os, signal, time
        from pathlib import Path
        from tests.test_kafka_bus import make_bus, outcome, rollout

        async def main():
            bus = make_bus("127.0.0.1:{port}", Path({str(spool_dir)!r}), {p!r})  # nothing listens there
            await bus.start()
            for i in range(30):
                bus.publish("outcomes", outcome({tag!r}, i))
            bus.publish("rollouts", rollout("r", 1))
            if {ending!r} == "crash":
                assert await bus.flush(10)  # every record is in the spool, handed to the OS
                assert bus.spooled == 31
                os.kill(os.getpid(), signal.SIGKILL)
            await bus.close()

        asyncio.run(main())
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, timeout=60,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert done.returncode == (0 if ending == "close" else -9), done.stderr.decode()[-2000:]
    assert list(spool_dir.glob("slot-*/seg-*.log"))

    broker = TansuBroker(port, log_path=tmp_path / "tansu.log").start()
    bus = make_bus(broker.bootstrap, spool_dir, p)
    try:
        base_o, base_r = published("outcomes"), published("rollouts")
        await bus.start()
        await wait_for(lambda: bus.spooled == 0 and published("outcomes") - base_o == 30, 30, "replay after restart")
        assert published("rollouts") - base_r == 1
        got = [m["request_id"] for m in read_topic(broker.bootstrap, f"{p}.outcomes", 10)]
        assert sorted(set(got)) == sorted(f"{tag}-{i}" for i in range(30))
        assert [m["route"] for m in read_topic(broker.bootstrap, f"{p}.rollouts", 10)] == ["r"]
    finally:
        await bus.close()
        broker.stop()
    assert not list(spool_dir.glob("slot-*/seg-*.log"))  # replayed segments are deleted


async def test_close_leaves_unsent_records_in_the_spool(tmp_path):
    bus = make_bus(f"127.0.0.1:{free_port()}", tmp_path / "spool", prefix())
    await bus.start()
    for i in range(10):
        bus.publish("outcomes", outcome("close", i))
    await bus.close()
    before = dropped("closed")
    bus.publish("outcomes", outcome("close", 99))  # after close: counted, not raised
    assert dropped("closed") - before == 1
    spool = Spool(tmp_path / "spool", 1 << 20)
    spool.open()
    try:
        assert len(spool) == 10
        batch = spool.read(100)
        assert batch is not None and [e.key for e in batch.entries] == [f"close-{i}" for i in range(10)]
    finally:
        spool.close()


def test_spool_resumes_skips_torn_lines_and_adopts_orphaned_slots(tmp_path):
    a = Spool(tmp_path, 1 << 20)
    a.open()
    for i in range(5):
        assert a.append("outcomes", f"k{i}", b'{"i":%d}' % i)
    other = Spool(tmp_path, 1 << 20)  # a second process sharing the directory gets its own slot
    other.open()
    assert (a.slot.name, other.slot.name) == ("slot-0", "slot-1")
    other.append("rollouts", "r", b'{"v":1}')
    other.close()  # exits with a record left behind
    batch = a.read(2)
    assert [e.key for e in batch.entries] == ["k0", "k1"]
    a.commit(batch, 2)  # delivered: a restart does not resend them
    a.close()
    segment = sorted((tmp_path / "slot-0").glob("seg-*.log"))[-1]
    with open(segment, "ab") as f:
        f.write(b'outcomes\t"k9"\t{"i"')  # torn by a crash mid-write

    before = dropped("bad_record")
    spool = Spool(tmp_path, 1 << 20)
    spool.open()  # takes slot-0 again and adopts the orphaned slot-1
    try:
        assert len(spool) == 4 and spooled_gauge("rollouts") == 1
        keys = []
        while (batch := spool.read(10)) is not None:
            keys += [e.key for e in batch.entries]
            spool.commit(batch, len(batch.entries))
        assert keys == ["k2", "k3", "k4", "r"]
        assert dropped("bad_record") - before == 1
        assert len(spool) == 0 and not list(tmp_path.glob("slot-*/seg-*"))
    finally:
        spool.close()


def test_the_spool_bound_is_the_bytes_on_disk_also_while_a_segment_is_half_replayed(tmp_path):
    spool = Spool(tmp_path, max_bytes=40_000, segment_bytes=10_000)
    spool.open()
    record = b'{"pad":"' + b"x" * 80 + b'"}'
    try:
        n = 0
        while spool.append("outcomes", f"k{n}", record):
            n += 1
        batch = spool.read(60)
        spool.commit(batch, 60)  # part of the oldest segment replayed: its file stays until all of it is
        while spool.append("outcomes", f"m{n}", record):
            n += 1
        assert sum(p.stat().st_size for p in spool.slot.glob("seg-*.log")) <= 40_000
    finally:
        spool.close()


# ---- config ------------------------------------------------------------------------------------------


CONFIG_BASE = {"providers": {"p": {"base_url": "http://127.0.0.1:1/v1"}}, "models": {"m": {"provider": "p", "name": "x"}},
               "routes": {"r": {"stable": "m"}}}


def test_a_compression_codec_without_its_library_is_a_config_problem(monkeypatch):
    from kafka import codec

    monkeypatch.setattr(codec, "has_snappy", lambda: False)
    config = parse_config({**CONFIG_BASE, "events": {"backend": "kafka", "kafka": {"compression_type": "snappy"}}})
    problem = "events.kafka.compression_type: 'snappy' needs the Python package 'python-snappy', which is not installed"
    assert [p[:len(problem)] for p in environment_problems(config, proxy=True)] == [problem]  # check-config, serve, collect
    with pytest.raises(ValueError, match="compression_type: 'snappy' needs the Python package"):
        check_compression(config.events.kafka)  # a bus built from code
    gzip = parse_config({**CONFIG_BASE, "events": {"backend": "kafka", "kafka": {"compression_type": "gzip"}}})
    assert environment_problems(gzip, proxy=True) == []
    check_compression(gzip.events.kafka)


def test_a_topic_prefix_kafka_would_refuse_is_a_config_error():
    for prefix in ("my team", "a/b", "é", "x" * 240):
        with pytest.raises(ConfigError, match="events.kafka.topic_prefix"):
            parse_config({**CONFIG_BASE, "events": {"backend": "kafka", "kafka": {"topic_prefix": prefix}}})
    parse_config({**CONFIG_BASE, "events": {"backend": "kafka", "kafka": {"topic_prefix": "team-a.prod_1"}}})


def test_security_settings_map_to_kafka_python(monkeypatch):
    monkeypatch.setenv("MC_TEST_KAFKA_USER", "svc")
    monkeypatch.setenv("MC_TEST_KAFKA_PASSWORD", "s3cret-value")
    monkeypatch.setenv("MC_TEST_KAFKA_CHECK", "false")
    assert client_security(KafkaSecurity(
        security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
        sasl_plain_username_env="MC_TEST_KAFKA_USER", sasl_plain_password_env="MC_TEST_KAFKA_PASSWORD",
        ssl_cafile="/etc/ca.crt", ssl_check_hostname_env="MC_TEST_KAFKA_CHECK",
    )) == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "svc",
        "sasl_plain_password": "s3cret-value", "ssl_cafile": "/etc/ca.crt", "ssl_check_hostname": False,
    }
    assert client_security(KafkaSecurity(ssl_password="s3cret-value")) == {"ssl_password": "s3cret-value"}
    assert client_security(None) == {}
    with pytest.raises(ValueError, match="sasl_plain_password_env: environment variable 'MC_TEST_MISSING'"):
        client_security(KafkaSecurity(sasl_plain_password_env="MC_TEST_MISSING"))
    monkeypatch.setenv("MC_TEST_KAFKA_PROTOCOL", "s3cret-value")
    with pytest.raises(ValueError, match="security_protocol_env: the value of 'MC_TEST_KAFKA_PROTOCOL'") as err:
        client_security(KafkaSecurity(security_protocol_env="MC_TEST_KAFKA_PROTOCOL"))
    assert "s3cret-value" not in str(err.value)
    # Passwords are secrets in the parsed config too: its repr and dumps never show them.
    security = KafkaSecurity(sasl_plain_password="s3cret-value")
    assert "s3cret-value" not in repr(security) and "s3cret-value" not in security.model_dump_json()


CLOSING_CHILD = """
import asyncio, sys
from service.bus.kafka import KafkaBus
from service.config import KafkaConfig, SpoolConfig
from tests.test_kafka_bus import outcome

bootstrap, prefix, spool_dir = sys.argv[1:4]

async def main():
    bus = KafkaBus(KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=3),
                   SpoolConfig(dir=spool_dir), probe_interval_s=(0.2, 0.5))  # production timeouts
    await bus.start()
    n = 0
    for _ in range(6000):
        bus.publish("outcomes", outcome("c", n)); n += 1
    await bus.flush(30)
    print("SPOOLED", bus.spooled, flush=True)
    sys.stdin.readline()  # the broker is back
    while bus.spooled >= 6000:
        await asyncio.sleep(0.005)
    print("REPLAYING", flush=True)
    sys.stdin.readline()  # the broker went silent
    for _ in range(100):
        bus.publish("outcomes", outcome("c", n)); n += 1
        await asyncio.sleep(0.01)
    await bus.close()
    print("PUBLISHED", n, flush=True)

asyncio.run(main())
"""


def test_closing_while_the_spool_replays_into_a_silent_broker_loses_nothing(tmp_path):
    """The process exits right after close(): whatever was published is on the broker or in the spool."""
    from tests.faults.fault_proxy import FaultProxy, ProxiedBroker

    port = free_port()
    fault = FaultProxy("127.0.0.1", port).start()
    broker = ProxiedBroker(fault.port, port=port, log_path=tmp_path / "tansu.log").start()
    fault.set_mode("drop")
    p, spool_dir = prefix(), tmp_path / "spool"
    child = subprocess.Popen([sys.executable, "-c", CLOSING_CHILD, fault.address, p, str(spool_dir)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        def said(word: str) -> str:
            for line in child.stdout:
                if line.startswith(word):
                    return line
            raise AssertionError(f"the child ended before saying {word}: exit {child.wait()}")

        assert int(said("SPOOLED").split()[1]) == 6000
        fault.set_mode("pass")
        child.stdin.write("\n")
        child.stdin.flush()
        said("REPLAYING")
        fault.set_mode("blackhole")
        child.stdin.write("\n")
        child.stdin.flush()
        published = int(said("PUBLISHED").split()[1])
        assert child.wait(30) == 0
        fault.set_mode("pass")
        delivered = {m["request_id"] for m in read_topic(fault.address, f"{p}.outcomes", 20)}
        spool = Spool(spool_dir, 1 << 30)
        spool.open()
        spooled: set[str] = set()
        while (batch := spool.read(100_000)) is not None:
            spooled |= {json.loads(e.value)["request_id"] for e in batch.entries}
            spool.commit(batch, len(batch.entries))
        spool.close()
        assert {f"c-{i}" for i in range(published)} - delivered - spooled == set()
    finally:
        if child.poll() is None:
            child.kill()
        broker.stop()
        fault.stop()
