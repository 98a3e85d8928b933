"""The places that reach into kafka-python's private attributes, kept apart and checked.

Checked against kafka-python 2.2 and 3.0.12 (pinned `<3.1` in pyproject); tests/test_internals.py
fails if these attributes change shape.
"""

from __future__ import annotations

import logging
import time

from kafka import KafkaConsumer, KafkaProducer

log = logging.getLogger("modelcanary.bus.kafka")


def force_close(producer: KafkaProducer) -> None:
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
        log.debug("producer close: %s: %s", type(e).__name__, e)


def forbid_auto_create(network_client: object) -> None:
    """Make a client's `allow_auto_create_topics=False` reach its metadata requests.

    kafka-python 3.0 builds the cluster metadata (which writes those requests) without that setting,
    so every request naming a topic asks the broker to create it: a broker that came back empty
    then makes each topic a client reads or writes with its own defaults (Tansu: 4 partitions, not
    compacted) before the service can create it as `admin.topic_settings` says."""
    config = getattr(getattr(network_client, "cluster", None), "config", None)
    if isinstance(config, dict) and "allow_auto_create_topics" in config:
        config["allow_auto_create_topics"] = False


def topic_id(consumer: KafkaConsumer, name: str) -> object | None:
    """The topic's id as the client's cluster metadata knows it (None before kafka-python 2.1):
    an empty broker that recreated a topic gives it a new id, which is how a consumer notices."""
    cluster = getattr(getattr(consumer, "_client", None), "cluster", None)
    getter = getattr(cluster, "topic_id", None)
    try:
        return getter(name) if getter else None
    except Exception:
        return None


def known_partitions(consumer: KafkaConsumer, name: str) -> set[int] | None:
    """The topic's partitions as the client's cluster metadata knows them, without asking the broker
    (`KafkaConsumer.partitions_for_topic` asks, and raises for a topic the broker does not have);
    None when the last metadata the client got does not have the topic."""
    cluster = getattr(getattr(consumer, "_client", None), "cluster", None)
    parts: set[int] | None = cluster.partitions_for_topic(name) if cluster is not None else None
    return parts


def finish_stalled_join(consumer: KafkaConsumer) -> bool:
    """kafka-python 3.0 loses a group join when a poll times out between the leader computing the
    assignment and the SyncGroup answer: the new assignment already makes `need_rejoin()` False, so
    no later poll collects the answer and the member keeps no partitions of the new shape, for good.
    It happens when a subscribed topic changes shape (an empty broker came back and the topics were
    recreated). Asking for a rejoin lets the next poll join again. Returns whether it was stalled."""
    coordinator = getattr(consumer, "_coordinator", None)
    try:
        if coordinator.rejoining and not coordinator.need_rejoin():  # type: ignore[union-attr]
            coordinator.request_rejoin()  # type: ignore[union-attr]
            return True
    except AttributeError:
        pass
    return False


def finish_join(consumer: KafkaConsumer, timeout_ms: int) -> bool:
    """Wait up to `timeout_ms` for a group join under way; whether one was under way.

    kafka-python 3.0 keeps a join running when the poll waiting for it times out, but when it ends
    before the next poll waits again, that poll drops the answer and sends a new JoinGroup (one
    more rebalance: ~3 s on Tansu). A consumer thread busy for 0.7 s between 0.1 s polls never
    joins. The coordinator's own poll returns as soon as the join is done (`KafkaConsumer.poll`
    would go on waiting for records)."""
    coordinator = getattr(consumer, "_coordinator", None)
    try:
        if coordinator.rejoining is not True or not coordinator.need_rejoin():  # type: ignore[union-attr]
            return False  # no join, or one finish_stalled_join must start again
    except AttributeError:
        return False
    coordinator.poll(timeout_ms=timeout_ms)  # type: ignore[union-attr]
    return True


def session_age(consumer: KafkaConsumer) -> float | None:
    """Seconds since the group coordinator last answered a heartbeat of this member (inf: not yet):
    past the session timeout the broker may have given its partitions to another. Only an answer
    counts; kafka-python's own session clock also restarts when it merely finds the coordinator
    again. None when kafka-python does not show it."""
    heartbeat = getattr(getattr(consumer, "_coordinator", None), "heartbeat", None)
    last = getattr(heartbeat, "last_receive", None)
    return time.monotonic() - last if isinstance(last, float) else None


def group_settled(consumer: KafkaConsumer, since: float) -> bool:
    """The group coordinator answered a heartbeat of this member after `since` (monotonic) and no
    join is pending: leaving the group now cuts no rebalance short. True when kafka-python does not
    show it."""
    coordinator = getattr(consumer, "_coordinator", None)
    try:
        return coordinator.heartbeat.last_receive > since and not coordinator.need_rejoin()  # type: ignore[union-attr]
    except AttributeError:
        return True
