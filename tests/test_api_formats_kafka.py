"""Kafka mode on a real broker (Tansu): a Responses-API follow-up sent to another replica still reaches
the model that stored the response, and falls in its conversation's segment, learned from the
`response_id` and `conversation` of the outcomes the first replica published."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import openai
import pytest
import yaml

from service.bus.kafka import read_topic
from tests.fixtures.servers import proxy_config

pytestmark = pytest.mark.timeout(300)

TOKEN = "kafka-formats-token"
ENV = {"MODELCANARY_ADMIN_TOKEN": TOKEN}


def _admin(url: str, path: str, method: str = "GET") -> dict:
    req = urllib.request.Request(url + path, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def _kafka_config(sim_url: str, bootstrap: str) -> dict:
    """Route support-bot splitting stable-m and candidate-m 50/50 once promoted, on a topic prefix of its own."""
    cfg = proxy_config(sim_url, shadow={"sample_rate": 0.0}, rollout={"steps": [50], "mode": "advisory"})
    cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": "mc" + uuid.uuid4().hex[:8],
                                                   "partitions": 2, "linger_ms": 5}}
    return cfg


def _split_traffic(a, b) -> tuple[openai.OpenAI, list[tuple[str, str]]]:
    """Promote on replica `a` (50% canary), wait for `b` to follow, send 16 Responses requests to `a`:
    a client of `b`, and (response id, model that stored it) of each."""
    _admin(a.url, "/admin/rollouts/support-bot/promote", "POST")
    deadline = time.monotonic() + 20
    while _admin(b.url, "/admin/rollouts/support-bot")["phase"] != "canary" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _admin(b.url, "/admin/rollouts/support-bot")["canary_weight"] == 0.5
    on_a = openai.OpenAI(base_url=a.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
    on_b = openai.OpenAI(base_url=b.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
    served = []
    for i in range(16):
        raw = on_a.responses.with_raw_response.create(model="support-bot", input=f"question {i}")
        served.append((raw.parse().id, raw.headers["x-modelcanary-model"]))
    assert {m for _, m in served} == {"stable-m", "candidate-m"}
    return on_b, served


def test_a_follow_up_on_another_replica_reaches_the_model_that_stored_the_response(kafka_broker, servers):
    cfg = _kafka_config(servers.simulator().url, kafka_broker.bootstrap)
    a = servers.proxy(cfg, name="proxy-a", env=ENV)
    b = servers.proxy(cfg, name="proxy-b", env=ENV)
    on_b, served = _split_traffic(a, b)
    for response_id, model in served:
        # the simulator refuses a previous_response_id that another model stored
        raw = on_b.responses.with_raw_response.create(model="support-bot", previous_response_id=response_id,
                                                      input="go on")
        assert raw.headers["x-modelcanary-model"] == model
        assert raw.parse().previous_response_id == response_id
    outcomes = read_topic(kafka_broker.bootstrap, cfg["events"]["kafka"]["topic_prefix"] + ".outcomes", timeout_s=5)
    ids = {o.get("response_id") for o in outcomes}
    assert {rid for rid, _ in served} <= ids


def _reload(server, route: dict) -> None:
    """The replica's config file with `route` as support-bot, applied (POST /admin/reload)."""
    path = server.config_path
    cfg = yaml.safe_load(path.read_text())
    cfg["routes"]["support-bot"] = route
    path.write_text(yaml.safe_dump(cfg))
    _admin(server.url, "/admin/reload", "POST")


def test_follow_ups_reach_their_model_across_replicas_after_reloads_add_and_remove_the_candidate(kafka_broker,
                                                                                                 servers):
    cfg = _kafka_config(servers.simulator().url, kafka_broker.bootstrap)
    cfg["routes"]["support-bot"] = {"stable": "stable-m"}  # no rollout yet
    a = servers.proxy(cfg, name="proxy-a", env=ENV)
    b = servers.proxy(cfg, name="proxy-b", env=ENV)
    rollout = {"stable": "stable-m", "candidate": "candidate-m", "shadow": {"sample_rate": 0.0},
               "rollout": {"steps": [50], "mode": "advisory"}}
    for replica in (a, b):  # a rollout begins: from now on a follow-up may reach either replica
        _reload(replica, rollout)
    on_b, served = _split_traffic(a, b)
    for response_id, model in served[:4]:
        raw = on_b.responses.with_raw_response.create(model="support-bot", previous_response_id=response_id,
                                                      input="go on")
        assert raw.headers["x-modelcanary-model"] == model

    for replica in (a, b):  # the rollout is over: the candidate leaves the route
        _reload(replica, {"stable": "stable-m"})
    for response_id, model in served[4:]:  # what each model stored is still only its own
        raw = on_b.responses.with_raw_response.create(model="support-bot", previous_response_id=response_id,
                                                      input="and then?")
        assert raw.headers["x-modelcanary-model"] == model
        assert raw.parse().previous_response_id == response_id


def test_a_replica_is_ready_only_once_it_routes_on_the_rollout_states_of_the_topic(kafka_broker, servers):
    cfg = _kafka_config(servers.simulator().url, kafka_broker.bootstrap)
    a = servers.proxy(cfg, name="proxy-a", env=ENV)
    promoted = _admin(a.url, "/admin/rollouts/support-bot/promote", "POST")
    assert promoted["phase"] == "canary"
    for name in ("proxy-b", "proxy-c"):  # a scale-up; started as the chart's probe sees it: ready = /readyz
        replica = servers.proxy(cfg, name=name, env=ENV)
        state = _admin(replica.url, "/admin/rollouts/support-bot")
        assert (state["phase"], state["version"]) == ("canary", promoted["version"])


# a conversation's turns: short ones, then two long ones that are long_context only together
CHAIN = ["hello there", "tell me more", "and then?", "word " * 3500, "more words " * 1400]
CHAIN_SEGMENTS = ["chat", "chat", "multi_turn", "multi_turn", "long_context"]


def _converse(clients: list[openai.OpenAI]) -> list[str]:
    """CHAIN's turns as follow-ups (`previous_response_id`), turn i sent to clients[i % len]: the request
    ids, in turn order."""
    request_ids, previous = [], None
    for i, text in enumerate(CHAIN):
        raw = clients[i % len(clients)].responses.with_raw_response.create(
            model="support-bot", input=text, **({"previous_response_id": previous} if previous else {}))
        previous = raw.parse().id
        request_ids.append(raw.headers["x-request-id"])
    return request_ids


def test_a_conversation_alternating_between_replicas_is_segmented_as_on_one_replica(kafka_broker, servers):
    cfg = _kafka_config(servers.simulator().url, kafka_broker.bootstrap)
    a = servers.proxy(cfg, name="proxy-a", env=ENV)
    b = servers.proxy(cfg, name="proxy-b", env=ENV)
    on_a, on_b = (openai.OpenAI(base_url=p.url + "/v1", api_key="sk-client", max_retries=0, timeout=10) for p in (a, b))
    alone = _converse([on_a])
    alternating = _converse([on_a, on_b])  # behind a load balancer: every follow-up on the other replica
    topic = cfg["events"]["kafka"]["topic_prefix"] + ".outcomes"
    deadline = time.monotonic() + 20
    segments: dict[str, str] = {}
    while not set(alone + alternating) <= segments.keys() and time.monotonic() < deadline:
        segments = {o["request_id"]: o["segment"] for o in read_topic(kafka_broker.bootstrap, topic, timeout_s=5)}
    assert [segments.get(r) for r in alone] == CHAIN_SEGMENTS
    assert [segments.get(r) for r in alternating] == CHAIN_SEGMENTS
