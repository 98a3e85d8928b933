"""Kafka topics after the broker lost its data, and the leading controller's intake under a backlog,
on a real broker (Tansu).

- The service's clients never ask the broker to create a topic (kafka-python 3.0 lost that setting).
- A broker that comes back empty gets the topics as the service makes them (keyed topics: 1
  partition, compacted), by the service's own clients, whether or not anything is published; no
  client's request makes the broker create them with its defaults (Tansu: 4 partitions, not compacted).
- A keyed topic another client made with several partitions keeps one ordered history: every
  record goes to partition 0, and the service says so.
- The leader's intake takes a backlog of 20,000 evaluations in full batches, each one counted once,
  and never commits an offset past what the evidence holds.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import KafkaTimeoutError

from service.bus.base import KEYED_TOPICS, TOPICS
from service.bus.kafka import read_messages
from service.bus.kafka.admin import build_client
from service.bus.kafka.internals import known_partitions
from service.rollout.book import RolloutBook
from service.rollout.controller import GROUP, MAX_BATCH, Controller
from service.rollout.leader import open_intake, resume_evidence
from tests.judge_traffic import evaluation, make_config
from tests.test_kafka_bus import PARTITIONS, make_bus, outcome, prefix, rollout, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


def _shapes(bootstrap: str, p: str) -> dict[str, tuple[int, str | None]]:
    """Each of the prefix's topics: (partitions, cleanup.policy)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    try:
        names = [n for n in admin.list_topics() if n.startswith(p + ".")]
        if not names:
            return {}
        parts = {t["name"]: len(t["partitions"]) for t in admin.describe_topics(names)}
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names],
                                         config_filter="all")["topic"]
        return {n.removeprefix(p + "."): (parts[n], configs.get(n, {}).get("cleanup.policy", {}).get("value"))
                for n in names}
    finally:
        admin.close()


EXPECTED = {t: (1, "compact") if t in KEYED_TOPICS else (PARTITIONS, None) for t in TOPICS}


async def test_a_broker_that_comes_back_empty_gets_the_topics_as_the_service_makes_them(fresh_kafka_broker, tmp_path):
    broker = fresh_kafka_broker
    p = prefix()
    bus = make_bus(broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    # what a standby controller holds: the leader's intake group, a follower and the leadership group
    group = bus.subscribe(["outcomes", "evaluations"], group="intake")
    follower = bus.follow(["rollouts", "reports"], keys=["support-bot"])
    leadership = bus.leadership("leaders")
    try:
        bus.publish("rollouts", rollout("support-bot", 1))
        bus.publish("outcomes", outcome("before", 0))
        assert await bus.flush(10)
        await wait_for(lambda: leadership.joined and group.partitions and follower.caught_up.is_set(), 30,
                       "every subscription in place")
        assert _shapes(broker.bootstrap, p) == EXPECTED

        broker.restart()  # comes back empty; nothing is published: only the subscriptions see it
        read = {"outcomes", "evaluations", "rollouts", "reports", "control"}
        await wait_for(lambda: read <= _shapes(broker.bootstrap, p).keys(), 30, "the topics read back")
        assert _shapes(broker.bootstrap, p) == EXPECTED

        bus.publish("rollouts", rollout("support-bot", 2))
        bus.publish("outcomes", outcome("after", 0))
        assert await bus.flush(20)
        states = [m for m in read_messages(broker.bootstrap, f"{p}.rollouts") if m.key == "support-bot"]
        assert [(m.partition, m.value["version"]) for m in states] == [(0, 2)]
        assert _shapes(broker.bootstrap, p) == EXPECTED  # sending created nothing else either
    finally:
        await leadership.close()
        await follower.close()
        await group.close()
        await bus.close()


def test_the_services_clients_never_ask_the_broker_to_create_a_topic(kafka_broker):
    """kafka-python 3.0 drops `allow_auto_create_topics=False` on its way to the metadata requests
    (internals.forbid_auto_create puts it back); `known_partitions` reads the client's metadata only."""
    missing, existing = prefix() + ".missing", prefix() + ".existing"
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    admin.create_topics({existing: {"num_partitions": 1, "replication_factor": -1}})
    common = dict(bootstrap_servers=kafka_broker.bootstrap, allow_auto_create_topics=False)
    producer = build_client(KafkaProducer, max_block_ms=1000, **common)
    consumer = build_client(KafkaConsumer, request_timeout_ms=2000, **common)
    try:
        with pytest.raises(KafkaTimeoutError):
            producer.partitions_for(missing)
        with pytest.raises(KafkaTimeoutError):
            consumer.beginning_offsets([TopicPartition(missing, 0)])
        assert missing not in admin.list_topics()
        assert known_partitions(consumer, missing) is None
        consumer.beginning_offsets([TopicPartition(existing, 0)])
        assert known_partitions(consumer, existing) == {0}
    finally:
        consumer.close()
        producer.close()
        admin.close()


async def test_a_keyed_topic_made_with_several_partitions_keeps_one_ordered_history(kafka_broker, tmp_path, caplog):
    p = prefix()
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    try:  # another client made it first, as a broker's auto-creation would
        admin.create_topics({f"{p}.rollouts": {"num_partitions": 4, "replication_factor": -1}})
    finally:
        admin.close()
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    routes = [f"route-{i}" for i in range(12)]  # keys that hash to every one of the 4 partitions
    follower = bus.follow(["rollouts"], keys=routes)
    try:
        with caplog.at_level(logging.ERROR, logger="modelcanary.bus.kafka"):
            for version in (1, 2):
                for route in routes:
                    bus.publish("rollouts", rollout(route, version))
            assert await bus.flush(10)
            messages = read_messages(kafka_broker.bootstrap, f"{p}.rollouts")
            assert {m.partition for m in messages} == {0}
            assert [(m.key, m.value["version"]) for m in messages] == \
                [(r, 1) for r in routes] + [(r, 2) for r in routes]  # in the order they were published
            await wait_for(lambda: f"{p}.rollouts has 4 partitions, not 1" in caplog.text, 10, "the error logged")
    finally:
        await follower.close()
        await bus.close()


async def test_the_leaders_intake_takes_a_backlog_in_full_batches_and_a_new_leader_loses_none_of_it(
        kafka_broker, tmp_path):
    p, n = prefix(), 20_000
    bus = make_bus(kafka_broker.bootstrap, tmp_path / "spool", p)
    await bus.start()
    config = make_config(events={"backend": "kafka",
                                 "kafka": {"bootstrap_servers": kafka_broker.bootstrap, "topic_prefix": p}})
    book = RolloutBook(config)
    book.get("bot")
    for i in range(n):  # a `collect` worker catching up
        bus.publish("evaluations", evaluation("chat", True))
        if i % 5000 == 4999:
            assert await bus.flush(30)
    try:
        # the first leader stops halfway through the backlog
        first, batches = Controller(config, bus, book), []
        stop = asyncio.Event()
        run = asyncio.create_task(first.run(stop, _counting(open_intake(bus), batches)))
        await wait_for(lambda: _counted(first) >= n // 2, 120, "half the backlog counted")
        stop.set()
        await run
        committed = _committed(kafka_broker.bootstrap, p)
        assert 0 < committed <= _counted(first)  # no offset committed past what the evidence holds
        assert max(batches) == MAX_BATCH  # a backlog comes in full batches: no pause between them

        # the next leader reads back what the group consumed, then takes the rest from its commits
        second = Controller(config, bus, book)
        stop = asyncio.Event()
        assert await resume_evidence(second, bus, stop) == committed
        run = asyncio.create_task(second.run(stop, open_intake(bus)))
        await wait_for(lambda: _counted(second) >= n, 120, "the whole backlog counted")
        assert _counted(second) == n
        await wait_for(lambda: _committed(kafka_broker.bootstrap, p) >= n, 30, "everything committed")
        stop.set()
        await run
    finally:
        await bus.close()
    assert _committed(kafka_broker.bootstrap, p) == n


def _counting(sub, sizes: list[int]):
    """`sub`, noting the size of every batch it hands over."""
    take = sub.get_batch

    async def get_batch(max_records: int, timeout_s: float):
        batch = await take(max_records, timeout_s)
        sizes.append(len(batch))
        return batch

    sub.get_batch = get_batch
    return sub


def _counted(controller: Controller) -> int:
    ev = controller.evidence.get("bot")
    return 0 if ev is None else sum(w.shadow_records for w in ev.windows)


def _committed(bootstrap: str, p: str) -> int:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=GROUP, enable_auto_commit=False)
    try:
        return sum(consumer.committed(TopicPartition(f"{p}.evaluations", i)) or 0 for i in range(PARTITIONS))
    finally:
        consumer.close()
