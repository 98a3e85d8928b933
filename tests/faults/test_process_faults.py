"""Kafka mode, processes killed with SIGKILL mid-run: a shadow worker (`modelcanary collect`) and the
controller (`modelcanary control`) die while traffic flows and are started again. No sampled request
goes unevaluated, and the rollout keeps its phase and step (Kafka carries all state, DESIGN §1)."""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from service.bus.kafka import read_topic
from tests.faults.test_broker_faults import Traffic
from tests.fixtures.servers import SIM_MODEL, free_port, proxy_config, write_yaml

pytestmark = pytest.mark.timeout(240)
ROUTE = "support-bot"
TOKEN = "process-faults-token"


def admin(url: str, method: str, path: str) -> dict:
    req = urllib.request.Request(url + path, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def latest_rollout(bootstrap: str, prefix: str) -> dict:
    states = [r for r in read_topic(bootstrap, f"{prefix}.rollouts", timeout_s=10) if r.get("route") == ROUTE]
    return max(states, key=lambda s: s.get("version", 0))


def sampled_ids(bootstrap: str, prefix: str) -> set[str]:
    return {r["request_id"] for r in read_topic(bootstrap, f"{prefix}.traffic", timeout_s=5)}


def test_worker_and_controller_killed_and_restarted(kafka_broker, servers, tmp_path):
    bootstrap, prefix = kafka_broker.bootstrap, "kill" + uuid.uuid4().hex[:8]
    model = copy.deepcopy(SIM_MODEL)
    model["latency_s"] = {"median": 0.15, "p95": 0.3}  # evaluations take a while: some are in flight at the kill
    sim = servers.simulator({"seed": 4, "time_scale": 1.0, "models": {"good-model": model, "new-model": model}})
    cfg = proxy_config(sim.url, shadow={"sample_rate": 1.0, "max_per_minute": 100_000, "noise_floor": True},
                       rollout={"steps": [10, 50], "mode": "advisory", "min_step_seconds": 0,
                                "min_shadow_samples": 10, "min_samples_per_step": 10})
    cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix,
                                                   "partitions": 3}}
    env = {"MODELCANARY_ADMIN_TOKEN": TOKEN}
    proxy = servers.proxy(cfg, env=env)

    workers_cfg = copy.deepcopy(cfg)
    collect_port, control_port = free_port(), free_port()
    workers_cfg["collect"] = {"concurrency": 4, "metrics_port": collect_port}
    workers_cfg["control"] = {"metrics_port": control_port, "interval_s": 0.5}
    workers_cfg["events"]["spool"] = {"dir": str(tmp_path / "workers-spool")}
    workers_cfg["state_dir"] = str(tmp_path / "workers-state")
    path = write_yaml(tmp_path / "workers.yaml", workers_cfg)
    collect = servers.process(["collect", "--config", str(path)], "collect", env,
                              f"http://127.0.0.1:{collect_port}/healthz")
    control = servers.process(["control", "--config", str(path)], "control", env,
                              f"http://127.0.0.1:{control_port}/healthz")

    # an operator moves the rollout to its second step; the judge only advises (it never moves it)
    admin(proxy.url, "POST", f"/admin/rollouts/{ROUTE}/promote")
    state = admin(proxy.url, "POST", f"/admin/rollouts/{ROUTE}/promote")
    assert (state["phase"], state["step_index"], state["canary_weight"]) == ("canary", 1, 0.5)
    deadline = time.monotonic() + 20
    while latest_rollout(bootstrap, prefix)["step_index"] != 1 and time.monotonic() < deadline:
        time.sleep(0.5)

    traffic = Traffic(proxy.url, rate_per_s=15).start()
    deadline = time.monotonic() + 30
    while not read_topic(bootstrap, f"{prefix}.evaluations", timeout_s=5) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)
    collect.kill()  # SIGKILL: no drain, no commit, no goodbye
    control.kill()
    version_at_kill = latest_rollout(bootstrap, prefix)["version"]
    time.sleep(2.0)
    restarts = [threading.Thread(target=p.start) for p in (collect, control)]
    for t in restarts:
        t.start()
    for t in restarts:
        t.join(60)
    # calls after the restart, until 30 are sampled (only the stable model's half is shadowed at step 1)
    traffic.wait_calls(len(traffic.results) + 15, timeout_s=90)
    deadline = time.monotonic() + 90
    while len(sampled_ids(bootstrap, prefix)) < 30 and time.monotonic() < deadline:
        time.sleep(1.0)
    results = traffic.stop()

    failed = [r for r in results if r[1] != 200]
    assert not failed, failed[:3]
    sampled = sampled_ids(bootstrap, prefix)
    assert len(sampled) >= 30
    deadline = time.monotonic() + 90
    evaluated: list[str] = []
    while time.monotonic() < deadline:
        evaluated = [r["request_id"] for r in read_topic(bootstrap, f"{prefix}.evaluations", timeout_s=10)]
        if set(evaluated) >= sampled:
            break
        time.sleep(1.0)
    missing = sampled - set(evaluated)
    assert not missing, f"{len(missing)} of {len(sampled)} sampled requests never evaluated"
    print(f"sampled {len(sampled)}, evaluation records {len(evaluated)}, distinct {len(set(evaluated))}, "
          f"re-evaluated after the kill {len(evaluated) - len(set(evaluated))}")

    # the restarted controller resumed the rollout where it was, and says so on the topic and the proxy
    assert "resuming route support-bot: phase canary, step 1" in control.output()
    deadline = time.monotonic() + 30
    latest = latest_rollout(bootstrap, prefix)
    while latest["version"] <= version_at_kill and time.monotonic() < deadline:
        time.sleep(0.5)
        latest = latest_rollout(bootstrap, prefix)
    assert latest["version"] > version_at_kill, "the restarted controller published nothing"
    assert (latest["phase"], latest["step_index"], latest["canary_weight"]) == ("canary", 1, 0.5), latest
    assert latest["recommendation"] is not None  # its own (advisory) judgement, on the kept step
    state = admin(proxy.url, "GET", f"/admin/rollouts/{ROUTE}")
    assert (state["phase"], state["step_index"], state["canary_weight"]) == ("canary", 1, 0.5), state
