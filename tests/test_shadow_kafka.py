"""Shadow evaluation end to end on a real Kafka-protocol broker (Tansu):
`modelcanary serve` (events.backend: kafka) → traffic topic → `modelcanary collect` → evaluations topic.

Covers: one evaluation per sampled request after de-duplication; kill -9 of a worker mid-batch and
a restart lose nothing; a 20 s broker outage never fails a live call and the spooled events arrive;
credentials planted in client headers appear in no Kafka record."""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from service.bus.kafka import read_topic
from service.proxy.routing import unit_hash
from tests.fixtures.servers import SIM_MODEL, Process, free_port, metric_value, proxy_config, scrape, write_yaml

pytestmark = pytest.mark.timeout(240)

ROUTE = "support-bot"
SECRET = "sk-planted-" + uuid.uuid4().hex
OTHER_SECRET = "tok-" + uuid.uuid4().hex
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}}]


def sim_cfg(candidate_latency_s: float = 0.0) -> dict:
    """time_scale 0; or, with a candidate latency, a fast stable model and a slow candidate (a worker that lags)."""
    model = copy.deepcopy(SIM_MODEL)
    model["latency_s"] = {"median": 0.005, "p95": 0.01}
    candidate = copy.deepcopy(model)
    if candidate_latency_s:
        candidate["latency_s"] = {"median": candidate_latency_s, "p95": candidate_latency_s * 1.5}
    return {"seed": 5, "time_scale": 1.0 if candidate_latency_s else 0.0,
            "models": {"good-model": model, "new-model": candidate}}


def stack_config(sim_url: str, bootstrap: str, prefix: str, sample_rate: float) -> dict:
    cfg = proxy_config(sim_url, shadow={"sample_rate": sample_rate, "max_per_minute": 100_000, "noise_floor": True})
    cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix,
                                                   "partitions": 3, "linger_ms": 5}}
    return cfg


def start_collect(servers, tmp: Path, cfg: dict, name: str) -> Process:
    port = free_port()
    cfg = copy.deepcopy(cfg)
    cfg["collect"] = {"concurrency": 8, "metrics_port": port}
    cfg.setdefault("events", {})["spool"] = {"dir": str(tmp / f"{name}-spool")}
    path = write_yaml(tmp / f"{name}.yaml", cfg)
    proc = servers.process(["collect", "--config", str(path)], name, ready_url=f"http://127.0.0.1:{port}/healthz")
    proc.metrics_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


def request_body(i: int, tag: str) -> dict:
    body: dict = {"model": ROUTE, "messages": [{"role": "user", "content": f"{tag} question {i}"}]}
    if i % 3 == 1:
        body["response_format"] = {"type": "json_object"}
    elif i % 3 == 2:
        body["tools"] = TOOLS
    if i % 4 == 0:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def client_for(proxy) -> openai.OpenAI:
    # planted credentials: the SDK's Authorization header and another secret-looking header
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=SECRET, max_retries=0, timeout=20,
                         default_headers={"X-Api-Key": OTHER_SECRET, "x-session-id": "s-" + uuid.uuid4().hex[:6]})


def send(client: openai.OpenAI, i: int, tag: str) -> tuple[str, int]:
    """One live call through the proxy; (x-request-id, status)."""
    body = request_body(i, tag)
    body.pop("model")
    stream = body.pop("stream", False)
    if stream:
        with client.chat.completions.with_streaming_response.create(model=ROUTE, stream=True, **body) as raw:
            for _ in raw.iter_lines():
                pass
            return raw.headers["x-request-id"], raw.status_code
    raw = client.chat.completions.with_raw_response.create(model=ROUTE, **body)
    raw.parse()
    return raw.headers["x-request-id"], raw.status_code


def drive(client: openai.OpenAI, n: int, tag: str, workers: int = 8) -> list[tuple[str, int]]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda i: send(client, i, tag), range(n)))


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def topic(bootstrap: str, prefix: str, name: str) -> list[dict]:
    return read_topic(bootstrap, f"{prefix}.{name}", timeout_s=10)


def evaluated_ids(bootstrap: str, prefix: str) -> list[str]:
    return [r["request_id"] for r in topic(bootstrap, prefix, "evaluations")]


def assert_no_secrets(bootstrap: str, prefix: str) -> int:
    seen = 0
    for name in ("outcomes", "traffic", "evaluations", "rollouts"):
        for value in topic(bootstrap, prefix, name):
            text = json.dumps(value)
            seen += 1
            assert SECRET not in text and OTHER_SECRET not in text, f"credential leaked into {name}: {text[:300]}"
            assert "authorization" not in text.lower() or name == "rollouts", text[:300]
    return seen


def test_proxy_to_collect_end_to_end_one_record_each_and_no_credentials(kafka_broker, servers, tmp_path):
    bootstrap, prefix = kafka_broker.bootstrap, "e2e" + uuid.uuid4().hex[:8]
    sim = servers.simulator(sim_cfg())
    cfg = stack_config(sim.url, bootstrap, prefix, sample_rate=0.5)
    proxy = servers.proxy(cfg)
    collect = start_collect(servers, tmp_path, cfg, "collect")

    sent = drive(client_for(proxy), 120, "e2e")
    assert all(status == 200 for _, status in sent)
    ids = [rid for rid, _ in sent]
    sampled = {rid for rid in ids if unit_hash("shadow", rid) < 0.5}
    assert 30 < len(sampled) < 90

    traffic = wait_for(lambda: (t := topic(bootstrap, prefix, "traffic")) and len(t) >= len(sampled) and t, 30)
    assert {r["request_id"] for r in traffic} == sampled  # the sampler's choice, by request id
    evaluated = wait_for(lambda: (e := evaluated_ids(bootstrap, prefix)) and set(e) >= sampled and e, 60)
    assert set(evaluated) == sampled, f"missing {len(sampled - set(evaluated or []))}"
    records = {r["request_id"]: r for r in topic(bootstrap, prefix, "evaluations")}
    for rid in sampled:
        r = records[rid]
        assert r["schema"] == "modelcanary.evaluation/v1" and r["route"] == ROUTE
        assert r["candidate_model"] == "candidate-m" and r["stable_model"] == "stable-m"
        assert r["candidate"]["outcome"] == "completed"
        assert r["agreement"]["candidate_vs_stable"] is not None and r["agreement"]["stable_vs_stable"] is not None
        assert r["repro"]["config_version"] and r["repro"]["modelcanary_version"]
        assert {e["name"] for e in r["evaluations"]} >= {"verifiers", "agreement"}
    assert {r["segment"] for r in records.values()} == {"chat", "json", "tools"}
    # the traffic is keyed and carries the request body only
    assert all("messages" in r["request"] for r in traffic)
    assert assert_no_secrets(bootstrap, prefix) > len(ids)

    text = scrape(collect.metrics_url)  # type: ignore[attr-defined]
    assert metric_value(text, "modelcanary_shadow_requests_total", route=ROUTE, model="candidate-m") >= len(sampled)
    assert metric_value(text, "modelcanary_shadow_agreement_total", route=ROUTE, comparison="noise_floor") >= len(sampled)
    assert metric_value(text, "modelcanary_shadow_evaluations_total", route=ROUTE, evaluator="verifiers") >= len(sampled)
    from prometheus_client.parser import text_string_to_metric_families

    drops = {s.labels["reason"] for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "modelcanary_shadow_dropped_total" and s.labels["route"] == ROUTE}
    assert drops >= {"queue_full", "error", "stopped"}  # from 0, so that the drop alert's increase() sees the first
    assert collect.stop() == 0  # SIGTERM: flush and exit 0
    assert "shadow worker stopped" in collect.output()


def test_worker_killed_mid_batch_and_restarted_loses_nothing(kafka_broker, servers, tmp_path):
    bootstrap, prefix = kafka_broker.bootstrap, "kill" + uuid.uuid4().hex[:8]
    sim = servers.simulator(sim_cfg(candidate_latency_s=0.1))  # the worker lags: killed with work in flight
    cfg = stack_config(sim.url, bootstrap, prefix, sample_rate=1.0)
    proxy = servers.proxy(cfg)
    client = client_for(proxy)
    collect = start_collect(servers, tmp_path, cfg, "collect-1")

    sent: list[tuple[str, int]] = []
    feeder = threading.Thread(target=lambda: sent.extend(drive(client, 300, "kill", workers=16)))
    feeder.start()

    def done_so_far() -> float:  # the worker's own count (reading a topic while it is written is slow)
        return metric_value(scrape(collect.metrics_url), "modelcanary_shadow_requests_total",  # type: ignore[attr-defined]
                            model="candidate-m")

    first = wait_for(lambda: done_so_far() >= 40, 60, 0.1)
    assert first, "the worker never produced evaluations"
    collect.kill()  # SIGKILL, mid-batch
    before_restart = len(set(evaluated_ids(bootstrap, prefix)))
    feeder.join(60)
    assert len(sent) == 300 and all(status == 200 for _, status in sent)
    sampled = {rid for rid, _ in sent}
    assert before_restart < len(sampled)

    start_collect(servers, tmp_path, cfg, "collect-2")
    done = wait_for(lambda: set(evaluated_ids(bootstrap, prefix)) >= sampled, 90, 1.0)
    evaluated = evaluated_ids(bootstrap, prefix)
    missing = sampled - set(evaluated)
    assert done and not missing, f"{len(missing)} sampled requests never evaluated"
    # redelivery may repeat a record; de-duplicated by request_id there is exactly one per request
    assert set(evaluated) == sampled
    print(f"evaluated before kill: {before_restart}, records: {len(evaluated)}, distinct: {len(set(evaluated))}")


def test_broker_outage_live_calls_succeed_and_spooled_events_arrive(fresh_kafka_broker, servers, tmp_path):
    broker = fresh_kafka_broker
    bootstrap, prefix = broker.bootstrap, "out" + uuid.uuid4().hex[:8]
    sim = servers.simulator(sim_cfg())
    cfg = stack_config(sim.url, bootstrap, prefix, sample_rate=1.0)
    proxy = servers.proxy(cfg)
    client = client_for(proxy)
    start_collect(servers, tmp_path, cfg, "collect")

    warm = drive(client, 20, "warm", workers=4)
    assert all(s == 200 for _, s in warm)
    assert wait_for(lambda: set(evaluated_ids(bootstrap, prefix)) >= {rid for rid, _ in warm}, 60)

    results: list[tuple[str, int, float]] = []
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                rid, status = send(client, i, "outage")
            except Exception as e:  # a failed live call is a test failure, recorded as status 0
                rid, status = repr(e), 0
            results.append((rid, status, t0))
            i += 1
            time.sleep(max(0.0, 0.05 - (time.monotonic() - t0)))

    feeder = threading.Thread(target=traffic)
    feeder.start()
    time.sleep(1.0)
    broker.stop()
    down_at = time.monotonic()
    time.sleep(20.0)
    broker.start()  # memory storage: an empty broker comes back on the same port
    time.sleep(2.0)
    stop.set()
    feeder.join(30)

    assert len(results) > 200
    failed_calls = [r for r in results if r[1] != 200]
    assert not failed_calls, f"{len(failed_calls)} live calls failed during the outage: {failed_calls[:3]}"
    during = {rid for rid, _, t0 in results if t0 >= down_at}
    assert len(during) > 150

    # the proxy's spooled traffic arrives on the returned broker, and the worker evaluates it
    arrived = wait_for(lambda: {r["request_id"] for r in topic(bootstrap, prefix, "traffic")} >= during, 90, 1.0)
    assert arrived, "spooled traffic events did not arrive"
    evaluated = wait_for(lambda: set(evaluated_ids(bootstrap, prefix)) >= during, 90, 1.0)
    assert evaluated, f"{len(during - set(evaluated_ids(bootstrap, prefix)))} outage requests never evaluated"
    outcomes = {r["request_id"] for r in topic(bootstrap, prefix, "outcomes")}
    assert outcomes >= during
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_events_dropped_total", topic="traffic") == 0
