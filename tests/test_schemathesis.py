"""Schemathesis against a running proxy over HTTP, from the app's own /openapi.json (the chat endpoint
declares its request body there, so there is something to generate). Expectations: no 5xx, every
4xx has an error body in its API's shape (OpenAI's; Anthropic's on /v1/messages), no response
slower than 1 s. Bounded example count."""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.fixtures.servers import metric_value, proxy_config, scrape, sim_config, start_proxy, start_simulator

TOKEN = "schemathesis-admin-token"
MAX_EXAMPLES = 50
MAX_SECONDS = 1.0
CHAT = "POST /v1/chat/completions"


@pytest.fixture(scope="module")
def live_proxy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schemathesis")
    sim = start_simulator(tmp, sim_config())
    cfg = proxy_config(sim.url)
    cfg["routes"]["support-bot"]["shadow"] = {"sample_rate": 0.5}
    proxy = start_proxy(tmp, cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    try:
        yield proxy
    finally:
        proxy.stop()
        sim.stop()


@pytest.fixture(scope="module")
def api_schema(live_proxy):
    return schemathesis.openapi.from_url(live_proxy.url + "/openapi.json")


def check(session: requests.Session, base_url: str, case) -> None:
    # admin calls carry the token, so their handlers run (auth refusals are tested in test_secrets.py).
    # Sent with requests directly: schemathesis 4.32's own transport trips over urllib3 2.8's pool container.
    kwargs = case.as_transport_kwargs(base_url=base_url, headers={"Authorization": f"Bearer {TOKEN}"})
    response = session.request(**kwargs, timeout=10)
    label = f"{case.method} {case.formatted_path} -> {response.status_code}"
    assert response.status_code < 500, f"{label}: {response.text[:500]}"
    assert response.elapsed.total_seconds() < MAX_SECONDS, f"{label} took {response.elapsed.total_seconds():.2f}s"
    if 400 <= response.status_code < 500:
        body = json.loads(response.content)
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{label}: {response.text[:300]}"
        err = body["error"]
        assert isinstance(err.get("message"), str) and err["message"], f"{label}: {err}"
        assert isinstance(err.get("type"), str), f"{label}: {err}"
        if case.formatted_path == "/v1/messages":  # Anthropic's shape, for the anthropic SDKs
            assert body.get("type") == "error", f"{label}: {response.text[:300]}"
        else:
            assert "code" in err and "param" in err, f"{label}: {err}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api(live_proxy, api_schema, mode):
    """Every operation of the schema, with data that fits it and data that doesn't.
    (The Python API rather than `schema.parametrize()`: the lazy pytest fixture loader of
    schemathesis 4.32 does not run under pytest 9.)"""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10
    session = requests.Session()
    ran: dict[str, int] = {}  # cases sent and checked, per operation
    unsatisfiable: set[str] = set()
    for operation in operations:
        @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.generate], database=None)
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            # a generated `model` names no route (404); every other chat case names the real one, so the
            # proxying path gets the generated bodies too
            if operation.label == CHAT and isinstance(case.body, dict) and ran.get(CHAT, 0) % 2:  # noqa: B023 - run() is called right here
                case.body["model"] = "support-bot"
            check(session, live_proxy.url, case)
            ran[operation.label] = ran.get(operation.label, 0) + 1  # noqa: B023 - run() is called right here

        try:
            run()
        except Unsatisfiable:
            assert mode == GenerationMode.NEGATIVE  # nothing to make invalid (no parameters, no body)
            unsatisfiable.add(operation.label)
    # every operation got cases (or, for invalid data, has nothing to make invalid), chat and feedback many
    assert set(ran) | unsatisfiable == {op.label for op in operations}, (ran, unsatisfiable)
    assert ran.get(CHAT, 0) >= 10 and ran.get("POST /v1/feedback", 0) >= 10, ran
    text = scrape(live_proxy.url)
    if mode == GenerationMode.POSITIVE:  # valid chat requests reached the models
        assert metric_value(text, "modelcanary_requests_total", route="support-bot") > 0
    assert metric_value(text, "modelcanary_failures_total", cause="proxy_error") == 0
