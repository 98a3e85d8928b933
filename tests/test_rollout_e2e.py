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
from tests.fixtures.servers import SIM_MODEL, blames_tool_calls, metric_value, proxy_config, scrape, sim_config

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


def _drive(url: str, until, timeout_s: float = 90.0, threads: int = 4,
           kinds: tuple[str, ...] = ("tools", "chat", "chat")) -> dict:
    """Send requests of `kinds` (chat, tools, json) in turn from a few threads until `until(state)` or
    the timeout."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        i = 0
        while not stop.is_set():
            i += 1
            kind = kinds[i % len(kinds)]
            try:
                if kind == "tools":
                    client.chat.completions.create(model="support-bot", tools=TOOLS,
                                                   messages=[{"role": "user", "content": f"where is order {k}-{i}?"}])
                elif kind == "json":
                    client.chat.completions.create(model="support-bot", response_format={"type": "json_object"},
                                                   messages=[{"role": "user", "content": f"order {k}-{i} as JSON"}])
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
    assert blames_tool_calls(d), d["reasons"]
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



def _segment_proxy(sim_url: str) -> dict:
    """Scope segment with two candidates: candidate-m (new-model) and worse-m (worse-model)."""
    margins = {"completion_rate": 0.04, "model_failure_rate": 0.04, "latency_p95_exceedance": 0.1,
               "agreement_gap": 0.1}
    cfg = _proxy(sim_url, rollout={"scope": "segment", "select": "best", "margins": margins})
    cfg["models"]["worse-m"] = {"provider": "sim", "name": "worse-model",
                                "price": {"input_per_mtok": 0.1, "output_per_mtok": 0.4}}
    route = cfg["routes"]["support-bot"]
    route["candidates"] = [route.pop("candidate"), "worse-m"]
    return cfg


def _segment_sim() -> dict:
    stable = copy.deepcopy(SIM_MODEL)
    stable["divergence"] = 0.0
    cheap = copy.deepcopy(stable)
    cheap["latency_s"] = {"median": 0.004, "p95": 0.01}
    cheap["segments"] = {"tools": {"failures": {"invalid_tool_call": 0.5}}}
    worse = copy.deepcopy(stable)
    worse["failures"] = {"truncated": 0.4}
    return sim_config({"good-model": stable, "new-model": cheap, "worse-model": worse}, time_scale=1.0)


def test_segment_scope_promotes_chat_and_json_and_keeps_tools_on_stable(servers, capsys):
    sim = servers.simulator(_segment_sim())
    proxy = servers.proxy(_segment_proxy(sim.url), env=ENV)
    state = _drive(proxy.url, lambda s: s["phase"] in ("rolled_back", "promoted", "partial"), timeout_s=150,
                   kinds=("tools", "chat", "json"))
    segs = state["segments"]
    assert {n: s["phase"] for n, s in segs.items()} == {"tools": "rolled_back", "json": "promoted",
                                                       "chat": "promoted"}, segs
    assert state["phase"] == "partial" and state["scope"] == "segment"
    assert segs["chat"]["candidate"] == segs["json"]["candidate"] == "candidate-m"
    assert "select best" in segs["chat"]["selected"]
    assert set(segs["tools"]["rejected"]) == {"candidate-m", "worse-m"}
    assert all("worse-m" in s["rejected"] for s in segs.values())
    tools = segs["tools"]["rejected"]["candidate-m"]
    assert any(r.startswith("segment tools, candidate-m:") for r in tools["reasons"]), tools
    assert any(e["segment"] == "tools" and e["verdict"] == "worse" for e in tools["evidence"])
    # the proxy routes by segment: chat and JSON to the candidate now, tools to stable
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)
    for kind, model in (("chat", "candidate-m"), ("tools", "stable-m")):
        extra = {"tools": TOOLS} if kind == "tools" else {}
        raw = client.chat.completions.with_raw_response.create(
            model="support-bot", messages=[{"role": "user", "content": "where is order 7?"}], **extra)
        assert raw.headers["x-modelcanary-model"] == model, kind
    # the operator surface: /analysis per segment, the capability × cost matrix, the metrics
    status, body = _admin(proxy.url, "/analysis/support-bot")
    assert status == 200 and body["phase"] == "partial" and body["healthy"] is True
    assert body["segments"]["tools"]["phase"] == "rolled_back" and body["segments"]["chat"]["promote_ready"] is True
    assert admin_cli.report(proxy.url, TOKEN, "support-bot", False) == 0
    out = capsys.readouterr().out
    assert "capability × cost" in out and "worse-m" in out and "ruled out" in out
    metrics = scrape(proxy.url)
    assert metric_value(metrics, "modelcanary_rollout_segment_weight_ratio", route="support-bot", segment="chat") == 1.0
    assert metric_value(metrics, "modelcanary_rollout_segment_phase", route="support-bot", segment="tools",
                        phase="rolled_back") == 1.0
    assert metric_value(metrics, "modelcanary_rollout_phase", route="support-bot", phase="partial") == 1.0


def test_operator_steps_one_segment_and_the_proxy_routes_it_alone(servers, capsys):
    sim = servers.simulator(_segment_sim())
    cfg = _segment_proxy(sim.url)
    cfg["routes"]["support-bot"]["rollout"]["mode"] = "advisory"  # only the operator acts
    proxy = servers.proxy(cfg, env=ENV)
    assert admin_cli.act(proxy.url, TOKEN, "support-bot", "promote", "json") == 0   # json: shadow → 20 %
    assert admin_cli.act(proxy.url, TOKEN, "support-bot", "promote", "nope") == 1
    assert admin_cli.act(proxy.url, TOKEN, "support-bot", "resume", "json") == 1
    err = capsys.readouterr()
    assert "support-bot segment json: promote → phase canary, weight 20%, step 1 (candidate-m)" in err.out
    assert "404" in err.err and "no segment 'nope'" in err.err and "409" in err.err and "not paused" in err.err
    state = _state(proxy.url)
    assert state["segments"]["json"]["canary_weight"] == 0.2 and state["phase"] == "canary"
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)
    roles: dict[str, list[str]] = {"json": [], "chat": []}
    for i in range(300):
        for kind in roles:
            extra = {"response_format": {"type": "json_object"}} if kind == "json" else {}
            raw = client.chat.completions.with_raw_response.create(
                model="support-bot", messages=[{"role": "user", "content": f"hi {i}"}], user=f"u{i}", **extra)
            roles[kind].append(raw.headers["x-modelcanary-role"])
    assert roles["chat"].count("canary") == 0
    assert 30 <= roles["json"].count("canary") <= 90, roles["json"].count("canary")  # 20 % of 300, sticky per user
    again = [client.chat.completions.with_raw_response.create(
        model="support-bot", messages=[{"role": "user", "content": "again"}], user=f"u{i}",
        response_format={"type": "json_object"}).headers["x-modelcanary-role"] for i in range(50)]
    assert again == roles["json"][:50]
