"""Kafka mode end to end on a real broker (Tansu): two `modelcanary serve` replicas and one
`modelcanary control`. The controller's decision changes the split on both proxies; killing and
restarting the controller keeps the phase and step."""

from __future__ import annotations

import copy
import json
import signal
import threading
import time
import urllib.request
import uuid

import openai
import pytest

from tests.fixtures.servers import (
    SIM_MODEL,
    Process,
    blames_tool_calls,
    free_port,
    proxy_config,
    sim_config,
    write_yaml,
)

pytestmark = pytest.mark.timeout(300)

TOKEN = "kafka-admin-token"
ENV = {"MODELCANARY_ADMIN_TOKEN": TOKEN}
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}}]


def _config(sim_url: str, bootstrap: str, prefix: str, rollout: dict) -> dict:
    cfg = proxy_config(sim_url, shadow={"sample_rate": 0.0},
                       rollout={"min_shadow_samples": 0, "min_step_seconds": 1, "max_step_seconds": 600,
                                "alpha": 0.01, **rollout})
    cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix,
                                                   "partitions": 2, "linger_ms": 5}}
    return cfg


def _state(url: str) -> dict:
    req = urllib.request.Request(url + "/admin/rollouts/support-bot", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def _start_controller(servers, tmp, cfg: dict, name: str) -> Process:
    port = free_port()
    cfg = copy.deepcopy(cfg)
    cfg["control"] = {"metrics_port": port}
    cfg["events"]["spool"] = {"dir": str(tmp / f"{name}-spool")}
    path = write_yaml(tmp / f"{name}.yaml", cfg)
    return servers.process(["control", "--config", str(path)], name, env=ENV,
                           ready_url=f"http://127.0.0.1:{port}/healthz")


class Traffic:
    """Requests through every proxy from background threads until stopped."""

    def __init__(self, urls: list[str], threads_per_proxy: int = 2):
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(u, k), daemon=True)
                        for u in urls for k in range(threads_per_proxy)]

    def _run(self, url: str, k: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        i = 0
        while not self.stop_event.is_set():
            i += 1
            try:
                extra = {"tools": TOOLS} if i % 3 == 0 else {}
                client.chat.completions.create(model="support-bot", messages=[
                    {"role": "user", "content": f"q {k} {i} {uuid.uuid4().hex[:6]}"}], **extra)
            except openai.APIStatusError:
                pass
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.errors.append(e)
                return

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(15)


def _wait(pred, timeout_s: float, interval_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    value = pred()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = pred()
    return value


def test_controller_decision_changes_the_split_on_both_proxies(kafka_broker, servers, tmp_path):
    bad = copy.deepcopy(SIM_MODEL)
    bad["segments"] = {"tools": {"failures": {"invalid_tool_call": 0.6}}}
    sim = servers.simulator(sim_config({"good-model": copy.deepcopy(SIM_MODEL), "new-model": bad}))
    prefix = "mc" + uuid.uuid4().hex[:8]
    cfg = _config(sim.url, kafka_broker.bootstrap, prefix, {"steps": [30, 60], "min_samples_per_step": 80})
    a = servers.proxy(cfg, name="proxy-a", env=ENV)
    b = servers.proxy(cfg, name="proxy-b", env=ENV)
    _start_controller(servers, tmp_path, cfg, "control")
    with Traffic([a.url, b.url]) as traffic:
        rolled = _wait(lambda: _state(a.url)["phase"] == "rolled_back", 120)
    assert not traffic.errors, traffic.errors[:3]
    assert rolled, _state(a.url)
    # the other replica follows within 2 s
    assert _wait(lambda: _state(b.url)["phase"] == "rolled_back", 2.0)
    sa, sb = _state(a.url), _state(b.url)
    assert sa["version"] == sb["version"] and sb["canary_weight"] == 0.0
    assert sb["last_decision"]["by"] == "controller"
    assert blames_tool_calls(sb["last_decision"]), sb["last_decision"]["reasons"]


def test_restarted_controller_keeps_phase_and_step(kafka_broker, servers, tmp_path):
    sim = servers.simulator(sim_config())
    prefix = "mc" + uuid.uuid4().hex[:8]
    # the last step can't be promoted quickly (needs many samples), so the rollout sits at a step
    cfg = _config(sim.url, kafka_broker.bootstrap, prefix,
                  {"steps": [20, 40, 60], "min_samples_per_step": 60})
    a = servers.proxy(cfg, name="proxy-a", env=ENV)
    b = servers.proxy(cfg, name="proxy-b", env=ENV)
    control = _start_controller(servers, tmp_path, cfg, "control")
    with Traffic([a.url, b.url]) as traffic:
        reached = _wait(lambda: (s := _state(a.url))["phase"] == "canary" and s["step_index"] >= 1 and s, 120)
        assert reached, _state(a.url)
        control.signal(signal.SIGKILL)
        control.proc.wait(10)
        before = _state(a.url)
    assert not traffic.errors, traffic.errors[:3]
    killed_at = time.time()
    restarted = _start_controller(servers, tmp_path, cfg, "control-2")
    # the new controller resumes from the rollouts topic: same phase and step, and it judges again
    # (its hold recommendation carries a timestamp after the restart)
    resumed = _wait(lambda: (s := _state(b.url)).get("recommendation") and
                    s["recommendation"]["ts"] > killed_at and s, 30)
    assert resumed, _state(b.url)
    # it resumed where the killed one stopped (and, with its evidence rebuilt, may already step on)
    assert f"resuming route support-bot: phase {before['phase']}, step {before['step_index']} " in restarted.output()
    assert resumed["phase"] == before["phase"] and resumed["step_index"] >= before["step_index"]
    assert resumed["version"] > before["version"]
    assert restarted.proc.poll() is None
    # SIGTERM: a clean exit
    assert restarted.stop() == 0


def test_control_refuses_memory_mode(servers, tmp_path):
    cfg = proxy_config("http://127.0.0.1:9")
    path = write_yaml(tmp_path / "mem.yaml", cfg)
    from service.config import load_config
    from service.rollout.controller import main

    assert main(load_config(str(path))) == 1

