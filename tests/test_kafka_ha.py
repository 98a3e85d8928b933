"""Kafka mode without sticky assumptions, end to end on a real broker (Tansu): two `modelcanary serve`
replicas, two `collect` and two `control` processes.

- feedback sent round-robin to both proxies is counted by the judge exactly once each, whichever
  replica served the request; unknown ids are counted unmatched, other routes' keys refused;
- SIGKILL of the leading controller mid-rollout: the standby leads within 15 s and the rollout ends
  with the decision an undisturbed run reaches; no route and version is published twice;
- a rolling restart of both controllers keeps the phase and step;
- the rollouts topic grows by a bounded number of bytes while the judge decides every second.
"""

from __future__ import annotations

import copy
import json
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path

import openai
import pytest

from service.bus.kafka import read_messages
from tests.fixtures.servers import (
    SIM_MODEL,
    Process,
    blames_tool_calls,
    free_port,
    metric_value,
    scrape,
    sim_config,
    write_yaml,
)
from tests.test_rollout_kafka import ENV, TOKEN, Traffic, _config, _state, _wait

pytestmark = pytest.mark.timeout(420)
# Each test has a broker of its own: Tansu 0.6 can leave a consumer group rebalancing for good when a
# member leaves in the middle of a join (the collect workers' group at teardown), and the group ids
# are the same in every test.

ROUTE = "support-bot"
KEYS_ENV = "MC_HA_CLIENT_KEYS"
FAILOVER_S = 15.0


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, key: str | None = None, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key or token:
        headers["Authorization"] = f"Bearer {key or token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Controller:
    """A `modelcanary control` process with its health port."""

    def __init__(self, servers, tmp: Path, cfg: dict, name: str):
        self.port = free_port()
        cfg = copy.deepcopy(cfg)
        cfg["control"] = {**cfg.get("control", {}), "metrics_port": self.port}
        cfg["events"]["spool"] = {"dir": str(tmp / f"{name}-spool")}
        path = write_yaml(tmp / f"{name}.yaml", cfg)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Process = servers.process(["control", "--config", str(path)], name, env=ENV,
                                             ready_url=self.url + "/healthz")

    def ready(self) -> dict:
        try:
            return _get(self.url + "/readyz")
        except OSError:
            return {}

    def leading(self) -> bool:
        return self.ready().get("status") == "leading"

    def leader_gauge(self) -> float:
        return metric_value(scrape(self.url), "modelcanary_controller_leader")


def _one_leads(controllers: list[Controller]) -> bool:
    """One leads, the others stand by (members of the leadership group)."""
    states = sorted(c.ready().get("status", "down") for c in controllers)
    return states == ["leading"] + ["standby"] * (len(controllers) - 1)


def _controllers(servers, tmp: Path, cfg: dict, names=("control-a", "control-b")) -> list[Controller]:
    controllers = [Controller(servers, tmp, cfg, n) for n in names]
    assert _wait(lambda: _one_leads(controllers), 40), [c.ready() for c in controllers]
    return controllers


def _collectors(servers, tmp: Path, cfg: dict) -> None:
    for name in ("collect-a", "collect-b"):
        port = free_port()
        wcfg = {**copy.deepcopy(cfg), "collect": {"concurrency": 4, "metrics_port": port}}
        wcfg["events"]["spool"] = {"dir": str(tmp / f"{name}-spool")}
        servers.process(["collect", "--config", str(write_yaml(tmp / f"{name}.yaml", wcfg))], name,
                        ready_url=f"http://127.0.0.1:{port}/healthz")


def _states(bootstrap: str, prefix: str) -> list[dict]:
    return [m.value for m in read_messages(bootstrap, f"{prefix}.rollouts", timeout_s=10)
            if m.value.get("route") == ROUTE]


def _assert_no_version_published_twice(states: list[dict]) -> None:
    """Every (route, version) on the topic is one state: a leader may publish its own state again
    (the same record), never two controllers two states."""
    by_version: dict[int, set[str]] = defaultdict(set)
    for s in states:
        by_version[s["version"]].add(json.dumps(s, sort_keys=True))
    twice = {v: len(bodies) for v, bodies in by_version.items() if len(bodies) > 1}
    assert not twice, twice
    assert all(s.get("report") is None for s in states)  # the rollouts topic carries states only


def _report(url: str) -> dict:
    req = urllib.request.Request(url + f"/admin/rollouts/{ROUTE}/report", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())["report"] or {}


def _feedback_n(report: dict) -> int:
    arms = report.get("live", {}).get("segments", {}).get("overall", {})
    return sum(arm.get("task_success_rate", {}).get("n", 0) for arm in arms.values())


def test_feedback_to_any_replica_is_counted_once(fresh_kafka_broker, servers, tmp_path):
    sim = servers.simulator(sim_config())
    prefix = "ha" + uuid.uuid4().hex[:8]
    cfg = _config(sim.url, fresh_kafka_broker.bootstrap, prefix, {"steps": [50], "mode": "advisory"})
    cfg["routes"][ROUTE]["shadow"] = {"sample_rate": 0.2, "max_per_minute": 100_000}
    cfg["routes"]["other-bot"] = {"stable": "stable-m"}
    cfg["server"] = {"client_keys_env": KEYS_ENV}
    cfg["control"] = {"interval_s": 0.5, "report_interval_s": 1.0, "feedback_hold_s": 3.0}
    env = {**ENV, KEYS_ENV: "sk-client=support-bot;sk-other=other-bot"}
    proxies = [servers.proxy(cfg, name=f"proxy-{n}", env=env) for n in "ab"]
    _collectors(servers, tmp_path, cfg)
    controllers = _controllers(servers, tmp_path, cfg)
    leader = next(c for c in controllers if c.leading())
    assert leader.leader_gauge() == 1 and [c for c in controllers if c is not leader][0].leader_gauge() == 0
    # an operator opens the canary step (advisory mode: the judge only recommends), once both
    # replicas follow the leader's state
    assert _wait(lambda: all(_state(p.url)["epoch"] >= 1 for p in proxies), 30)
    status, _ = _post(proxies[0].url + f"/admin/rollouts/{ROUTE}/promote", {}, token=TOKEN)
    assert status == 200
    assert _wait(lambda: all(_state(p.url)["phase"] == "canary" for p in proxies), 10)

    served: list[tuple[str, str, int]] = []  # (request id, session id, the proxy that served it)
    for i in range(60):
        client = openai.OpenAI(base_url=proxies[i % 2].url + "/v1", api_key="sk-client", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=ROUTE, messages=[{"role": "user", "content": f"feedback question {i}"}],
            extra_headers={"x-session-id": f"ha-session-{i}"})
        served.append((raw.headers["x-request-id"], f"ha-session-{i}", i % 2))
    roles = {_state(p.url)["canary_weight"] for p in proxies}
    assert roles == {0.5}

    sent, elsewhere = 0, 0
    for j, (rid, session, by) in enumerate(served):
        to = (j // 2) % 2  # round-robin, out of step with the requests': half reach the other replica
        body = {"session_id": session} if j % 4 == 3 else {"request_id": rid}
        status, answer = _post(proxies[to].url + "/v1/feedback", {**body, "success": j % 3 != 0}, key="sk-client")
        assert status == 202, answer
        assert answer["accepted"] is True and answer["match"] == body
        # the serving replica resolves it at once; another one leaves it to the controller
        assert ("route" in answer) == (to == by), (to, by, answer)
        sent += 1
        elsewhere += to != by
    assert elsewhere == 30
    # another route's key: the serving replica refuses at once, any other accepts and the controller refuses
    rid, _, by = served[0]
    assert _post(proxies[by].url + "/v1/feedback", {"request_id": rid, "success": True}, key="sk-other")[0] == 403
    assert _post(proxies[1 - by].url + "/v1/feedback", {"request_id": rid, "success": True}, key="sk-other")[0] == 202
    # ids nobody served: accepted (a replica cannot know), then counted unmatched
    for k in range(3):
        assert _post(proxies[k % 2].url + "/v1/feedback", {"request_id": f"nobody-{k}", "success": True},
                     key="sk-client")[0] == 202

    report = _wait(lambda: (r := _report(proxies[1].url)) and _feedback_n(r) >= sent and
                   r["feedback"]["unmatched"] >= 3 and r, 60)
    assert report, _report(proxies[1].url).get("feedback")
    assert _feedback_n(report) == sent
    assert report["feedback"]["unmatched"] == 3 and report["feedback"]["refused"] == 1
    assert metric_value(scrape(leader.url), "modelcanary_feedback_unmatched_total", route=ROUTE) == 3
    time.sleep(3.0)  # further reports: nothing counted twice
    assert _feedback_n(_report(proxies[0].url)) == sent


def _bad_candidate_run(servers, tmp: Path, bootstrap: str, kill: bool) -> dict:
    """A rollout the judge must roll back (the candidate breaks tool calls), with or without a
    SIGKILL of the leading controller as soon as the canary step opens."""
    bad = copy.deepcopy(SIM_MODEL)
    bad["segments"] = {"tools": {"failures": {"invalid_tool_call": 0.6}}}
    name = "killed" if kill else "undisturbed"
    sim = servers.simulator(sim_config({"good-model": copy.deepcopy(SIM_MODEL), "new-model": bad}), name=f"sim-{name}")
    prefix = "ha" + uuid.uuid4().hex[:8]
    cfg = _config(sim.url, bootstrap, prefix, {"steps": [30, 60], "min_samples_per_step": 80})
    cfg["control"] = {"interval_s": 0.5}
    proxies = [servers.proxy(cfg, name=f"proxy-{name}-{n}", env=ENV) for n in "ab"]
    controllers = _controllers(servers, tmp, cfg, (f"control-{name}-a", f"control-{name}-b"))
    out: dict = {}
    with Traffic([p.url for p in proxies]) as traffic:
        assert _wait(lambda: _state(proxies[0].url)["phase"] != "shadow", 60), _state(proxies[0].url)
        if kill:
            leader = next(c for c in controllers if c.leading())
            standby = next(c for c in controllers if c is not leader)
            epoch = _state(proxies[0].url)["epoch"]
            leader.proc.signal(signal.SIGKILL)
            killed_at = time.monotonic()
            assert _wait(standby.leading, 30, 0.1)
            out["takeover_s"] = time.monotonic() - killed_at
            assert _wait(lambda: _state(proxies[1].url)["epoch"] > epoch, 30, 0.1)
            out["first_state_s"] = time.monotonic() - killed_at
        done = _wait(lambda: (s := _state(proxies[0].url))["phase"] in ("rolled_back", "promoted") and s, 150)
    assert not traffic.errors, traffic.errors[:3]
    assert done, _state(proxies[0].url)
    assert _wait(lambda: _state(proxies[1].url)["version"] == done["version"], 5)
    out["state"] = done
    out["states"] = _states(bootstrap, prefix)
    for c in controllers:
        c.proc.stop()
    return out


def test_sigkill_of_the_leader_mid_rollout_changes_no_decision(fresh_kafka_broker, servers, tmp_path):
    undisturbed = _bad_candidate_run(servers, tmp_path, fresh_kafka_broker.bootstrap, kill=False)
    killed = _bad_candidate_run(servers, tmp_path, fresh_kafka_broker.bootstrap, kill=True)
    for run in (undisturbed, killed):
        d = run["state"]["last_decision"]
        assert run["state"]["phase"] == "rolled_back" and d["decision"] == "rollback", d
        assert blames_tool_calls(d), d["reasons"]
        _assert_no_version_published_twice(run["states"])
    # the standby led within 15 s of the kill, and its first state (a higher epoch) followed
    assert killed["takeover_s"] <= FAILOVER_S, killed["takeover_s"]
    assert killed["first_state_s"] <= FAILOVER_S, killed["first_state_s"]
    epochs = [s["epoch"] for s in killed["states"]]
    assert epochs == sorted(epochs) and len(set(epochs)) == 2  # one leader, then the other: never back
    print(f"failover: leading after {killed['takeover_s']:.1f} s, first state after {killed['first_state_s']:.1f} s")


def test_a_rolling_restart_of_both_controllers_keeps_phase_and_step(fresh_kafka_broker, servers, tmp_path):
    sim = servers.simulator(sim_config())
    prefix = "ha" + uuid.uuid4().hex[:8]
    cfg = _config(sim.url, fresh_kafka_broker.bootstrap, prefix, {"steps": [20, 40, 60], "min_samples_per_step": 60})
    cfg["control"] = {"interval_s": 0.5, "report_interval_s": 2.0}
    proxies = [servers.proxy(cfg, name=f"proxy-{n}", env=ENV) for n in "ab"]
    controllers = _controllers(servers, tmp_path, cfg)
    with Traffic([p.url for p in proxies]) as traffic:
        reached = _wait(lambda: (s := _state(proxies[0].url))["phase"] == "canary" and s["step_index"] >= 1, 120)
    assert not traffic.errors and reached, _state(proxies[0].url)
    time.sleep(2.0)  # no traffic now: the rollout stays at its step (too few samples for the next)
    before = _state(proxies[0].url)

    # one after the other, the standby first: SIGTERM, start again, wait until it stands by or leads
    for order, old in enumerate(sorted(controllers, key=lambda c: c.leading())):
        was_leading = old.leading()
        assert old.proc.stop() == 0
        if was_leading:
            other = next(c for c in controllers if c is not old)
            assert _wait(other.leading, FAILOVER_S, 0.1)
        controllers.remove(old)
        controllers.append(Controller(servers, tmp_path, cfg, f"control-restarted-{order}"))
        assert _wait(lambda: _one_leads(controllers), 30), [c.ready() for c in controllers]
        now = _state(proxies[1].url)
        assert (now["phase"], now["step_index"]) == (before["phase"], before["step_index"]), now
    after = _wait(lambda: (s := _state(proxies[0].url))["epoch"] > before["epoch"] and s, 30)
    assert after and (after["phase"], after["step_index"]) == (before["phase"], before["step_index"])
    assert after["canary_weight"] == before["canary_weight"]
    _assert_no_version_published_twice(_states(fresh_kafka_broker.bootstrap, prefix))


def _topic_bytes(bootstrap: str, topic: str) -> int:
    return sum(len(json.dumps(m.value, separators=(",", ":"))) for m in read_messages(bootstrap, topic, timeout_s=10))


ROLLOUTS_BYTES_PER_10_MIN = 150_000  # stated bound: a steady rollout judged every second


def test_the_rollouts_topic_grows_slowly_while_the_judge_decides_every_second(fresh_kafka_broker, servers, tmp_path):
    sim = servers.simulator(sim_config())
    prefix = "ha" + uuid.uuid4().hex[:8]
    # a rollout that holds at its first step (too few samples to go on), judged every second
    cfg = _config(sim.url, fresh_kafka_broker.bootstrap, prefix, {"steps": [50], "min_samples_per_step": 1_000_000,
                                                          "min_shadow_samples": 0})
    cfg["control"] = {"interval_s": 1.0, "report_interval_s": 10.0}
    proxies = [servers.proxy(cfg, name=f"proxy-{n}", env=ENV) for n in "ab"]
    controllers = _controllers(servers, tmp_path, cfg)
    rollouts, reports = f"{prefix}.rollouts", f"{prefix}.reports"
    with Traffic([p.url for p in proxies], threads_per_proxy=1) as traffic:
        assert _wait(lambda: _state(proxies[0].url)["phase"] == "canary", 60)
        time.sleep(5)
        start = (_topic_bytes(fresh_kafka_broker.bootstrap, rollouts), _topic_bytes(fresh_kafka_broker.bootstrap, reports))
        t0 = time.monotonic()
        time.sleep(32)
        end = (_topic_bytes(fresh_kafka_broker.bootstrap, rollouts), _topic_bytes(fresh_kafka_broker.bootstrap, reports))
        elapsed = time.monotonic() - t0
    assert not traffic.errors, traffic.errors[:3]
    leader = next(c for c in controllers if c.leading())
    assert leader.ready()["last_tick"] > time.time() - 3  # it was judging all along
    per_10_min = [(e - s) * 600 / elapsed for s, e in zip(start, end, strict=True)]
    print(f"rollouts topic: {per_10_min[0] * 6 / 1024:.0f} KiB/hour, reports topic: {per_10_min[1] * 6 / 1024:.0f} "
          f"KiB/hour (steady rollout, judged every second)")
    assert per_10_min[0] < ROLLOUTS_BYTES_PER_10_MIN, per_10_min
    assert end[1] > start[1]  # the report is still published (on its own topic, at most every 10 s here)


def test_an_operator_action_is_notified_once_with_a_leader_and_also_while_none_leads(fresh_kafka_broker, servers,
                                                                                        tmp_path):
    """The proxy that takes an operator's action sends its webhook; the leader sends only its own
    decisions'. So an action during a failover (no leader) is notified too, and none twice."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hooks: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            hooks.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        sim = servers.simulator(sim_config())
        cfg = _config(sim.url, fresh_kafka_broker.bootstrap, "mc" + uuid.uuid4().hex[:8],
                      {"steps": [20, 40], "min_shadow_samples": 100000, "min_samples_per_step": 100000})
        cfg["notify"] = {"webhook_url": f"http://127.0.0.1:{receiver.server_address[1]}/hook/secret"}
        proxy = servers.proxy(cfg, name="proxy-a", env=ENV)
        leader = Controller(servers, tmp_path, cfg, "control-a")
        assert _wait(leader.leading, 40)
        assert _wait(lambda: _state(proxy.url)["epoch"] >= 1, 20)  # the proxy follows the leader's states

        def leader_sees(phase: str) -> bool:
            return metric_value(scrape(leader.url), "modelcanary_rollout_phase", route=ROUTE, phase=phase) == 1

        for action, phase in (("promote", "canary"), ("pause", "paused")):
            assert _post(proxy.url + f"/admin/rollouts/{ROUTE}/{action}", {}, token=TOKEN)[0] == 200
            assert _wait(lambda phase=phase: leader_sees(phase), 20)  # adopted: its webhook, if any, is sent
        leader.proc.stop()  # no controller leads now
        assert _post(proxy.url + f"/admin/rollouts/{ROUTE}/resume", {}, token=TOKEN)[0] == 200
        assert _wait(lambda: len(hooks) >= 3, 10)
        assert [(h["from"], h["to"], h["by"]) for h in hooks] == [
            ("shadow", "canary", "operator"), ("canary", "paused", "operator"), ("paused", "canary", "operator")]
    finally:
        receiver.shutdown()
        receiver.server_close()
