"""End to end: every panel of every dashboard shows data from a real Prometheus.

The simulator (examples/simulator.yaml, faster and with more failures) serves the
models; the proxy (`modelcanary serve`, embedded shadow workers and controller)
routes between them with a canary at 50%; the official openai SDK drives mixed
traffic (plain, streaming, tools, JSON mode, task types, multi-turn, repeats);
a real Prometheus scrapes the proxy every second with our recording rules loaded.
Then every PromQL expression of every panel, with the template variables
substituted, must return a non-empty result, and every recording rule must
produce series.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from dashboards.build import RULES_FILE, build_all
from dashboards.queries import default_variables, panel_queries, substitute
from tests.fixtures.prometheus import PrometheusError
from tests.fixtures.servers import proxy_config

ROOT = Path(__file__).resolve().parents[1]
ROUTE = "support-bot"
TOKEN = "e2e-admin-token"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

pytestmark = [
    pytest.mark.requires("prometheus"),
    pytest.mark.timeout(240),
]


# (panel title, label, values that must all be there)
EXPECTED_LABELS = [
    ("Completion rate by role", "role", {"stable", "canary"}),
    ("Request latency p50 / p95 / p99 by role", "role", {"stable", "canary"}),
    ("Time to first token p50 / p95 by role", "role", {"stable", "canary"}),
    ("Failures by blame", "blame", {"model", "provider"}),
    ("Cost per completed request by role", "role", {"stable", "canary"}),
    ("Capability matrix: segment × role over the time range", "segment", {"chat", "tools", "json", "billing",
                                                                          "multi_turn"}),
    ("Agreement with the live stable answer: candidate vs noise floor", "comparison", {"candidate", "noise_floor"}),
    ("Upstream retries by cause", "cause", {"rate_limited"}),
]


def simulator_config() -> dict:
    """examples/simulator.yaml, 20x faster, with enough failures of every kind to show up in a minute."""
    sim = yaml.safe_load((ROOT / "examples" / "simulator.yaml").read_text())
    sim["time_scale"] = 0.05
    for model in sim["models"].values():
        model["failures"] = {**model.get("failures", {}), "rate_limited": 0.06, "provider_5xx": 0.04,
                             "truncated": 0.03, "refusal": 0.02, "invalid_json": 0.1, "invalid_tool_call": 0.1}
    sim["models"]["judge-model"] = {"judge": True, "judge_error": 0.1}  # for the pairwise-judge panels
    return sim


def modelcanary_config(sim_url: str) -> dict:
    cfg = proxy_config(sim_url, shadow={"sample_rate": 0.5, "max_per_minute": 6000, "noise_floor": True},
                       rollout={"steps": [50], "min_shadow_samples": 20, "min_samples_per_step": 20,
                                "min_step_seconds": 1, "mode": "advisory"})
    cfg["providers"]["sim"]["max_retries"] = 2
    cfg["models"]["judge-m"] = {"provider": "sim", "name": "judge-model"}
    cfg["routes"][ROUTE]["shadow"]["judge"] = {"model": "judge-m"}
    return cfg


def promote(proxy_url: str) -> dict:
    req = urllib.request.Request(f"{proxy_url}/admin/rollouts/{ROUTE}/promote", method="POST", data=b"",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def one_request(client: openai.OpenAI, i: int) -> None:
    """One of several request shapes; failures (as the SDK raises them) are part of the traffic."""
    kind = i % 6
    user = f"user-{i % 17}"
    prompt = f"Question number {i % 25}: how do I reset my password?"   # repeats → client retries
    try:
        if kind == 0:
            client.chat.completions.create(model=ROUTE, user=user, messages=[{"role": "user", "content": prompt}])
        elif kind == 1:
            for _ in client.chat.completions.create(model=ROUTE, user=user, stream=True,
                                                    stream_options={"include_usage": True},
                                                    messages=[{"role": "user", "content": prompt}]):
                pass
        elif kind == 2:
            client.chat.completions.create(model=ROUTE, user=user, tools=[WEATHER_TOOL],
                                           messages=[{"role": "user", "content": f"Weather in city {i % 9}?"}])
        elif kind == 3:
            client.chat.completions.create(model=ROUTE, user=user, response_format={"type": "json_object"},
                                           messages=[{"role": "user", "content": f"Order {i % 11} as JSON"}])
        elif kind == 4:
            client.chat.completions.create(model=ROUTE, user=user, extra_headers={"x-task-type": "billing"},
                                           messages=[{"role": "user", "content": f"Invoice {i % 13}?"}])
        else:
            turns = []
            for t in range(3):
                turns += [{"role": "user", "content": f"turn {t} of talk {i % 7}"},
                          {"role": "assistant", "content": "ok"}]
            client.chat.completions.create(model=ROUTE, user=user,
                                           messages=turns + [{"role": "user", "content": "and now?"}])
    except openai.APIError:
        pass


class Traffic:
    """Mixed traffic from a few threads until stopped."""

    def __init__(self, base_url: str, threads: int = 6):
        self.client = openai.OpenAI(base_url=base_url, api_key="sk-e2e-client", max_retries=2, timeout=10)
        self.threads = threads
        self.sent = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads)

    def _loop(self, offset: int, pause_s: float) -> None:
        i = offset
        while not self._stop.is_set():
            one_request(self.client, i)
            with self._lock:
                self.sent += 1
            i += self.threads
            if pause_s:
                time.sleep(pause_s)

    def start(self, pause_s: float = 0.0) -> Traffic:
        for t in range(self.threads):
            self._pool.submit(self._loop, t, pause_s)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)


def empty_queries(prom, models: dict[str, dict], variables: dict[str, str]) -> list[str]:
    empty = []
    for model in models.values():
        for q in panel_queries(model):
            expr = substitute(q.expr, variables)
            try:
                result = prom.query(expr)
            except PrometheusError as e:
                empty.append(f"{q.dashboard} / {q.panel} [{q.ref_id}]: error {e}")
                continue
            if not result:
                empty.append(f"{q.dashboard} / {q.panel} [{q.ref_id}]: {expr}")
    return empty


def recording_rules() -> list[str]:
    return [r["record"] for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]
            if "record" in r]


def test_every_panel_has_data(servers, prometheus_factory):
    sim = servers.simulator(simulator_config())
    proxy = servers.proxy(modelcanary_config(sim.url), env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    state = promote(proxy.url)
    assert state["phase"] == "canary" and state["canary_weight"] == 0.5

    prom = prometheus_factory([f"127.0.0.1:{proxy.port}"], rule_files=[RULES_FILE], scrape_interval="1s")
    prom.wait_targets_up(timeout=30)

    traffic = Traffic(proxy.url + "/v1").start()
    models = build_all()
    variables = default_variables(ROUTE, rate_interval="1m", interval="15s", range_="5m")
    try:
        time.sleep(15)
        deadline = time.monotonic() + 90
        while True:
            empty = empty_queries(prom, models, variables)
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert traffic.sent > 100
        assert empty == [], ("panels without data:\n" + "\n".join(empty)
                             + f"\n\nup: {prom.query('up')}\nproxy log:\n{proxy.output()[-3000:]}")

        # The panels that compare stable and candidate show both.
        for title, label, wanted in EXPECTED_LABELS:
            q = next(q for m in models.values() for q in panel_queries(m) if q.panel == title)
            got = {r["metric"].get(label) for r in prom.query(substitute(q.expr, variables))}
            assert wanted <= got and "none" not in got, (title, label, got)

        for record in recording_rules():
            series = prom.wait_for(f'{record}{{route="{ROUTE}"}}', timeout=30)
            roles = {s["metric"].get("role") for s in series}
            assert {"stable", "canary"} <= roles, (record, series)
    finally:
        traffic.stop()


def test_route_variable_lists_the_route(servers, prometheus_factory):
    """The `route` variable's query (label_values) resolves against the scraped proxy."""
    sim = servers.simulator(simulator_config())
    proxy = servers.proxy(modelcanary_config(sim.url))
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-e2e-client", max_retries=0, timeout=10)
    for i in range(5):
        one_request(client, i * 6)
    prom = prometheus_factory([f"127.0.0.1:{proxy.port}"])
    prom.wait_targets_up(timeout=30)
    query = copy.deepcopy(build_all()["modelcanary-rollout"]["templating"]["list"][1]["query"])
    assert query == "label_values(modelcanary_requests_total, route)"
    values = prom.api("label/route/values", {"match[]": "modelcanary_requests_total"})
    assert ROUTE in values
