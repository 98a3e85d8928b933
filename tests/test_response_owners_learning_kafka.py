"""Kafka mode on a real broker (Tansu): every replica learns the other replicas' response owners and
conversation lengths whenever a route serves the Responses API, not only while a route has a
candidate: a conversation alternating between replicas on a one-model route is segmented as on one
replica, and one begun before a reload adds a candidate continues on its model on any replica."""

from __future__ import annotations

import json
import time

import openai
import pytest
from kafka import KafkaProducer

from service.bus.kafka import read_topic
from service.proxy.app import OWNERS_TAIL
from service.records import OutcomeEvent, dump
from tests.test_api_formats_kafka import CHAIN_SEGMENTS, ENV, _converse, _kafka_config, _reload

pytestmark = pytest.mark.timeout(300)


def _segments(bootstrap: str, topic: str, request_ids: list[str]) -> list[str | None]:
    """The segments the outcomes of `request_ids` were recorded in, once all are on the topic."""
    deadline = time.monotonic() + 20
    segments: dict[str, str] = {}
    while not set(request_ids) <= segments.keys() and time.monotonic() < deadline:
        segments = {o["request_id"]: o["segment"] for o in read_topic(bootstrap, topic, timeout_s=5)}
    return [segments.get(r) for r in request_ids]


def _busy_fleet(bootstrap: str, topic: str) -> None:
    """More outcomes of other requests on every partition of `topic` than a replica reads back at start
    or at a reload (OWNERS_TAIL): a busy fleet's chat traffic."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=256 * 1024)
    value = json.dumps(dump(OutcomeEvent(request_id="chat", ts=time.time(), route="other", model="stable-m",
                                         role="stable", segment="chat", outcome="completed"))).encode()
    for partition in range(2):
        for _ in range(OWNERS_TAIL + 1):
            producer.send(topic, value, partition=partition)
    producer.flush(timeout=60)
    producer.close()


def test_a_conversation_alternating_between_replicas_of_a_one_model_route_is_segmented_as_on_one(kafka_broker,
                                                                                                  servers):
    cfg = _kafka_config(servers.simulator().url, kafka_broker.bootstrap)
    cfg["routes"]["support-bot"] = {"stable": "stable-m"}  # no rollout: no route has a candidate
    a = servers.proxy(cfg, name="proxy-a", env=ENV)
    b = servers.proxy(cfg, name="proxy-b", env=ENV)
    on_a, on_b = (openai.OpenAI(base_url=p.url + "/v1", api_key="sk-client", max_retries=0, timeout=10) for p in (a, b))
    alternating = _converse([on_a, on_b])  # behind a load balancer: every follow-up on the other replica
    topic = cfg["events"]["kafka"]["topic_prefix"] + ".outcomes"
    assert _segments(kafka_broker.bootstrap, topic, alternating) == CHAIN_SEGMENTS


def test_a_conversation_begun_before_a_reload_adds_a_candidate_continues_on_its_model_on_any_replica(kafka_broker,
                                                                                                     servers):
    cfg = _kafka_config(servers.simulator().url, kafka_broker.bootstrap)
    cfg["routes"]["support-bot"] = {"stable": "stable-m"}
    a = servers.proxy(cfg, name="proxy-a", env=ENV)
    b = servers.proxy(cfg, name="proxy-b", env=ENV)
    on_a, on_b = (openai.OpenAI(base_url=p.url + "/v1", api_key="sk-client", max_retries=0, timeout=10) for p in (a, b))
    begun = [on_a.responses.create(model="support-bot", input=f"question {i}").id for i in range(4)]
    _busy_fleet(kafka_broker.bootstrap, cfg["events"]["kafka"]["topic_prefix"] + ".outcomes")
    rollout = {"stable": "stable-m", "candidate": "candidate-m", "shadow": {"sample_rate": 0.0},
               "rollout": {"steps": [50], "mode": "advisory"}}
    for replica in (b, a):  # a rollout begins
        _reload(replica, rollout)
    for response_id in begun:  # each reaches the model that stored it (the simulator refuses another)
        raw = on_b.responses.with_raw_response.create(model="support-bot", previous_response_id=response_id,
                                                      input="go on")
        assert raw.headers["x-modelcanary-model"] == "stable-m"
        assert raw.parse().previous_response_id == response_id


def test_an_unstored_answers_id_is_not_published_for_the_other_replicas(kafka_broker, servers):
    cfg = _kafka_config(servers.simulator().url, kafka_broker.bootstrap)
    a = servers.proxy(cfg, name="proxy-a", env=ENV)
    on_a = openai.OpenAI(base_url=a.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
    stored = on_a.responses.with_raw_response.create(model="support-bot", input="where is my order?")
    unstored = on_a.responses.with_raw_response.create(model="support-bot", input="where is my order?", store=False)
    request_ids = [r.headers["x-request-id"] for r in (stored, unstored)]
    topic = cfg["events"]["kafka"]["topic_prefix"] + ".outcomes"
    deadline = time.monotonic() + 20
    outcomes: dict[str, dict] = {}
    while not set(request_ids) <= outcomes.keys() and time.monotonic() < deadline:
        outcomes = {o["request_id"]: o for o in read_topic(kafka_broker.bootstrap, topic, timeout_s=5)}
    assert outcomes[request_ids[0]]["response_id"] == stored.parse().id
    assert (outcomes[request_ids[1]].get("response_id"), outcomes[request_ids[1]].get("conversation")) == (None, None)
