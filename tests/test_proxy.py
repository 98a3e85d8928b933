"""The proxy core through the official openai SDK, against a real simulator (issue 2)."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
import urllib.request

import aiohttp
import openai
import pytest

from tests.fixtures.servers import SIM_MODEL, canned_upstream, metric_value, proxy_config, scrape, sim_config

TOKEN = "admin-secret-for-tests"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}}}


def failing_model(**failures) -> dict:
    m = copy.deepcopy(SIM_MODEL)
    m["failures"] = failures
    return m


@pytest.fixture
def stack(servers):
    sim = servers.simulator()
    cfg = proxy_config(sim.url)
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)
    return sim, proxy, client


def admin(proxy, method: str, path: str, token: str | None = TOKEN) -> tuple[int, dict]:
    req = urllib.request.Request(proxy.url + path, method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_raw(proxy, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_plain_stream_tools_and_json(stack):
    _, proxy, client = stack
    raw = client.chat.completions.with_raw_response.create(
        model="support-bot", messages=[{"role": "user", "content": "What is my balance?"}])
    assert raw.headers["x-modelcanary-route"] == "support-bot"
    assert raw.headers["x-modelcanary-model"] == "stable-m"
    assert raw.headers["x-modelcanary-role"] == "stable"
    assert len(raw.headers["x-request-id"]) >= 16
    reply = raw.parse()
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0

    chunks = list(client.chat.completions.create(
        model="support-bot", messages=[{"role": "user", "content": "Tell me a story"}], stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert not chunks[-1].choices

    tool_reply = client.chat.completions.create(
        model="support-bot", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice="required")
    call = tool_reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)

    streamed_tool = list(client.chat.completions.create(
        model="support-bot", messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL], tool_choice="required", stream=True))
    args = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in streamed_tool
                   if c.choices and c.choices[0].delta.tool_calls)
    assert "city" in json.loads(args)

    json_reply = client.chat.completions.create(
        model="support-bot", messages=[{"role": "user", "content": "Give me JSON"}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(json_reply.choices[0].message.content), dict)

    schema = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["answer", "n"], "additionalProperties": False}
    schema_reply = client.chat.completions.create(
        model="support-bot", messages=[{"role": "user", "content": "Structured please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    data = json.loads(schema_reply.choices[0].message.content)
    assert set(data) == {"answer", "n"}

    models = client.models.list()
    assert [m.id for m in models.data] == ["support-bot"]

    text = scrape(proxy.url)
    for segment in ("chat", "tools", "json"):
        assert metric_value(text, "modelcanary_requests_total", route="support-bot", segment=segment,
                            outcome="completed") >= 1, segment
    assert metric_value(text, "modelcanary_tokens_total", route="support-bot", type="output") > 0
    assert metric_value(text, "modelcanary_cost_usd_total", route="support-bot") > 0
    assert metric_value(text, "modelcanary_time_to_first_token_seconds_count", route="support-bot") >= 2


def test_client_errors_are_openai_shaped(stack):
    _, proxy, client = stack
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-route", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    assert "no-such-route" in e.value.message

    status, body = post_raw(proxy, b'{"model": "support-bot", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post_raw(proxy, b'{"model": "support-bot", "messages": "hi"}')
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = post_raw(proxy, b'{"model": "support-bot", "messages": [], "stream": "yes"}')
    assert status == 400 and body["error"]["param"] == "stream"
    status, body = post_raw(proxy, b'[1, 2]')
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = post_raw(proxy, b'{"model": "support-bot", "messages": [{"role": "user", "content": "\xff\xfe"}]}')
    assert status == 400 and "UTF-8" in body["error"]["message"]

    big = b'{"model": "support-bot", "messages": [{"role": "user", "content": "' + b"a" * (11 * 1024 * 1024) + b'"}]}'
    status, body = post_raw(proxy, big)
    assert status == 413 and "max_body_bytes" in body["error"]["message"]
    # the proxy keeps serving after refusing input
    assert client.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": "ok"}])


CAUSE_MODELS = {
    "rate_limited": ({"rate_limited": 1.0}, openai.RateLimitError, "provider"),
    "quota_exceeded": ({"quota_exceeded": 1.0}, openai.RateLimitError, "provider"),
    "provider_5xx": ({"provider_5xx": 1.0}, openai.InternalServerError, "provider"),
    "auth_error": ({"auth_error": 1.0}, openai.AuthenticationError, "client"),
    "bad_response": ({"bad_response": 1.0}, openai.APIStatusError, "provider"),
    "truncated": ({"truncated": 1.0}, None, "model"),
    "content_filtered": ({"content_filtered": 1.0}, None, "model"),
    "refusal": ({"refusal": 1.0}, None, "model"),
    "empty_output": ({"empty_output": 1.0}, None, "model"),
    "invalid_json": ({"invalid_json": 1.0}, None, "model"),
    "invalid_tool_call": ({"invalid_tool_call": 1.0}, None, "model"),
}


def test_every_cause_reaches_metrics_with_its_blame(servers):
    models = {"good-model": copy.deepcopy(SIM_MODEL)}
    models.update({f"m-{cause}": failing_model(**failures) for cause, (failures, _, _) in CAUSE_MODELS.items()})
    tiny = failing_model()
    tiny["context_tokens"] = 50
    models["m-context"] = tiny
    sim = servers.simulator(sim_config(models))
    cfg = proxy_config(sim.url)
    cfg["providers"]["sim"]["max_retries"] = 0
    cfg["models"].update({f"m-{c}": {"provider": "sim", "name": f"m-{c}"} for c in CAUSE_MODELS})
    cfg["models"]["m-context"] = {"provider": "sim", "name": "m-context"}
    cfg["routes"]["schema-route"] = {"stable": "m-truncated", "checks": {"json_schema": {
        "type": "object", "required": ["impossible_field"]}}}
    cfg["models"]["m-plain"] = {"provider": "sim", "name": "good-model"}
    cfg["routes"]["schema-route"]["stable"] = "m-plain"
    proxy = servers.proxy(cfg)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)

    for cause, (_, exc, _) in CAUSE_MODELS.items():
        kwargs: dict = {"model": f"m-{cause}", "messages": [{"role": "user", "content": f"hello {cause}"}]}
        if cause == "invalid_json":
            kwargs["response_format"] = {"type": "json_object"}
        if cause == "invalid_tool_call":
            kwargs["tools"] = [WEATHER_TOOL]
            kwargs["tool_choice"] = "required"
        if exc is None:
            client.chat.completions.create(**kwargs)  # model failures still reach the client as answers
        else:
            with pytest.raises(exc) as e:
                client.chat.completions.create(**kwargs)
            assert isinstance(e.value.body, dict) and "message" in e.value.body, cause

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m-context", messages=[{"role": "user", "content": "x" * 1000}])
    assert e.value.code == "context_length_exceeded"
    client.chat.completions.create(model="schema-route", messages=[{"role": "user", "content": "json"}],
                                   response_format={"type": "json_object"})

    text = scrape(proxy.url)
    for cause, (_, _, blame) in CAUSE_MODELS.items():
        assert metric_value(text, "modelcanary_failures_total", model=f"m-{cause}", cause=cause, blame=blame) == 1, cause
        assert metric_value(text, "modelcanary_requests_total", model=f"m-{cause}", outcome="failed") == 1, cause
    assert metric_value(text, "modelcanary_failures_total", model="m-context", cause="context_length_exceeded",
                        blame="client") == 1
    assert metric_value(text, "modelcanary_failures_total", route="schema-route", cause="schema_violation",
                        blame="model") == 1


def test_timeout_and_connection_error(servers):
    models = {"good-model": copy.deepcopy(SIM_MODEL), "hang": failing_model(timeout=1.0)}
    sim = servers.simulator(sim_config(models))
    cfg = proxy_config(sim.url)
    cfg["providers"]["sim"]["timeout_s"] = 1
    cfg["providers"]["dead"] = {"base_url": "http://127.0.0.1:9/v1", "max_retries": 1, "connect_timeout_s": 1}
    cfg["models"]["hang"] = {"provider": "sim", "name": "hang"}
    cfg["models"]["nowhere"] = {"provider": "dead", "name": "x"}
    proxy = servers.proxy(cfg)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=10)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="hang", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 504 and time.monotonic() - t0 < 2.5
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="nowhere", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 502
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_failures_total", model="hang", cause="timeout", blame="provider") == 1
    assert metric_value(text, "modelcanary_failures_total", model="nowhere", cause="connection_error",
                        blame="provider") == 1
    assert metric_value(text, "modelcanary_upstream_retries_total", model="nowhere", cause="connection_error") == 1


def _within_binomial(k: int, n: int, p: float) -> bool:
    if p in (0.0, 1.0):
        return k == round(n * p)
    sd = math.sqrt(n * p * (1 - p))
    return abs(k - n * p) <= 4.5 * sd


async def _count_canary(url: str, n: int, session_prefix: str | None) -> int:
    sem = asyncio.Semaphore(16)
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> bool:
            headers = {"x-session-id": f"{session_prefix}-{i}"} if session_prefix else {}
            body = {"model": "support-bot", "messages": [{"role": "user", "content": f"hi {session_prefix} {i}"}]}
            async with sem, s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                return r.headers["x-modelcanary-role"] == "canary"
        return sum(await asyncio.gather(*(one(i) for i in range(n))))


def test_weighted_split_and_stickiness(servers):
    sim = servers.simulator()
    cfg = proxy_config(sim.url, rollout={"steps": [10, 50], "min_step_seconds": 3600, "mode": "advisory",
                                         "max_step_seconds": 7200, "min_shadow_samples": 10**9,
                                         "min_samples_per_step": 10**9})
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    n = 1000
    for weight in (0.0, 0.10, 0.50):
        status, state = admin(proxy, "GET", "/admin/rollouts/support-bot")
        assert status == 200 and math.isclose(state["canary_weight"], weight), state
        k = asyncio.run(_count_canary(proxy.url, n, session_prefix=None))
        assert _within_binomial(k, n, weight), (weight, k)
        k_sessions = asyncio.run(_count_canary(proxy.url, n, session_prefix=f"w{weight}"))
        assert _within_binomial(k_sessions, n, weight), (weight, k_sessions)
        if weight == 0.50:
            async def sticky() -> set[str]:
                roles = set()
                async with aiohttp.ClientSession() as s:
                    for _ in range(1000):
                        async with s.post(proxy.url + "/v1/chat/completions", headers={"x-session-id": "one-user"},
                                          json={"model": "support-bot", "messages": [{"role": "user", "content": "a"}]}) as r:
                            await r.read()
                            roles.add(r.headers["x-modelcanary-model"])
                return roles
            assert len(asyncio.run(sticky())) == 1
        status, _ = admin(proxy, "POST", "/admin/rollouts/support-bot/promote")
        assert status == 200
    # promoted after the last step: the candidate serves everything, as the route's model now
    status, state = admin(proxy, "GET", "/admin/rollouts/support-bot")
    assert (state["phase"], state["canary_weight"]) == ("promoted", 1.0), state

    async def served() -> set[tuple[str, str]]:
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> tuple[str, str]:
                async with s.post(proxy.url + "/v1/chat/completions", headers={"x-session-id": f"p{i}"},
                                  json={"model": "support-bot", "messages": [{"role": "user", "content": "a"}]}) as r:
                    await r.read()
                    return r.headers["x-modelcanary-model"], r.headers["x-modelcanary-role"]
            return set(await asyncio.gather(*(one(i) for i in range(200))))
    assert asyncio.run(served()) == {("candidate-m", "stable")}


def test_admin_auth_and_actions(stack):
    _, proxy, _ = stack
    assert admin(proxy, "GET", "/admin/rollouts", token=None)[0] == 401
    assert admin(proxy, "GET", "/admin/rollouts", token="wrong")[0] == 403
    status, body = admin(proxy, "POST", "/admin/rollouts/unknown-route/promote")
    assert status == 404 and "unknown-route" in body["error"]["message"]
    status, state = admin(proxy, "POST", "/admin/rollouts/support-bot/pause")
    assert status == 200 and state["phase"] == "paused"
    assert admin(proxy, "POST", "/admin/rollouts/support-bot/promote")[0] == 409
    status, state = admin(proxy, "POST", "/admin/rollouts/support-bot/resume")
    assert state["phase"] == "shadow"
    status, state = admin(proxy, "POST", "/admin/rollouts/support-bot/promote")
    assert state["phase"] == "canary" and state["step_index"] == 0 and state["canary_weight"] == 0.01
    status, state = admin(proxy, "POST", "/admin/rollouts/support-bot/rollback")
    assert state["phase"] == "rolled_back" and state["canary_weight"] == 0
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_rollout_phase", route="support-bot", phase="rolled_back") == 1
    assert metric_value(text, "modelcanary_rollout_canary_weight_ratio", route="support-bot") == 0
    # what an alert watches with increase() is there from the start, at 0: the first drop or error counts
    for reason in ("queue_full", "error", "stopped"):
        assert f'modelcanary_shadow_dropped_total{{reason="{reason}",route="support-bot"}} 0.0' in text, reason
    assert 'modelcanary_events_dropped_total{reason="queue_full",topic="outcomes"} 0.0' in text
    assert metric_value(text, "modelcanary_failures_total", route="support-bot", cause="proxy_error") == 0
    assert 'cause="proxy_error"' in text
    assert TOKEN not in proxy.output()


def test_a_finished_rollout_is_no_longer_shadowed(servers):
    """Rolled back (or promoted), a route has no candidate left to judge: its calls are not shadowed,
    so they spend no shadow budget on a verdict that is in."""
    sim = servers.simulator()
    cfg = proxy_config(sim.url)
    cfg["routes"]["support-bot"]["shadow"] = {"sample_rate": 1.0}
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)

    def ask(n: int) -> tuple[float, float]:
        """(requests recorded, traffic events published) once n more calls are recorded"""
        before = metric_value(scrape(proxy.url), "modelcanary_requests_total", route="support-bot")
        for i in range(n):
            client.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": f"hi {i}"}])
        deadline = time.monotonic() + 5
        while True:
            text = scrape(proxy.url)
            done = metric_value(text, "modelcanary_requests_total", route="support-bot")
            if done >= before + n or time.monotonic() > deadline:
                return done, metric_value(text, "modelcanary_events_published_total", topic="traffic")

    _, shadowed = ask(3)
    assert shadowed == 3  # in shadow: every call sampled
    assert admin(proxy, "POST", "/admin/rollouts/support-bot/rollback")[1]["phase"] == "rolled_back"
    assert ask(5)[1] == shadowed


def test_admin_refuses_everything_without_configured_token(servers):
    sim = servers.simulator()
    proxy = servers.proxy(proxy_config(sim.url), env={"MODELCANARY_ADMIN_TOKEN": ""})
    assert admin(proxy, "GET", "/admin/rollouts", token="anything")[0] == 403


def test_upstream_retries_and_budget(servers):
    models = {"good-model": copy.deepcopy(SIM_MODEL), "flaky": failing_model(rate_limited=0.5),
              "down": failing_model(provider_5xx=1.0)}
    sim = servers.simulator(sim_config(models))
    cfg = proxy_config(sim.url)
    cfg["providers"]["sim"]["max_retries"] = 3
    cfg["models"]["flaky"] = {"provider": "sim", "name": "flaky"}
    cfg["models"]["down"] = {"provider": "sim", "name": "down"}
    proxy = servers.proxy(cfg)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    for i in range(20):
        try:
            client.chat.completions.create(model="flaky", messages=[{"role": "user", "content": f"q{i}"}])
        except openai.RateLimitError:
            pass  # all attempts were 429s, or the budget ran out
    text = scrape(proxy.url)
    retried = metric_value(text, "modelcanary_upstream_retries_total", model="flaky", cause="rate_limited")
    assert retried >= 3  # half the first attempts are 429s, and the answers still arrive
    assert metric_value(text, "modelcanary_requests_total", model="flaky", outcome="completed") >= 15

    n = 200
    for i in range(n):
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="down", messages=[{"role": "user", "content": f"d{i}"}])
    text = scrape(proxy.url)
    retries = metric_value(text, "modelcanary_upstream_retries_total", model="down")
    assert retries <= 0.2 * n + 3 * 3, retries  # 20% of requests plus the reserve per window
    assert retries >= 3


def test_stream_never_retried_after_first_byte(servers):
    models = {"good-model": copy.deepcopy(SIM_MODEL), "breaks": failing_model(bad_response=1.0)}
    sim = servers.simulator(sim_config(models))
    cfg = proxy_config(sim.url)
    cfg["models"]["breaks"] = {"provider": "sim", "name": "breaks"}
    proxy = servers.proxy(cfg)

    async def read_stream() -> bytes:
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json={
                "model": "breaks", "stream": True, "messages": [{"role": "user", "content": "go"}]}) as r:
            assert r.status == 200
            return await r.read()

    body = asyncio.run(read_stream())
    assert b'"error"' in body  # the stream ends with an SSE error event
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_upstream_retries_total", model="breaks") == 0
    assert metric_value(text, "modelcanary_requests_total", model="breaks", outcome="failed") == 1


def test_client_disconnect_mid_stream_is_client_cancelled(servers):
    slow = copy.deepcopy(SIM_MODEL)
    slow.update({"latency_s": {"median": 3.0, "p95": 3.5}, "ttft_s": {"median": 0.05, "p95": 0.1},
                 "output_tokens": {"median": 200, "p95": 300}})
    sim = servers.simulator(sim_config({"good-model": slow, "new-model": slow}, time_scale=1.0))
    proxy = servers.proxy(proxy_config(sim.url))

    async def hang_up() -> None:
        async with aiohttp.ClientSession() as s:
            r = await s.post(proxy.url + "/v1/chat/completions", json={
                "model": "support-bot", "stream": True, "messages": [{"role": "user", "content": "long story"}]})
            await r.content.readany()
            r.close()

    asyncio.run(hang_up())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        text = scrape(proxy.url)
        if metric_value(text, "modelcanary_failures_total", cause="client_cancelled", blame="client") == 1:
            break
        time.sleep(0.1)
    assert metric_value(text, "modelcanary_failures_total", cause="client_cancelled", blame="client") == 1
    assert "Traceback" not in proxy.output() and "ERROR" not in proxy.output()


def test_feedback_and_passthrough(stack):
    _, proxy, client = stack
    raw = client.chat.completions.with_raw_response.create(
        model="support-bot", messages=[{"role": "user", "content": "book it"}], extra_headers={"x-session-id": "s1"})
    rid = raw.headers["x-request-id"]
    req = urllib.request.Request(proxy.url + "/v1/feedback", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"request_id": rid, "success": False, "reason": "wrong date"}).encode())
    with urllib.request.urlopen(req) as r:
        assert r.status == 202
    req = urllib.request.Request(proxy.url + "/v1/feedback", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"session_id": "s1", "success": True}).encode())
    with urllib.request.urlopen(req) as r:
        assert r.status == 202
    req = urllib.request.Request(proxy.url + "/v1/feedback", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"request_id": "nope", "success": "yes"}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "success"
    for method in ("GET", "PUT"):  # the proxy's own endpoint: never taken for an upstream's
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(proxy.url + "/v1/feedback", method=method, data=b"{}"))
        assert e.value.code == 405 and e.value.headers["allow"] == "POST", method
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_feedback_total", route="support-bot", outcome="failure") == 1
    assert metric_value(text, "modelcanary_feedback_total", route="support-bot", outcome="success") == 1

    def timed() -> tuple[float, float]:
        text = scrape(proxy.url)
        return (metric_value(text, "modelcanary_request_duration_seconds_count", route="support-bot"),
                metric_value(text, "modelcanary_time_to_first_token_seconds_count", route="support-bot"))

    before = timed()
    emb = client.embeddings.create(model="support-bot", input="hello")
    assert len(emb.data[0].embedding) > 0
    legacy = client.completions.create(model="support-bot", prompt="Say hi")
    assert legacy.choices[0].text
    streamed = list(client.completions.create(model="support-bot", prompt="Say hi slowly", stream=True))
    assert len(streamed) > 2 and "".join(c.choices[0].text for c in streamed if c.choices)
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_requests_total", route="support-bot", segment="other",
                        outcome="completed") == 3
    # counted, but their durations would make the stable model look faster (or slower) than it is
    assert timed() == before


@pytest.mark.parametrize("target", [
    "/v1/files/file-abc%20HTTP/1.1%0DX-Injected:%20yes/content",  # would split the request line if decoded
    "/v1/files/caf%C3%A9%E2%82%AC/content",                        # not ASCII once decoded
    "/v1/files/a%3Fb%2Fc/content",                                 # ? and / would change the path
])
def test_a_passed_through_path_goes_upstream_as_the_client_encoded_it(servers, target):
    with canned_upstream(b'{"object": "list", "data": []}') as (url, seen):
        proxy = servers.proxy(proxy_config(url))
        with urllib.request.urlopen(proxy.url + target + "?limit=2") as r:
            assert r.status == 200
    assert [s[":path"] for s in seen] == [target + "?limit=2"]


def test_feedback_sent_the_moment_an_answer_is_in_finds_its_call(stack):
    """The recorder takes finished calls a turn of the loop later, in batches: still before the loop
    reads what a client sends next, so feedback right after the answer, on the same connection, under
    concurrent load, always finds the call, and the metrics count every answer."""
    _, proxy, _ = stack
    body = {"model": "support-bot", "messages": [{"role": "user", "content": "hello"}]}

    async def one_client(session: aiohttp.ClientSession) -> list[tuple[int, str | None]]:
        seen = []
        for _ in range(25):
            async with session.post(proxy.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()
                rid = r.headers["x-request-id"]
            async with session.post(proxy.url + "/v1/feedback", json={"request_id": rid, "success": True}) as r:
                seen.append((r.status, (await r.json()).get("status")))
        return seen

    async def run() -> list[list[tuple[int, str | None]]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as session:
            return await asyncio.gather(*(one_client(session) for _ in range(16)))

    results = asyncio.run(run())
    assert [s for seen in results for s in seen] == [(202, "recorded")] * 400
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_requests_total", route="support-bot", outcome="completed") == 400
    assert metric_value(text, "modelcanary_feedback_total", route="support-bot", outcome="success") == 400


def test_client_retry_detection(stack):
    _, proxy, client = stack
    body = {"model": "support-bot", "messages": [{"role": "user", "content": "same question"}]}
    status, _ = post_raw(proxy, json.dumps(body).encode())
    status, _ = post_raw(proxy, json.dumps(body).encode())  # the same request again: a retry
    status, _ = post_raw(proxy, json.dumps({**body, "messages": [{"role": "user", "content": "other"}]}).encode(),
                         headers={"x-stainless-retry-count": "1"})
    assert status == 200
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_client_retries_total", route="support-bot") == 2


def test_without_a_session_a_conversation_and_its_retries_stay_on_one_arm(servers):
    """Without a session, a request is placed in the split by its conversation's start: a client's
    retry is answered, and counted as a retry, by the arm the client did not accept (at a 1% step, a
    canary's retries landing on stable would hide the canary's retry rate), and an agent's run does
    not change models from turn to turn."""
    sim = servers.simulator()
    cfg = proxy_config(sim.url, rollout={"steps": [50], "mode": "advisory", "min_step_seconds": 3600,
                                         "max_step_seconds": 7200, "min_shadow_samples": 10**9,
                                         "min_samples_per_step": 10**9})
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    assert admin(proxy, "POST", "/admin/rollouts/support-bot/promote")[0] == 200  # shadow → 50%

    async def ask(question: str, retry: bool) -> str:
        headers = {"x-stainless-retry-count": "1"} if retry else {}
        body = {"model": "support-bot", "messages": [{"role": "user", "content": question}]}
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", json=body,
                                                        headers=headers) as r:
            await r.read()
            return r.headers["x-modelcanary-role"]

    async def both(i: int) -> tuple[str, str]:
        return await ask(f"question {i}", False), await ask(f"question {i}", True)

    async def run() -> list[tuple[str, str]]:
        return list(await asyncio.gather(*(both(i) for i in range(40))))
    pairs = asyncio.run(run())
    assert all(first == again for first, again in pairs), pairs
    firsts = [first for first, _ in pairs]
    assert 0 < firsts.count("canary") < 40  # both arms answered first requests: the split still splits
    text = scrape(proxy.url)
    for role in ("stable", "canary"):
        assert metric_value(text, "modelcanary_client_retries_total", route="support-bot", role=role) == \
            firsts.count(role), role

    async def conversation(i: int) -> set[str]:  # an agent's run: each turn repeats the ones before
        messages: list[dict] = [{"role": "system", "content": "You are the order desk."},
                                {"role": "user", "content": f"Where is order {i}?"}]
        roles = set()
        async with aiohttp.ClientSession() as s:
            for turn in range(3):
                async with s.post(proxy.url + "/v1/chat/completions",
                                  json={"model": "support-bot", "messages": messages}) as r:
                    answer = await r.json()
                    roles.add(r.headers["x-modelcanary-role"])
                messages = [*messages, answer["choices"][0]["message"], {"role": "user", "content": f"and {turn}?"}]
        return roles

    async def conversations() -> list[set[str]]:
        return list(await asyncio.gather(*(conversation(i) for i in range(30))))
    runs = asyncio.run(conversations())
    assert all(len(roles) == 1 for roles in runs), runs  # every turn of a run on one arm
    assert {next(iter(roles)) for roles in runs} == {"stable", "canary"}


def test_upstream_key_from_env_and_client_key_passthrough(servers):
    sim = servers.simulator(sim_config(api_key="sim-secret-key"))
    cfg = proxy_config(sim.url)
    proxy_with_key = servers.proxy({**cfg, "providers": {"sim": {**cfg["providers"]["sim"], "api_key_env": "SIM_KEY"}}},
                                   name="p1", env={"SIM_KEY": "sim-secret-key"})
    ok = openai.OpenAI(base_url=proxy_with_key.url + "/v1", api_key="whatever", max_retries=0)
    assert ok.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": "x"}])
    passthrough = servers.proxy(cfg, name="p2")
    good = openai.OpenAI(base_url=passthrough.url + "/v1", api_key="sim-secret-key", max_retries=0)
    assert good.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=passthrough.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": "x"}])
    assert metric_value(scrape(passthrough.url), "modelcanary_failures_total", cause="auth_error", blame="client") == 1
    assert "sim-secret-key" not in proxy_with_key.output() + passthrough.output()


def test_a_refused_operator_key_is_the_proxys_failure_not_the_clients(servers):
    """The provider refuses the key the proxy holds: the client's key never went upstream, so the client
    is not told its key is wrong (a 401 makes SDKs say so) but gets a 502 naming the provider's key, and
    the failure is blamed on the proxy's configuration, on every API."""
    sim = servers.simulator(sim_config(api_key="sim-secret-key"))
    cfg = proxy_config(sim.url)
    cfg["providers"]["sim"]["api_key_env"] = "SIM_KEY"
    proxy = servers.proxy(cfg, env={"SIM_KEY": "sk-expired"})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)
    for create in (lambda: client.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": "x"}]),
                   lambda: client.chat.completions.create(model="support-bot", stream=True,
                                                          messages=[{"role": "user", "content": "x"}]),
                   lambda: client.responses.create(model="support-bot", input="x")):
        with pytest.raises(openai.InternalServerError) as e:
            create()
        assert e.value.status_code == 502 and "providers.sim.api_key_env" in e.value.message, e.value.message
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_failures_total", cause="auth_error", blame="proxy") == 3
    assert metric_value(text, "modelcanary_failures_total", cause="auth_error", blame="client") == 0
    assert "sk-expired" not in proxy.output()


def test_a_client_that_leaves_while_the_upstream_works_is_client_cancelled_when_it_left(servers):
    """The proxy stops waiting once the client hangs up: the call ends `client_cancelled` (not the
    provider's timeout that would have come later), its duration is the client's, and it is no longer
    in flight. On each route in: the chat route below ASGI, chat through ASGI (a chunked body), the
    Responses API."""
    slow = copy.deepcopy(SIM_MODEL)
    slow["latency_s"] = {"median": 4.0, "p95": 4.5}
    sim = servers.simulator(sim_config({"good-model": slow, "new-model": slow}, time_scale=1.0))
    cfg = proxy_config(sim.url)
    cfg["providers"]["sim"]["timeout_s"] = 2  # the provider would time out at 2 s; the clients leave at 0.5 s
    proxy = servers.proxy(cfg)
    chat = json.dumps({"model": "support-bot", "messages": [{"role": "user", "content": "hi"}]}).encode()
    responses = json.dumps({"model": "support-bot", "input": "hi"}).encode()
    head = b"Host: x\r\nContent-Type: application/json\r\n"
    requests = [
        b"POST /v1/chat/completions HTTP/1.1\r\n" + head + b"Content-Length: %d\r\n\r\n%s" % (len(chat), chat),
        b"POST /v1/chat/completions HTTP/1.1\r\n" + head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (len(chat), chat),
        b"POST /v1/responses HTTP/1.1\r\n" + head + b"Content-Length: %d\r\n\r\n%s" % (len(responses), responses),
    ]

    async def leave_after(raw: bytes, wait_s: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(raw)
        await asyncio.sleep(wait_s)
        assert not reader.at_eof() and not reader._buffer  # no answer yet  # noqa: SLF001
        writer.close()

    async def all_leave() -> None:
        await asyncio.gather(*(leave_after(raw, 0.5) for raw in requests))

    left = time.monotonic()
    asyncio.run(all_leave())
    text = ""
    while time.monotonic() - left < 1.8:  # before the provider's timeout, let alone the answer
        text = scrape(proxy.url)
        if metric_value(text, "modelcanary_failures_total", cause="client_cancelled", blame="client") == 3:
            break
        time.sleep(0.05)
    assert metric_value(text, "modelcanary_failures_total", cause="client_cancelled", blame="client") == 3, text
    assert metric_value(text, "modelcanary_failures_total", cause="timeout") == 0
    assert metric_value(text, "modelcanary_in_flight_requests") == 0
    assert metric_value(text, "modelcanary_request_duration_seconds_sum") < 3 * 1.2  # each ~0.5 s, as the client saw
    assert "Traceback" not in proxy.output() and "ERROR" not in proxy.output()


def test_the_alerted_series_exist_from_0_so_a_first_increase_is_seen(stack):
    """increase() misses a series' first sample: the rules' alerts (proxy errors on either role,
    shadow drops, decisions) read series that exist at 0 from the start."""
    from prometheus_client.parser import text_string_to_metric_families

    _, proxy, _ = stack
    series = {(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(scrape(proxy.url))
              for s in f.samples}
    for model, role in (("stable-m", "stable"), ("candidate-m", "canary")):
        assert ("modelcanary_failures_total", (("blame", "proxy"), ("cause", "proxy_error"), ("model", model),
                                               ("role", role), ("route", "support-bot"))) in series, role
    for reason in ("queue_full", "error", "stopped"):
        assert ("modelcanary_shadow_dropped_total", (("reason", reason), ("route", "support-bot"))) in series


def test_no_shadow_header_fails_closed(servers):
    """`x-modelcanary-no-shadow` is a privacy control: any value but an explicit no keeps the request
    from being replayed to another model (seen in what is sampled: memory mode's /admin/traffic)."""
    sim = servers.simulator()
    proxy = servers.proxy(proxy_config(sim.url, shadow={"sample_rate": 1.0}),
                          env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)
    for value in ("1", "true", "YES", "on", "please", "0", "false", None):
        headers = {} if value is None else {"x-modelcanary-no-shadow": value}
        client.chat.completions.create(model="support-bot", extra_headers=headers,
                                       messages=[{"role": "user", "content": f"value {value!r}"}])
    client.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": "marker"}])

    def sampled() -> list[str]:
        req = urllib.request.Request(proxy.url + "/admin/traffic", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            lines = [json.loads(line) for line in r.read().splitlines() if line.strip()]
        return [m["content"] for e in lines if "request" in e for m in e["request"]["messages"]]

    deadline = time.monotonic() + 30
    while "marker" not in (seen := sampled()):  # published in order: all before it are in
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)
    assert sorted(seen) == sorted(["value '0'", "value 'false'", "value None", "marker"]), seen
