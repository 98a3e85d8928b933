"""Answer quality on a real model (SmolLM2-135M behind llama.cpp's server), end to end: `modelcanary
serve` in memory mode with the same model as stable and candidate (an A/A), every request shadowed,
the pairwise judge (the same small model) on a part of them. The path works on real output: each
shadow record carries similarities in [0, 1] from the local embeddings, the judge's verdicts (or
its errors) are counted, and the report shows the answer quality per segment.

The statistical A/A and degraded-candidate runs (hundreds of requests) are in
benchmarks/real_model_quality.py: a 135M model on 2 cores takes minutes for 200 requests."""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest

from collectors.evaluators.llm_judge import VERDICT_SCHEMA
from tests.fixtures.servers import metric_value, scrape

pytestmark = [pytest.mark.real_llm, pytest.mark.timeout(900)]

ROUTE = "assistant"
TOKEN = "real-llm-quality-token"
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What do bees make?",
             "How many legs does a spider have?", "What is water made of?", "Which planet is the largest?",
             "What language is spoken in Brazil?", "What is the boiling point of water in Celsius?"]
N = 24


def config(base_url: str) -> dict:
    return {
        # one llama.cpp server answers one call at a time: a live call can queue behind the shadow,
        # noise-floor and judge calls of the requests before it, longer on a loaded machine
        "providers": {"llama": {"base_url": base_url, "timeout_s": 600, "max_retries": 0}},
        "models": {"stable-m": {"provider": "llama", "name": "smollm2"},
                   "candidate-m": {"provider": "llama", "name": "smollm2"},
                   # llama-cpp-python 0.3 refuses `response_format: json_schema`; its own form constrains
                   # the answer to the same schema (a model's params override the judge's request fields)
                   "judge-m": {"provider": "llama", "name": "smollm2",
                               # max_tokens: a verdict is a sentence; it stops a runaway "reason" holding the server
                               "params": {"response_format": {"type": "json_object", "schema": VERDICT_SCHEMA},
                                          "max_tokens": 200}}},
        "routes": {ROUTE: {"stable": "stable-m", "candidate": "candidate-m",
                           "shadow": {"sample_rate": 1.0, "noise_floor": True, "stability": {"sample_rate": 0.0},
                                      "judge": {"model": "judge-m", "sample_rate": 0.5}},
                           "rollout": {"mode": "advisory"}}},
        "control": {"interval_s": 0.5, "report_interval_s": 1.0},
    }


def report(url: str) -> dict:
    req = urllib.request.Request(f"{url}/admin/rollouts/{ROUTE}/report", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["report"] or {}


def wait_for(check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1.0)
    return check()


def test_similarity_and_the_pairwise_judge_on_real_answers(llama_server, servers):
    proxy = servers.proxy(config(llama_server.base_url), env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=600)
    for i in range(N):
        r = client.chat.completions.create(model=ROUTE, max_tokens=40, temperature=0.7,
                                           messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        assert r.choices[0].message.content

    def shadowed() -> float:
        return metric_value(scrape(proxy.url), "modelcanary_shadow_requests_total", route=ROUTE, model="candidate-m")

    wait_for(lambda: shadowed() >= N, 600)
    assert shadowed() >= N, proxy.output()[-3000:]
    text = scrape(proxy.url)
    for comparison in ("candidate", "noise_floor"):
        count = metric_value(text, "modelcanary_shadow_similarity_count", route=ROUTE, comparison=comparison)
        total = metric_value(text, "modelcanary_shadow_similarity_sum", route=ROUTE, comparison=comparison)
        assert count >= N - 2, (comparison, count)  # a failed shadow call has no answer to compare
        assert 0.2 < total / count <= 1.0, (comparison, total / count)  # real rephrasings: neither 0 nor all 1
    verdicts = {c: {r: metric_value(text, "modelcanary_shadow_judge_total", route=ROUTE, comparison=c, result=r)
                    for r in ("win", "tie", "loss", "error")} for c in ("candidate", "noise_floor")}
    judged = sum(verdicts["candidate"].values())
    assert judged >= 2, verdicts  # ~half the records are judged (fewer than 2 of 24: p < 2e-6; at 0.25 it was ~1%)
    assert sum(verdicts["candidate"][r] for r in ("win", "tie", "loss")) >= 1, verdicts  # JSON by the schema

    quality = wait_for(lambda: ((report(proxy.url).get("shadow") or {}).get("segments") or {}).get("overall", {})
                       .get("quality", {}).get("similarity", {}).get("candidate_vs_stable", {}).get("n", 0) >= N - 2
                       and report(proxy.url)["shadow"]["segments"]["overall"]["quality"], 120)
    assert quality, report(proxy.url).get("shadow")
    gap = quality["similarity"]["gap"]
    assert gap["n"] >= N - 4 and gap["interval"] is not None and -1.0 <= gap["value"] <= 1.0
