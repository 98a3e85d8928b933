"""Kafka event bus backend (DESIGN §8), on kafka-python: see producer.py for how publishing works."""

from service.bus.kafka.admin import broker_reachable, check_compression, client_security, ensure_topics, topic_names
from service.bus.kafka.consumer import KafkaSubscription
from service.bus.kafka.leadership import KafkaLeadership
from service.bus.kafka.producer import KafkaBus
from service.bus.kafka.replay import Message, read_messages, read_topic

__all__ = ["KafkaBus", "KafkaLeadership", "KafkaSubscription", "Message", "broker_reachable", "check_compression",
           "client_security", "ensure_topics", "read_messages", "read_topic", "topic_names"]
