"""End to end in memory mode: `modelcanary serve` + `modelcanary simulate`, traffic through the
official openai SDK, the embedded controller deciding on its own."""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.error
import urllib.request

import openai

from service.admin import cli as admin_cli
from tests.fixtures.servers import SIM_MODEL, proxy_config, sim_config

TOKEN = "e2e-admin-token"
ENV = {"MODELCANARY_ADMIN_TOKEN": TOKEN}
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "description": "Find an order",
                                           "parameters": {"type": "object", "properties": {"id": {"type": "string"}},
                                                          "required": ["id"]}}}]

ROLLOUT = {"steps": [20, 50], "min_shadow_samples": 60, "min_samples_per_step": 80, "min_step_seconds": 0.5,
           "max_step_seconds": 600, "alpha": 0.01}


def _sim(candidate: dict) -> dict:
    stable = copy.deepcopy(SIM_MODEL)
    stable["divergence"] = 0.0
    return sim_config({"good-model": stable, "new-model": candidate}, time_scale=1.0)


def _proxy(sim_url: str, rollout: dict | None = None, shadow: dict | None = None) -> dict:
    cfg = proxy_config(sim_url, rollout={**ROLLOUT, **(rollout or {})},
                       shadow={"sample_rate": 0.5, "max_per_minute": 100000, "noise_floor": True, **(shadow or {})})
    return cfg


def _admin(url: str, path: str, method: str = "GET", token: str | None = TOKEN) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, method=method, data=b"" if method == "POST" else None)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _state(url: str) -> dict:
    return _admin(url, "/admin/rollouts/support-bot")[1]


def _drive(url: str, until, timeout_s: float = 90.0, threads: int = 4) -> dict:
    """Send chat and tool-call requests from a few threads until `until(state)` or the timeout."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                if i % 3 == 0:
                    client.chat.completions.create(model="support-bot", tools=TOOLS,
                                                   messages=[{"role": "user", "content": f"where is order {k}-{i}?"}])
                else:
                    client.chat.completions.create(model="support-bot",
                                                   messages=[{"role": "user", "content": f"hello {k}-{i}"}])
            except openai.APIStatusError:
                pass  # failures are part of the traffic
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
                return

    pool = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    deadline = time.monotonic() + timeout_s
    state = _state(url)
    try:
        while time.monotonic() < deadline and not until(state):
            time.sleep(0.25)
            state = _state(url)
    finally:
        stop.set()
        for t in pool:
            t.join(15)
    assert not errors, errors[:3]
    return state


def test_bad_candidate_is_rolled_back_with_the_right_reason(servers, capsys):
    bad = copy.deepcopy(SIM_MODEL)
    bad["divergence"] = 0.0
    bad["segments"] = {"tools": {"failures": {"invalid_tool_call": 0.5}}}
    sim = servers.simulator(_sim(bad))
    proxy = servers.proxy(_proxy(sim.url), env=ENV)
    state = _drive(proxy.url, lambda s: s["phase"] in ("rolled_back", "promoted"))
    assert state["phase"] == "rolled_back", state
    d = state["last_decision"]
    assert d["decision"] == "rollback" and d["by"] == "controller"
    assert any(r.startswith("segment tools:") for r in d["reasons"]), d["reasons"]
    assert any(e["segment"] == "tools" and e["verdict"] == "worse" for e in d["evidence"])
    # the operator surface shows it
    assert admin_cli.status(proxy.url, TOKEN, "support-bot") == 0
    assert admin_cli.report(proxy.url, TOKEN, "support-bot", False) == 0
    out = capsys.readouterr().out
    assert "rolled_back" in out and "tools" in out and "worse" in out
    status, body = _admin(proxy.url, "/admin/rollouts/support-bot/report")
    assert status == 200 and body["report"]["judge"]["comparisons"]
    assert "shadow" in body["report"] and "live" in body["report"]
    status, body = _admin(proxy.url, "/analysis/support-bot")
    assert status == 200 and body["healthy"] is False and body["phase"] == "rolled_back"


def test_good_candidate_reaches_promoted(servers):
    good = copy.deepcopy(SIM_MODEL)
    good["divergence"] = 0.0
    good["latency_s"] = {"median": 0.004, "p95": 0.01}  # faster than the stable
    sim = servers.simulator(_sim(good))
    # Wider margins than the defaults keep the test short: showing "within 1 point" takes
    # ~500 requests per segment and arm even when neither model ever fails.
    margins = {"completion_rate": 0.04, "model_failure_rate": 0.04, "latency_p95_exceedance": 0.1,
               "agreement_gap": 0.1}
    proxy = servers.proxy(_proxy(sim.url, rollout={"margins": margins}), env=ENV)
    seen: list[tuple[str, int]] = []

    def done(s: dict) -> bool:
        if not seen or seen[-1] != (s["phase"], s["step_index"]):
            seen.append((s["phase"], s["step_index"]))
        return s["phase"] in ("rolled_back", "promoted")

    state = _drive(proxy.url, done, timeout_s=120)
    assert state["phase"] == "promoted", (state["last_decision"], state.get("recommendation"))
    assert state["last_decision"]["decision"] == "promote"
    assert ("canary", 0) in seen or ("canary", 1) in seen
    status, body = _admin(proxy.url, "/analysis/support-bot?gate=promote")
    assert status == 200 and body["promote_ready"] is True


def test_candidate_without_traffic_holds(servers):
    sim = servers.simulator(_sim(copy.deepcopy(SIM_MODEL)))
    proxy = servers.proxy(_proxy(sim.url), env=ENV)
    time.sleep(2.0)
    state = _state(proxy.url)
    assert state["phase"] == "shadow" and state["step_index"] == -1
    assert state["recommendation"]["decision"] == "hold"
    status, body = _admin(proxy.url, "/analysis/support-bot?gate=promote")
    assert status == 412 and body["healthy"] is True and body["promote_ready"] is False


def test_admin_refuses_missing_or_wrong_token_and_unknown_route(servers, capsys):
    sim = servers.simulator(_sim(copy.deepcopy(SIM_MODEL)))
    proxy = servers.proxy(_proxy(sim.url), env=ENV)
    assert _admin(proxy.url, "/admin/rollouts", token=None)[0] == 401
    assert _admin(proxy.url, "/admin/rollouts", token="wrong")[0] == 403
    assert _admin(proxy.url, "/admin/rollouts/support-bot/promote", "POST", token=None)[0] == 401
    status, body = _admin(proxy.url, "/admin/rollouts/nope/promote", "POST")
    assert status == 404 and "nope" in body["error"]["message"]
    # the CLI turns them into one clear line and exit code 1
    assert admin_cli.status(proxy.url, None, None) == 1
    assert admin_cli.act(proxy.url, "wrong", "support-bot", "pause") == 1
    assert admin_cli.act(proxy.url, TOKEN, "nope", "promote") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "401" in err[0] and "--token" in err[0]
    assert "403" in err[1]
    assert "404" in err[2] and "nope" in err[2]
    # and a real action works
    assert admin_cli.act(proxy.url, TOKEN, "support-bot", "pause") == 0
    assert _state(proxy.url)["phase"] == "paused"
    assert admin_cli.status("http://127.0.0.1:9", TOKEN, None) == 1

