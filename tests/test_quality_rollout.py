"""Answer quality decides, end to end in memory mode (`modelcanary serve` + `modelcanary simulate`,
traffic through the openai SDK): a candidate that answers fluently with a wrong fact in one segment
is rolled back for that segment's judge preference, which similarity alone cannot see."""

from __future__ import annotations

import copy
import threading
import time

import openai
import pytest

from tests.fixtures.servers import SIM_MODEL, proxy_config, sim_config
from tests.test_rollout_e2e import ENV, _state

pytestmark = pytest.mark.timeout(300)

ROUTE = "support-bot"
TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello, how can I help?"},
         {"role": "user", "content": "it is about my account"}, {"role": "assistant", "content": "sure"}]


def _drive(url: str, until, timeout_s: float, threads: int = 4) -> dict:
    """Chat and multi-turn requests, half and half, until `until(state)` or the timeout."""
    stop = threading.Event()

    def worker(k: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        i = 0
        while not stop.is_set():
            i += 1
            question = {"role": "user", "content": f"question {k}-{i}"}
            messages = [*TURNS, question] if i % 2 else [question]
            client.chat.completions.create(model=ROUTE, messages=messages)

    pool = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    deadline = time.monotonic() + timeout_s
    state = _state(url)
    try:
        while time.monotonic() < deadline and not until(state):
            time.sleep(0.5)
            state = _state(url)
    finally:
        stop.set()
        for t in pool:
            t.join(15)
    return state


def test_wrong_facts_in_one_segment_are_rolled_back_for_that_segments_judge_preference(servers):
    stable = {**copy.deepcopy(SIM_MODEL), "divergence": 0.0}
    candidate = {**copy.deepcopy(SIM_MODEL), "divergence": 0.0,
                 "segments": {"multi_turn": {"wrong_content": 0.2}}}  # equal everywhere else
    judge = {**copy.deepcopy(SIM_MODEL), "divergence": 0.0, "judge": True}
    sim = servers.simulator(sim_config({"good-model": stable, "new-model": candidate, "judge-model": judge},
                                       time_scale=1.0))
    cfg = proxy_config(sim.url,
                       shadow={"sample_rate": 1.0, "max_per_minute": 100_000, "noise_floor": True,
                               "judge": {"model": "judge-m"}},
                       rollout={"min_shadow_samples": 1_000_000, "min_step_seconds": 0, "mode": "auto",
                                # shadow latency is measured in a child that this burst of traffic keeps
                                # busy on a small machine: this test is about content, not speed
                                "margins": {"latency_p95_exceedance": 1.0}})
    cfg["models"]["judge-m"] = {"provider": "sim", "name": "judge-model"}
    cfg["control"] = {"interval_s": 0.5}
    proxy = servers.proxy(cfg, env=ENV)

    state = _drive(proxy.url, lambda s: s["phase"] == "rolled_back", timeout_s=200)
    assert state["phase"] == "rolled_back", state.get("recommendation")
    decision = state["last_decision"]
    worse = {(e["metric"], e["segment"]) for e in decision["evidence"] if e["verdict"] == "worse"}
    assert ("judge_preference", "multi_turn") in worse, decision
    assert any(r.startswith("segment multi_turn: judge preference") for r in decision["reasons"]), decision["reasons"]
    # the chat segment answers the same facts: nothing worse there, and similarity did not decide
    assert not any(seg == "chat" for _, seg in worse), worse
    assert ("similarity_gap", "multi_turn") not in worse
    assert {metric for metric, _ in worse} <= {"judge_preference", "agreement_gap"}, worse
    evidence = next(e for e in decision["evidence"] if (e["metric"], e["segment"]) == ("judge_preference", "multi_turn"))
    assert evidence["effect"] < -0.05 and evidence["interval"][1] < -0.05 and evidence["n"] >= 30
