"""The Responses API and Anthropic Messages through the proxy, with the real clients teams use
(openai `responses`, the OpenAI Agents SDK, LangChain's ChatOpenAI on the Responses API, the
anthropic SDK) against `modelcanary serve` + `modelcanary simulate`. Each test checks the role
headers, the recorded outcome and segment, and that the request was shadowed to the candidate.

Every test has a route of its own, so the per-route metrics it reads are its own requests only."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import anthropic
import openai
import pytest

from tests.fixtures.servers import (
    canned_upstream,
    metric_value,
    proxy_config,
    scrape,
    shadowed_route,
    sim_config,
    start_proxy,
    start_simulator,
)

TOKEN = "formats-admin-token"
ENV = {"MODELCANARY_ADMIN_TOKEN": TOKEN, "OPENAI_AGENTS_DISABLE_TRACING": "1"}
ROUTES_OPENAI = ("resp-plain", "resp-stream", "resp-tools", "resp-split", "resp-stateful", "resp-container", "agents",
                 "langchain", "resp-chain")
ROUTES_ANTHROPIC = ("claude-plain", "claude-stream", "claude-cache", "claude-container")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
                    "parameters": WEATHER}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("formats")
    sim = start_simulator(tmp, sim_config())
    cfg = proxy_config(sim.url)
    cfg["providers"]["claude"] = {"base_url": sim.url + "/v1", "api": "anthropic", "timeout_s": 5, "max_retries": 1}
    cfg["models"]["stable-a"] = {"provider": "claude", "name": "good-model",
                                 "price": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}}
    cfg["models"]["candidate-a"] = {"provider": "claude", "name": "new-model"}
    cfg["routes"] = {**{r: shadowed_route("stable-m", "candidate-m") for r in ROUTES_OPENAI},
                     **{r: shadowed_route("stable-a", "candidate-a") for r in ROUTES_ANTHROPIC}}
    proxy = start_proxy(tmp, cfg, env=ENV)
    yield sim, proxy
    proxy.stop()
    sim.stop()


def _metric(proxy, name: str, **labels) -> float:
    return metric_value(scrape(proxy.url), name, **labels)


def _wait_for(pred, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    value = pred()
    while not value and time.monotonic() < deadline:
        time.sleep(0.05)
        value = pred()
    return value


def _assert_recorded(proxy, route: str, segment: str, n: int, candidate: str = "candidate-m") -> None:
    """n completed requests of `segment` on the route, and each shadowed to the candidate."""
    assert _wait_for(lambda: _metric(proxy, "modelcanary_requests_total", route=route, segment=segment,
                                     outcome="completed") >= n)
    assert _metric(proxy, "modelcanary_requests_total", route=route, segment=segment, outcome="completed") == n
    assert _metric(proxy, "modelcanary_requests_total", route=route, outcome="failed") == 0
    assert _wait_for(lambda: _metric(proxy, "modelcanary_shadow_requests_total", route=route, model=candidate) >= n), \
        f"no shadow record for route {route}"


def _assert_roles(headers, route: str, model: str = "stable-m", role: str = "stable") -> None:
    assert headers["x-modelcanary-route"] == route
    assert headers["x-modelcanary-model"] == model
    assert headers["x-modelcanary-role"] == role
    assert len(headers["x-request-id"]) >= 16


def _openai(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)


def _admin_promote(proxy, route: str) -> None:
    req = urllib.request.Request(f"{proxy.url}/admin/rollouts/{route}/promote", method="POST", data=b"",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


# ---- openai SDK: responses.create ----------------------------------------------------------------


def test_responses_create_plain_json_and_usage(stack):
    _, proxy = stack
    client = _openai(proxy)
    raw = client.responses.with_raw_response.create(model="resp-plain", input="What is my balance?")
    _assert_roles(raw.headers, "resp-plain")
    reply = raw.parse()
    assert reply.status == "completed" and reply.output_text
    schema = {"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"],
              "additionalProperties": False}
    parsed = client.responses.create(model="resp-plain", input="Sum my invoices",
                                     text={"format": {"type": "json_schema", "name": "sum", "schema": schema}})
    assert isinstance(parsed.output_text, str) and '"total"' in parsed.output_text
    _assert_recorded(proxy, "resp-plain", "chat", 1)
    _assert_recorded(proxy, "resp-plain", "json", 1)
    tokens = _metric(proxy, "modelcanary_tokens_total", route="resp-plain", role="stable", type="output")
    assert tokens == reply.usage.output_tokens + parsed.usage.output_tokens
    assert _metric(proxy, "modelcanary_cost_usd_total", route="resp-plain", role="stable") > 0


def test_responses_stream_relays_typed_events_and_times_the_first_token(stack):
    _, proxy = stack
    client = _openai(proxy)
    raw = client.responses.with_raw_response.create(model="resp-stream", input="Tell me a story", stream=True)
    _assert_roles(raw.headers, "resp-stream")
    events = list(raw.parse())
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output_text == text
    with client.responses.stream(model="resp-stream", input="Weather in Oslo?", tools=RESPONSES_TOOLS) as stream:
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and final.output[0].name == "get_weather"
    _assert_recorded(proxy, "resp-stream", "chat", 1)
    _assert_recorded(proxy, "resp-stream", "tools", 1)
    assert _metric(proxy, "modelcanary_time_to_first_token_seconds_count", route="resp-stream") == 2


def test_responses_function_tools_round_trip(stack):
    _, proxy = stack
    client = _openai(proxy)
    raw = client.responses.with_raw_response.create(model="resp-tools", input="Weather in Paris?",
                                                    tools=RESPONSES_TOOLS)
    _assert_roles(raw.headers, "resp-tools")
    first = raw.parse()
    call = first.output[0]
    assert call.type == "function_call" and '"city"' in call.arguments
    followup = client.responses.create(model="resp-tools", tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert followup.output_text
    _assert_recorded(proxy, "resp-tools", "tools", 2)


def test_previous_response_id_follows_the_model_across_a_canary_split(stack):
    _, proxy = stack
    client = _openai(proxy)
    _admin_promote(proxy, "resp-split")  # 50 % of live traffic to the candidate
    served: list[tuple[str, str]] = []
    for i in range(24):
        raw = client.responses.with_raw_response.create(model="resp-split", input=f"question {i}")
        served.append((raw.parse().id, raw.headers["x-modelcanary-model"]))
    assert {m for _, m in served} == {"stable-m", "candidate-m"}
    for response_id, model in served:
        # the simulator answers 400 previous_response_not_found if the follow-up reaches the other model
        raw = client.responses.with_raw_response.create(model="resp-split", previous_response_id=response_id,
                                                        input="and then?")
        _assert_roles(raw.headers, "resp-split", model, "stable" if model == "stable-m" else "canary")
        assert raw.parse().previous_response_id == response_id
    with pytest.raises(openai.ConflictError) as unknown:
        client.responses.create(model="resp-split", previous_response_id="resp_never_seen", input="hm")
    assert unknown.value.status_code == 409 and "previous_response_id" in unknown.value.message
    assert unknown.value.body["param"] == "previous_response_id"


def test_a_follow_up_falls_in_its_conversations_segment(stack):
    """A Responses follow-up sends only its new turn; the model reads the whole conversation. The
    third user turn of a chain is multi_turn, and every turn after a long first one is long_context."""
    _, proxy = stack
    client = _openai(proxy)
    for first in ("Where is my order?", "Here is our whole contract. " * 1300):  # ~9k tokens
        previous = None
        for turn in range(4):
            raw = client.responses.with_raw_response.create(
                model="resp-chain", input=first if previous is None else f"and then {turn}?",
                previous_response_id=previous)
            previous = raw.parse().id
    counts = {seg: _metric(proxy, "modelcanary_requests_total", route="resp-chain", segment=seg, outcome="completed")
              for seg in ("chat", "multi_turn", "long_context")}
    assert counts == {"chat": 2, "multi_turn": 2, "long_context": 4}, counts


def test_a_request_on_upstream_state_is_never_shadowed(stack):
    _, proxy = stack
    client = _openai(proxy)
    first = client.responses.create(model="resp-stateful", input="remember 42")
    assert _wait_for(lambda: _metric(proxy, "modelcanary_shadow_requests_total", route="resp-stateful",
                                     model="candidate-m") >= 1)
    shadowed = _metric(proxy, "modelcanary_shadow_requests_total", route="resp-stateful", model="candidate-m")
    raw = client.responses.with_raw_response.create(model="resp-stateful", previous_response_id=first.id,
                                                    input="what number?")
    _assert_roles(raw.headers, "resp-stateful")
    assert _wait_for(lambda: _metric(proxy, "modelcanary_shadow_dropped_total", route="resp-stateful",
                                     reason="stateful") == 1)
    # a later plain request is shadowed; the stateful one never was
    client.responses.create(model="resp-stateful", input="a fresh question")
    assert _wait_for(lambda: _metric(proxy, "modelcanary_shadow_requests_total", route="resp-stateful",
                                     model="candidate-m") >= shadowed + 1)
    assert _metric(proxy, "modelcanary_shadow_requests_total", route="resp-stateful", model="candidate-m") == \
        shadowed + 1
    assert _metric(proxy, "modelcanary_requests_total", route="resp-stateful", outcome="completed") == 3


@pytest.fixture(scope="module")
def two_upstreams(tmp_path_factory):
    """Stable and candidate on simulators of their own, so a stored response exists on one only: a
    call that reaches the other upstream is answered 404 (fetch, delete) or 400 (follow-up)."""
    tmp = tmp_path_factory.mktemp("owners")
    sims = [start_simulator(tmp, sim_config(), name) for name in ("sim-a", "sim-b")]
    cfg = proxy_config(sims[0].url)
    cfg["providers"]["sim-b"] = {**cfg["providers"]["sim"], "base_url": sims[1].url + "/v1"}
    cfg["models"]["candidate-m"]["provider"] = "sim-b"
    cfg["models"]["other-m"] = {"provider": "sim", "name": "far-model"}
    cfg["routes"] = {"split": shadowed_route("stable-m", "candidate-m"),
                     "split-too": shadowed_route("stable-m", "other-m"),
                     "solo": {"stable": "stable-m"}}
    proxy = start_proxy(tmp, cfg, env=ENV)
    _admin_promote(proxy, "split")  # 50 % of live traffic to the candidate
    client = _openai(proxy)
    served: dict[str, str] = {}
    while list(served.values()).count("candidate-m") < 2 or "stable-m" not in served.values():
        raw = client.responses.with_raw_response.create(model="split", input=f"question {len(served)}")
        served[raw.parse().id] = raw.headers["x-modelcanary-model"]
    yield proxy, served
    proxy.stop()
    for sim in sims:
        sim.stop()


def test_a_stored_response_is_fetched_and_deleted_at_the_model_that_stored_it(two_upstreams):
    proxy, served = two_upstreams
    client = _openai(proxy)
    for response_id, model in served.items():
        # no `model` to name a route: the owner's route is known, as is its model
        raw = client.responses.with_raw_response.retrieve(response_id)
        assert raw.parse().id == response_id
        _assert_roles(raw.headers, "split", model, "stable" if model == "stable-m" else "canary")
    response_id, model = next((r, m) for r, m in served.items() if m == "candidate-m")
    raw = client.responses.with_raw_response.delete(response_id)
    assert raw.http_response.status_code == 200 and raw.headers["x-modelcanary-model"] == "candidate-m"
    with pytest.raises(openai.NotFoundError):  # deleted where it was stored
        client.responses.retrieve(response_id)
    assert _wait_for(lambda: _metric(proxy, "modelcanary_requests_total", route="split", model="candidate-m",
                                     role="canary", segment="other", outcome="completed")
                     == list(served.values()).count("candidate-m") + 1)  # the fetches and the delete


def test_a_response_id_does_not_take_a_request_off_its_route(two_upstreams):
    """A follow-up on another route goes where that route sends it: its one model (which does not
    hold the id, so the upstream's 400), or the 409 when the route has several."""
    proxy, served = two_upstreams
    client = _openai(proxy)
    response_id = next(r for r, m in reversed(served.items()) if m == "candidate-m")  # not the one deleted above
    with pytest.raises(openai.BadRequestError) as other:
        client.responses.with_raw_response.create(model="solo", previous_response_id=response_id, input="and?")
    assert other.value.response.headers["x-modelcanary-model"] == "stable-m"
    assert other.value.code == "previous_response_not_found"
    with pytest.raises(openai.ConflictError) as conflict:
        client.responses.create(model="split-too", previous_response_id=response_id, input="and?")
    assert "was answered on route 'split', not 'split-too'" in conflict.value.message
    assert conflict.value.body["param"] == "previous_response_id"
    assert _metric(proxy, "modelcanary_requests_total", route="solo", model="candidate-m") == 0


def test_a_request_that_runs_in_the_clients_container_is_never_shadowed(stack):
    """A shadow call would run code in the client's own container (Responses `tools[].container`,
    Messages `container`): served as usual, never shadowed."""
    _, proxy = stack
    before = _metric(proxy, "modelcanary_shadow_dropped_total", route="resp-container", reason="stateful")
    tools = [{"type": "code_interpreter", "container": "cntr_client_own"}, *RESPONSES_TOOLS]
    raw = _openai(proxy).responses.with_raw_response.create(model="resp-container", input="run it", tools=tools)
    assert raw.http_response.status_code == 200
    assert _wait_for(lambda: _metric(proxy, "modelcanary_shadow_dropped_total", route="resp-container",
                                     reason="stateful") == before + 1)
    before = _metric(proxy, "modelcanary_shadow_dropped_total", route="claude-container", reason="stateful")
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-client", max_retries=0)
    client.messages.create(model="claude-container", max_tokens=50, messages=[{"role": "user", "content": "run it"}],
                           extra_body={"container": "container_client_own"})
    assert _wait_for(lambda: _metric(proxy, "modelcanary_shadow_dropped_total", route="claude-container",
                                     reason="stateful") == before + 1)


# ---- OpenAI Agents SDK (its default model is the Responses API) ------------------------------------


def test_agents_sdk_runs_a_tool_using_agent(stack):
    from agents import Agent, Runner, function_tool, set_default_openai_client

    _, proxy = stack
    seen: list[dict] = []

    async def keep_headers(response) -> None:
        seen.append({"path": response.request.url.path, **response.headers})

    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    async def run() -> str:
        http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [keep_headers]})
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, http_client=http)
        set_default_openai_client(client, use_for_tracing=False)  # the SDK's default model: the Responses API
        agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model="agents")
        result = await Runner.run(agent, "What's the weather in Lisbon?")
        await client.close()
        return result.final_output

    final = asyncio.run(run())
    assert final and called, (final, called)
    assert [h["path"] for h in seen] == ["/v1/responses", "/v1/responses"]
    for headers in seen:
        _assert_roles(headers, "agents")
    _assert_recorded(proxy, "agents", "tools", 2)


# ---- LangChain ChatOpenAI(use_responses_api=True) --------------------------------------------------


def test_langchain_chat_openai_on_the_responses_api(stack):
    from langchain_openai import ChatOpenAI

    _, proxy = stack
    llm = ChatOpenAI(model="langchain", base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0,
                     use_responses_api=True, include_response_headers=True)
    reply = llm.invoke("Hello there")
    assert reply.text and reply.response_metadata["headers"]["x-modelcanary-role"] == "stable"
    _assert_roles(reply.response_metadata["headers"], "langchain")
    streamed = "".join(chunk.text for chunk in llm.stream("Tell me more"))
    assert streamed
    tooled = llm.bind_tools([{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                               "parameters": WEATHER}}]).invoke("Weather in Rome?")
    assert tooled.tool_calls and tooled.tool_calls[0]["name"] == "get_weather"
    _assert_recorded(proxy, "langchain", "chat", 2)
    _assert_recorded(proxy, "langchain", "tools", 1)


# ---- anthropic SDK -------------------------------------------------------------------------------


def _anthropic(proxy) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=0, timeout=10)


def test_anthropic_messages_create_and_tools(stack):
    _, proxy = stack
    client = _anthropic(proxy)
    raw = client.messages.with_raw_response.create(model="claude-plain", max_tokens=200,
                                                   messages=[{"role": "user", "content": "Hi there"}])
    _assert_roles(raw.headers, "claude-plain", "stable-a")
    message = raw.parse()
    assert message.stop_reason == "end_turn" and message.content[0].text
    tooled = client.messages.create(model="claude-plain", max_tokens=200, tools=ANTHROPIC_TOOLS,
                                    messages=[{"role": "user", "content": "Weather in Bern?"}])
    assert tooled.stop_reason == "tool_use" and tooled.content[0].name == "get_weather"
    use = tooled.content[0]
    answer = client.messages.create(model="claude-plain", max_tokens=200, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "snow"}]}])
    assert answer.stop_reason == "end_turn"
    _assert_recorded(proxy, "claude-plain", "chat", 1, "candidate-a")
    _assert_recorded(proxy, "claude-plain", "tools", 2, "candidate-a")
    assert [m.id for m in client.models.list()][:1] and "claude-plain" in [m.id for m in client.models.list()]


def test_anthropic_messages_stream_relays_named_events(stack):
    _, proxy = stack
    client = _anthropic(proxy)
    with client.messages.stream(model="claude-stream", max_tokens=200,
                                messages=[{"role": "user", "content": "Tell me a story"}]) as stream:
        _assert_roles(stream.response.headers, "claude-stream", "stable-a")
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert message.content[0].text
    with client.messages.stream(model="claude-stream", max_tokens=200, tools=ANTHROPIC_TOOLS,
                                messages=[{"role": "user", "content": "Weather in Graz?"}]) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use" and message.content[0].input["city"]
    _assert_recorded(proxy, "claude-stream", "chat", 1, "candidate-a")
    _assert_recorded(proxy, "claude-stream", "tools", 1, "candidate-a")
    assert _metric(proxy, "modelcanary_time_to_first_token_seconds_count", route="claude-stream") == 2


def test_shadow_calls_of_a_messages_request_repeat_its_anthropic_headers(tmp_path):
    """A request that relies on a beta feature (`anthropic-beta`) or pins an API version means
    something else without them: the candidate and the noise-floor call get what the client sent."""
    answer = (b'{"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": '
              b'[{"type": "text", "text": "Hello"}], "stop_reason": "end_turn", "stop_sequence": null, '
              b'"usage": {"input_tokens": 5, "output_tokens": 2}}')
    with canned_upstream(answer) as (url, seen):
        cfg = proxy_config(url)
        cfg["providers"]["claude"] = {"base_url": url + "/v1", "api": "anthropic", "timeout_s": 5, "max_retries": 0}
        cfg["models"]["stable-a"] = {"provider": "claude", "name": "claude-stable"}
        cfg["models"]["candidate-a"] = {"provider": "claude", "name": "claude-candidate"}
        cfg["routes"] = {"claude-beta": shadowed_route("stable-a", "candidate-a")}
        proxy = start_proxy(tmp_path, cfg)
        try:
            client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=0, timeout=10,
                                         default_headers={"anthropic-beta": "token-efficient-tools-2025-02-19"})
            client.messages.create(model="claude-beta", max_tokens=50, messages=[{"role": "user", "content": "Hi"}])
            assert _wait_for(lambda: len(seen) >= 3)  # live, candidate, stable again (noise floor)
        finally:
            proxy.stop()
    assert [h.get("anthropic-beta") for h in seen] == ["token-efficient-tools-2025-02-19"] * len(seen)
    assert len({h["anthropic-version"] for h in seen}) == 1  # the SDK's, on every call
    assert not any("sk-ant-client" in v for h in seen[1:] for v in h.values())  # shadow calls: never the client's key


def test_anthropic_prompt_cache_tokens_are_recorded_by_type(stack):
    _, proxy = stack
    client = _anthropic(proxy)
    system = [{"type": "text", "text": "You answer questions about invoices. " * 40,
               "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model="claude-cache", max_tokens=100, system=system,
                                   messages=[{"role": "user", "content": "first"}])
    second = client.messages.create(model="claude-cache", max_tokens=100, system=system,
                                    messages=[{"role": "user", "content": "second"}])
    assert first.usage.cache_creation_input_tokens > 0 and second.usage.cache_read_input_tokens > 0
    text = scrape(proxy.url)
    labels = {"route": "claude-cache", "role": "stable"}
    assert metric_value(text, "modelcanary_tokens_total", type="cache_write", **labels) == \
        first.usage.cache_creation_input_tokens
    assert metric_value(text, "modelcanary_tokens_total", type="cache_read", **labels) == \
        second.usage.cache_read_input_tokens
    assert metric_value(text, "modelcanary_tokens_total", type="input", **labels) == \
        first.usage.input_tokens + second.usage.input_tokens
    _assert_recorded(proxy, "claude-cache", "chat", 2, "candidate-a")


def test_bad_requests_name_the_field_and_each_api_serves_its_own_routes(stack):
    _, proxy = stack
    client, claude = _openai(proxy), _anthropic(proxy)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="resp-plain", input=42)  # type: ignore[arg-type]
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="claude-plain", input="hi")
    assert e.value.body["param"] == "model" and "api: anthropic" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="resp-plain", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert "api: openai" in str(e.value) and "/v1/chat/completions" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.post("/v1/messages", body={"model": "claude-plain", "messages": []}, cast_to=object)
    assert "max_tokens" in str(e.value)
    # in Anthropic's own error shape, the proxy's code and param beside it
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["param"] == "max_tokens"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-route", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert "no-such-route" in str(e.value)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert e.value.body["error"]["code"] == "model_not_found"
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_requests_total", route="claude-plain", outcome="failed") == 0


def test_the_simulator_lists_its_models_as_each_client_expects(stack):
    sim, _ = stack
    assert {m.id for m in anthropic.Anthropic(base_url=sim.url, api_key="k", max_retries=0).models.list()} == \
        {"good-model", "new-model"}
    listed = anthropic.Anthropic(base_url=sim.url, api_key="k", max_retries=0).models.list()
    assert listed.has_more is False and all(m.type == "model" for m in listed.data)
    assert {m.id for m in openai.OpenAI(base_url=sim.url + "/v1", api_key="k", max_retries=0).models.list()} == \
        {"good-model", "new-model"}
