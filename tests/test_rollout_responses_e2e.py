"""End to end on a Responses-API route, as test_rollout_e2e does for chat: `modelcanary serve` +
`modelcanary simulate`, traffic through the openai SDK's `responses.create`, the embedded controller
rolling back a candidate that breaks tool calls, with the same reason and evidence."""

from __future__ import annotations

import copy
import threading
import time

import openai

from service.admin import cli as admin_cli
from tests.fixtures.servers import SIM_MODEL, blames_tool_calls
from tests.test_rollout_e2e import ENV, TOKEN, _admin, _proxy, _sim, _state

TOOLS = [{"type": "function", "name": "lookup_order", "description": "Find an order",
          "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}]


def _drive(url: str, until, timeout_s: float = 90.0, threads: int = 4) -> dict:
    """Send Responses-API requests, a third of them with function tools, until `until(state)`."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                if i % 3 == 0:
                    client.responses.create(model="support-bot", tools=TOOLS, input=f"where is order {k}-{i}?")
                else:
                    client.responses.create(model="support-bot", input=f"hello {k}-{i}")
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


def test_tool_breaking_candidate_on_a_responses_route_is_rolled_back(servers, capsys):
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
    assert admin_cli.report(proxy.url, TOKEN, "support-bot", False) == 0
    out = capsys.readouterr().out
    assert "tools" in out and "worse" in out
    status, body = _admin(proxy.url, "/analysis/support-bot")
    assert status == 200 and body["healthy"] is False and body["phase"] == "rolled_back"
