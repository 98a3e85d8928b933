"""Per-model request settings (issue 13 item 5): `system_prompt` and `params` in a `models:` entry make
a prompt or sampling change a candidate. They reach the upstream on live, shadow and noise-floor calls
alike (seen on the wire, between the proxy and the simulator), they are in each evaluation's
`repro`, and `check-config` rejects params that are not chat fields, naming the field."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import uuid

import anthropic
import openai
import pytest

from collectors.worker import run_workers
from service.bus.memory import MemoryBus
from service.config import parse_config
from service.records import PrimaryResult, TrafficEvent
from service.upstream import make_providers
from tests.faults.fault_proxy import FaultProxy
from tests.fixtures.servers import CLI, ROOT, sim_config, write_yaml

pytestmark = pytest.mark.timeout(120)

ROUTE = "support-bot"
STABLE_PROMPT = "You are the stable assistant."
CANDIDATE_PROMPT = "You are the terse candidate."


def settings_config(sim_url: str, **route) -> dict:
    if "shadow" in route:  # no stability repeats: each test counts the calls upstream
        route["shadow"] = {"stability": {"sample_rate": 0.0}, **route["shadow"]}
    return {
        "providers": {"sim": {"base_url": sim_url + "/v1", "timeout_s": 5, "max_retries": 0}},
        "models": {
            # one upstream model, two settings: the prompt and the sampling are what is canaried
            "prompt-v1": {"provider": "sim", "name": "good-model", "system_prompt": STABLE_PROMPT,
                          "params": {"temperature": 0.1}},
            "prompt-v2": {"provider": "sim", "name": "good-model", "system_prompt": CANDIDATE_PROMPT,
                          "params": {"temperature": 0.9, "max_tokens": 5}},
        },
        "routes": {ROUTE: {"stable": "prompt-v1", "candidate": "prompt-v2", **route}},
    }


def upstream_bodies(raw: bytes, path: bytes = b"/v1/chat/completions") -> list[dict]:
    """The JSON bodies of the requests to `path` in bytes captured on their way upstream."""
    out = []
    for head in re.finditer(rb"POST " + re.escape(path) + rb" HTTP/1\.1\r\n(.*?)\r\n\r\n", raw, re.DOTALL):
        length = int(re.search(rb"(?i)content-length: (\d+)", head.group(1)).group(1))
        out.append(json.loads(raw[head.end():head.end() + length]))
    return out


def test_settings_reach_the_upstream_on_live_shadow_and_noise_floor_calls(servers):
    sim = servers.simulator(sim_config())
    fault = FaultProxy("127.0.0.1", sim.port, capture_bytes=8 * 1024 * 1024).start()
    try:
        proxy = servers.proxy(settings_config(fault.url, shadow={"sample_rate": 1.0, "noise_floor": True}))
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)
        n = 4
        for i in range(n):
            client.chat.completions.create(model=ROUTE, temperature=0.7, max_tokens=50,
                                           messages=[{"role": "user", "content": f"question {i}"}])
        deadline = time.monotonic() + 60  # the shadow workers' child process may take seconds to start
        bodies = upstream_bodies(bytes(fault.captured))
        while len(bodies) < 3 * n and time.monotonic() < deadline:  # live, candidate, stable again
            time.sleep(0.1)
            bodies = upstream_bodies(bytes(fault.captured))
    finally:
        fault.stop()
    assert len(bodies) == 3 * n, bodies
    for body in bodies:
        assert body["model"] == "good-model"
        assert body["messages"][0]["role"] == "system"
        assert body["messages"][1]["content"].startswith("question ")
    stable = [b for b in bodies if b["messages"][0]["content"] == STABLE_PROMPT]
    candidate = [b for b in bodies if b["messages"][0]["content"] == CANDIDATE_PROMPT]
    assert len(stable) == 2 * n and len(candidate) == n  # live + noise floor on v1; the shadow on v2
    assert all(b["temperature"] == 0.1 and b["max_tokens"] == 50 for b in stable)  # the client's cap kept
    assert all(b["temperature"] == 0.9 and b["max_tokens"] == 5 for b in candidate)  # params override


OWN_SYSTEM = "Answer in English."


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_settings_reach_the_upstream_in_the_responses_and_messages_formats(servers, api):
    sim = servers.simulator(sim_config())
    fault = FaultProxy("127.0.0.1", sim.port, capture_bytes=8 * 1024 * 1024).start()
    try:
        cfg = settings_config(fault.url, shadow={"sample_rate": 1.0})
        if api == "messages":
            cfg["providers"]["sim"]["api"] = "anthropic"
        proxy = servers.proxy(cfg)
        n = 3
        for i in range(n):
            if api == "responses":
                openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0).responses.create(
                    model=ROUTE, input=f"question {i}", instructions=OWN_SYSTEM, temperature=0.7,
                    max_output_tokens=50)
            else:
                anthropic.Anthropic(base_url=proxy.url, api_key="sk-client", max_retries=0).messages.create(
                    model=ROUTE, max_tokens=50, system=OWN_SYSTEM, extra_body={"temperature": 0.7},
                    messages=[{"role": "user", "content": f"question {i}"}])
        path = f"/v1/{api}".encode()
        deadline = time.monotonic() + 60  # the shadow workers' child process may take seconds to start
        bodies = upstream_bodies(bytes(fault.captured), path)
        while len(bodies) < 3 * n and time.monotonic() < deadline:  # live, candidate, stable again
            time.sleep(0.1)
            bodies = upstream_bodies(bytes(fault.captured), path)
    finally:
        fault.stop()
    assert len(bodies) == 3 * n, bodies
    cap = "max_output_tokens" if api == "responses" else "max_tokens"
    if api == "responses":
        prompts = [b["instructions"].removesuffix("\n\n" + OWN_SYSTEM) for b in bodies]
        assert all(b["instructions"].endswith("\n\n" + OWN_SYSTEM) for b in bodies)  # the client's own after it
    else:
        assert all([block["text"] for block in b["system"]][1:] == [OWN_SYSTEM] for b in bodies)
        prompts = [b["system"][0]["text"] for b in bodies]
    stable = [b for b, prompt in zip(bodies, prompts, strict=True) if prompt == STABLE_PROMPT]
    candidate = [b for b, prompt in zip(bodies, prompts, strict=True) if prompt == CANDIDATE_PROMPT]
    assert len(stable) == 2 * n and len(candidate) == n  # live + noise floor on v1; the shadow on v2
    assert all(b["model"] == "good-model" for b in bodies)
    assert all(b["temperature"] == 0.1 and b[cap] == 50 for b in stable)  # the client's cap kept
    assert all(b["temperature"] == 0.9 and b[cap] == 5 for b in candidate)  # params override


def test_evaluation_repro_records_both_arms_settings(servers):
    sim = servers.simulator(sim_config())
    config = parse_config(settings_config(sim.url, shadow={"sample_rate": 1.0, "noise_floor": True}))

    async def evaluate() -> list:
        bus = MemoryBus()
        bus.subscribe(["traffic"], group="modelcanary-shadow")
        out = bus.subscribe(["evaluations"], group=None)
        providers = make_providers(config)
        stop = asyncio.Event()
        task = asyncio.create_task(run_workers(config, bus, providers, None, stop))
        request = {"model": ROUTE, "messages": [{"role": "user", "content": "hello"}]}
        bus.publish("traffic", TrafficEvent(
            request_id=uuid.uuid4().hex, ts=time.time(), route=ROUTE, segment="chat", request=request,
            primary=PrimaryResult(model="prompt-v1", status=200, body=None, latency_s=0.01, outcome="completed"),
            config_version=config.version()))
        records: list = []
        deadline = time.monotonic() + 30
        while not records and time.monotonic() < deadline:
            records = await out.get_batch(10, 0.2)
        stop.set()
        await asyncio.wait_for(task, 15)
        for p in providers.values():
            await p.close()
        return records

    records = asyncio.run(evaluate())
    assert len(records) == 1
    settings = records[0].repro.model_settings
    assert settings["prompt-v2"] == {"upstream": "good-model", "system_prompt": CANDIDATE_PROMPT,
                                     "params": {"temperature": 0.9, "max_tokens": 5}}
    assert settings["prompt-v1"] == {"upstream": "good-model", "system_prompt": STABLE_PROMPT,
                                     "params": {"temperature": 0.1}}


@pytest.mark.parametrize("params,ok", [
    ({"temperature": 0.2, "top_p": 0.9, "max_tokens": 64, "reasoning_effort": "low", "seed": 3}, True),
    ({"temprature": 0.2}, False),
    ({"stream": True}, False),
    ({"messages": []}, False),
])
def test_check_config_rejects_params_that_are_not_chat_fields(tmp_path, params, ok):
    cfg = settings_config("http://127.0.0.1:9")
    cfg["models"]["prompt-v2"]["params"] = params
    path = write_yaml(tmp_path / "c.yaml", cfg)
    done = subprocess.run(CLI + ["check-config", str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    if ok:
        assert done.returncode == 0, done.stdout + done.stderr
        return
    out = done.stdout + done.stderr
    assert done.returncode == 1
    assert f"models.prompt-v2.params: '{next(iter(params))}' is not a Chat Completions request field" in out
    assert "Traceback" not in out
