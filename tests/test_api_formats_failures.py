"""Failure attribution on the Responses API and Anthropic Messages: the simulator's failure knobs,
rendered in each format, through the proxy to the real clients; the proxy records the cause."""

from __future__ import annotations

import copy
import time

import anthropic
import openai
import pytest

from tests.fixtures.servers import (
    SIM_MODEL,
    metric_value,
    proxy_config,
    scrape,
    sim_config,
    start_proxy,
    start_simulator,
)

KNOBS = ("truncated", "content_filtered", "refusal", "empty_output", "invalid_json", "invalid_tool_call",
         "provider_5xx", "rate_limited", "bad_response")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("format-failures")
    models = {"good-model": copy.deepcopy(SIM_MODEL)}
    for knob in KNOBS:
        models[f"sim-{knob}"] = {**copy.deepcopy(SIM_MODEL), "failures": {knob: 1.0}}
    models["sim-small"] = {**copy.deepcopy(SIM_MODEL), "context_tokens": 50}
    sim = start_simulator(tmp, sim_config(models))
    cfg = proxy_config(sim.url)
    cfg["providers"]["sim"]["max_retries"] = 0
    cfg["providers"]["claude"] = {"base_url": sim.url + "/v1", "api": "anthropic", "timeout_s": 5, "max_retries": 0}
    for name in models:
        cfg["models"][f"r-{name}"] = {"provider": "sim", "name": name}
        cfg["models"][f"a-{name}"] = {"provider": "claude", "name": name}
    proxy = start_proxy(tmp, cfg)
    yield proxy
    proxy.stop()
    sim.stop()


def _count(proxy, model: str, cause: str) -> float:
    """Requests counted for `cause`: failures, except the client's own cap (`max_tokens`), which is a
    completed answer, outside every failure count."""
    text = scrape(proxy.url)
    if cause == "max_tokens":
        assert metric_value(text, "modelcanary_failures_total", model=model, cause=cause) == 0
        return metric_value(text, "modelcanary_requests_total", model=model, outcome="completed")
    return metric_value(text, "modelcanary_failures_total", model=model, cause=cause)


def _failures(proxy, model: str, cause: str, above: float) -> float:
    """The count of `cause`, once it is above `above` (or after 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        value = _count(proxy, model, cause)
        if value > above or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


RESPONSES_CASES = [
    ("truncated", {"input": "hi"}, "truncated"),
    ("good-model", {"input": "hi", "max_output_tokens": 3}, "max_tokens"),
    ("content_filtered", {"input": "hi"}, "content_filtered"),
    ("refusal", {"input": "hi"}, "refusal"),
    ("empty_output", {"input": "hi"}, "empty_output"),
    ("invalid_json", {"input": "hi", "text": {"format": {"type": "json_object"}}}, "invalid_json"),
    ("invalid_tool_call", {"input": "weather?", "tools": RESPONSES_TOOLS}, "invalid_tool_call"),
    ("provider_5xx", {"input": "hi"}, "provider_5xx"),
    ("rate_limited", {"input": "hi"}, "rate_limited"),
    ("bad_response", {"input": "hi"}, "bad_response"),
    ("small", {"input": "word " * 400}, "context_length_exceeded"),
]


@pytest.mark.parametrize(("sim_model", "request_body", "cause"), RESPONSES_CASES, ids=[c[0] for c in RESPONSES_CASES])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_failures_are_attributed(stack, sim_model, request_body, cause, stream):
    proxy = stack
    model = f"r-{sim_model}" if sim_model == "good-model" else f"r-sim-{sim_model}"
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
    if stream and cause == "bad_response":
        cause = "connection_error"  # streamed, the simulator's cut-off answer ends with the connection dropped
    before = _count(proxy, model, cause)
    try:
        if stream:
            events = list(client.responses.create(model=model, stream=True, **request_body))
            assert events[-1].type in ("response.completed", "response.incomplete")
        else:
            client.responses.create(model=model, **request_body)
    except openai.APIError:
        assert cause in ("provider_5xx", "rate_limited", "bad_response", "connection_error",
                         "context_length_exceeded"), cause
    assert _failures(proxy, model, cause, before) == before + 1


MESSAGES_CASES = [
    ("good-model", {"max_tokens": 3}, "max_tokens"),
    ("truncated", {}, "truncated"),
    ("refusal", {}, "refusal"),
    ("content_filtered", {}, "refusal"),
    ("empty_output", {}, "empty_output"),
    ("invalid_tool_call", {"tools": ANTHROPIC_TOOLS}, "invalid_tool_call"),
    ("provider_5xx", {}, "provider_5xx"),
    ("rate_limited", {}, "rate_limited"),
    ("bad_response", {}, "bad_response"),
    ("small", {"messages": [{"role": "user", "content": "word " * 400}]}, "context_length_exceeded"),
]


@pytest.mark.parametrize(("sim_model", "extra", "cause"), MESSAGES_CASES, ids=[c[0] for c in MESSAGES_CASES])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_messages_failures_are_attributed(stack, sim_model, extra, cause, stream):
    proxy = stack
    model = f"a-{sim_model}" if sim_model == "good-model" else f"a-sim-{sim_model}"
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0, timeout=10)
    body = {"max_tokens": 200, "messages": [{"role": "user", "content": "weather in Bern?"}], **extra}
    if stream and cause == "bad_response":
        cause = "connection_error"  # streamed, the simulator's cut-off answer ends with the connection dropped
    before = _count(proxy, model, cause)
    try:
        if stream:
            with client.messages.stream(model=model, **body) as s:
                s.get_final_message()
        else:
            client.messages.create(model=model, **body)
    except anthropic.APIError as e:
        assert cause in ("provider_5xx", "rate_limited", "bad_response", "connection_error",
                         "context_length_exceeded"), cause
        if cause == "context_length_exceeded":
            assert isinstance(e, anthropic.BadRequestError) and "prompt is too long" in str(e)
    assert _failures(proxy, model, cause, before) == before + 1
