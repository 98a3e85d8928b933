"""Kafka clients' settings, topics and reachability: what every producer and consumer shares."""

from __future__ import annotations

import logging
import socket
from typing import Any

from kafka import KafkaAdminClient
from kafka.errors import MessageSizeTooLargeError, RecordListTooLargeError

from service.bus.base import KEYED_TOPICS, TOPICS, Topic
from service.bus.kafka.internals import forbid_auto_create
from service.config import KafkaConfig, KafkaSecurity

log = logging.getLogger("modelcanary.bus.kafka")

_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)


def client_security(security: KafkaSecurity | None) -> dict[str, Any]:
    """kafka-python keyword arguments from `events.kafka.security` (KafkaSecurity.resolved)."""
    return {} if security is None else security.resolved()


def check_compression(kafka: KafkaConfig) -> None:
    """Fail at start, naming the field, when the codec's library is missing (kafka-python would only
    fail when the producer is built, and every record would wait in the spool). The CLI refuses such
    a config before (environment_problems); this guards the bus built from code."""
    if (problem := kafka.compression_problem()) is not None:
        raise ValueError(problem)


def key_text(key: bytes | None) -> str | None:
    """A record's key as text. Keys come from any client that can write to the topic: one that is not
    UTF-8 must not stop whoever reads the topic (it matches no key the service writes)."""
    return key.decode("utf-8", "replace") if key is not None else None


def topic_names(prefix: str) -> dict[Topic, str]:
    return {t: f"{prefix}.{t}" for t in TOPICS}


def topic_settings(topic: Topic, kafka: KafkaConfig) -> dict[str, Any]:
    """How the service creates a topic: the keyed topics (rollouts, reports, control) get one partition
    (one ordered history) and are compacted; the event topics get `partitions` and their retention."""
    if topic in KEYED_TOPICS:
        return {"num_partitions": 1, "replication_factor": -1, "configs": {"cleanup.policy": "compact"}}
    hours = getattr(kafka.retention_hours, topic)
    configs = {"retention.ms": str(int(hours * 3_600_000))} if hours is not None else {}
    return {"num_partitions": kafka.partitions, "replication_factor": -1, "configs": configs}


def ensure_topics(admin: KafkaAdminClient, names: dict[Topic, str], kafka: KafkaConfig) -> list[str]:
    """Create the missing topics (see topic_settings). Returns those created."""
    existing = set(admin.list_topics())
    missing = {name: topic_settings(t, kafka) for t, name in names.items() if name not in existing}
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


def create_missing_topics(client_id: str, client_config: dict[str, Any], names: dict[Topic, str],
                          kafka: KafkaConfig) -> list[str]:
    """`ensure_topics` through an admin client of its own, closed after."""
    admin = build_client(KafkaAdminClient, client_id=f"{client_id}-admin", **client_config)
    try:
        return ensure_topics(admin, names, kafka)
    finally:
        admin.close()


def build_client(cls: type, **config: Any) -> Any:
    """A kafka-python KafkaAdminClient, KafkaProducer or KafkaConsumer that leaks nothing when it fails.

    Their constructors make a network client (an epoll fd, a wake-up socket pair, an I/O thread) and
    then connect; when the connection fails (a broker that is down or answers nothing) they raise
    without closing it, and nothing can close it later. Every failed reconnect during an outage
    would leak those. Here the network client is captured as it is made and closed on failure, and
    given `allow_auto_create_topics=False` when asked for (see internals.forbid_auto_create)."""
    base = getattr(cls, "DEFAULT_CONFIG", {}).get("kafka_client")
    if base is None or "kafka_client" in config:
        return cls(**config)
    made: list = []

    def network_client(**kw: Any) -> Any:
        client = base(**kw)
        made.append(client)
        if kw.get("allow_auto_create_topics") is False:
            forbid_auto_create(client)
        return client

    try:
        return cls(kafka_client=network_client, **config)
    except BaseException:
        for client in made:
            try:
                client.close()
            except Exception as e:
                log.debug("closing a half-built kafka client: %s", describe(e))
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


def describe(e: BaseException | None) -> str:
    if e is None:
        return "no confirmation"
    text = str(e)
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__
