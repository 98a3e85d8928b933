"""The outcome rules of the Responses and Messages formats, on the bodies their APIs answer with,
and the config rule that a route's models share one provider api."""

from __future__ import annotations

import json

import pytest

from service.config import Checks, ConfigError, ModelConfig, parse_config
from service.proxy.formats import CHAT, MESSAGES, RESPONSES, format_of
from service.proxy.outcome import CAUSE_BLAME
from service.proxy.segments import classify_segment

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHECKS = Checks()


def _response(status: str = "completed", output: list | None = None, **extra) -> dict:
    text = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]}]
    return {"id": "resp_1", "object": "response", "status": status, "output": text if output is None else output,
            **extra}


def _cause(fmt, request: dict, response: dict) -> str | None:
    return fmt.classify(fmt.view(request), response, CHECKS).cause


# ---- Responses -----------------------------------------------------------------------------------


def test_responses_outcomes_follow_status_and_incomplete_details():
    plain = {"input": "hi"}
    capped = {"input": "hi", "max_output_tokens": 16}
    assert _cause(RESPONSES, plain, _response()) is None
    cut = _response("incomplete", incomplete_details={"reason": "max_output_tokens"})
    assert _cause(RESPONSES, capped, cut) == "max_tokens" and CAUSE_BLAME["max_tokens"] == "client"
    assert _cause(RESPONSES, plain, cut) == "truncated"
    assert _cause(RESPONSES, plain, _response("incomplete", incomplete_details={"reason": "content_filter"})) == \
        "content_filtered"
    assert _cause(RESPONSES, plain, _response("failed", [], error={"code": "server_error", "message": "x"})) == \
        "provider_5xx"
    assert _cause(RESPONSES, plain, _response("failed", [], error={"code": "rate_limit_exceeded"})) == "rate_limited"
    refusal = [{"type": "message", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}]
    assert _cause(RESPONSES, plain, _response(output=refusal)) == "refusal"
    assert _cause(RESPONSES, plain, _response(output=[])) == "empty_output"
    assert _cause(RESPONSES, plain, {"id": "resp_2", "status": "completed"}) == "bad_response"


def test_a_background_response_is_completed_and_never_shadowed():
    """`background: true` answers at once with a queued response (no output yet): what the client asked
    for, not a model's empty answer; the result is fetched later from the upstream holding it."""
    request = {"input": "hi", "background": True}
    for status in ("queued", "in_progress"):
        assert RESPONSES.classify(RESPONSES.view(request), _response(status, []), CHECKS).ok
    assert RESPONSES.stateful(request) == "background" and RESPONSES.stateful({"input": "hi"}) is None


@pytest.mark.parametrize("fmt, body", [
    (RESPONSES, {"input": "hi", "tools": 5}),
    (MESSAGES, {"max_tokens": 5, "messages": [], "tools": True}),
])
def test_tools_that_are_not_an_array_are_refused_naming_the_field(fmt, body):
    assert fmt.check(body) == ("tools", "field 'tools' must be an array of tools")


def test_responses_function_calls_and_text_format_are_verified():
    tools = {"input": "weather?", "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]}

    def call(arguments: str, name: str = "get_weather") -> dict:
        return _response(output=[{"type": "function_call", "call_id": "c1", "name": name, "arguments": arguments}])

    assert _cause(RESPONSES, tools, call('{"city": "Oslo"}')) is None
    assert _cause(RESPONSES, tools, call('{"city": ')) == "invalid_tool_call"
    assert _cause(RESPONSES, tools, call('{"town": "Oslo"}')) == "invalid_tool_call"
    assert _cause(RESPONSES, tools, call('{"city": "Oslo"}', "get_time")) == "invalid_tool_call"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    wants = {"input": "count", "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}}

    def text(value: str) -> dict:
        return _response(output=[{"type": "message", "content": [{"type": "output_text", "text": value}]}])

    assert _cause(RESPONSES, wants, text('{"n": 3}')) is None
    assert _cause(RESPONSES, wants, text('{"n": "three"}')) == "schema_violation"
    assert _cause(RESPONSES, wants, text("three")) == "invalid_json"
    assert _cause(RESPONSES, {"input": "x", "text": {"format": {"type": "json_object"}}}, text("[1")) == "invalid_json"


def test_responses_segments_come_from_input_items_and_tools():
    def segment(body: dict) -> str:
        return classify_segment(RESPONSES.view(body))

    assert segment({"input": "hi"}) == "chat"
    assert segment({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}) == "tools"
    assert segment({"input": "hi", "tools": [{"type": "web_search"}]}) == "chat"  # function tools only
    assert segment({"input": "hi", "text": {"format": {"type": "json_object"}}}) == "json"
    assert segment({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x" * 40000}]}]}) == \
        "long_context"
    turns = [{"role": r, "content": "t"} for r in ("user", "assistant", "user", "assistant", "user")]
    assert segment({"input": turns}) == "multi_turn"
    assert segment({"input": turns[:3]}) == "chat"


def test_responses_stream_reassembly_ends_at_the_terminal_event():
    final = _response(usage={"input_tokens": 10, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 6}})

    def event(kind: str, **fields) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

    started = event("response.created", response={**final, "status": "in_progress", "output": []}) + \
        event("response.output_text.delta", delta="hello")
    whole = RESPONSES.reassemble(started + event("response.completed", response=final))
    assert whole.ended and whole.response["output"] == final["output"]
    assert RESPONSES.usage({}, whole.response) == type(RESPONSES.usage({}, None))(4, 4, cache_read=6)
    cut = RESPONSES.reassemble(started)
    assert not cut.ended and cut.cause == "bad_response" and "response.completed" in cut.problem
    # what a stream cut short had answered so far, for its tokens: the text of the item begun
    partial = RESPONSES.reassemble(started + event("response.output_item.added", output_index=0,
                                                   item={"type": "message", "role": "assistant"})
                                   + event("response.output_text.delta", output_index=0, delta=" world"))
    assert RESPONSES.chat_view(partial.response)["choices"][0]["message"]["content"] == "hello world"
    failed = RESPONSES.reassemble(started + event("error", code="rate_limit_exceeded", message="slow down"))
    assert failed.cause == "rate_limited" and failed.problem == "slow down"
    assert RESPONSES.has_output(event("response.output_text.delta", delta="x"))
    assert not RESPONSES.has_output(event("response.created", response={}))
    escaped = event("response.output_text.delta", delta='the "response.completed" event')
    assert not any(m in escaped for m in RESPONSES.end_of_stream)


def test_responses_shadow_body_stores_nothing_and_carries_no_upstream_state():
    live = {"model": "support-bot", "input": "hi", "stream": True, "store": True, "previous_response_id": "resp_1",
            "conversation": "conv_1", "background": True}
    assert RESPONSES.shadow_body(live, "new-model") == {"model": "new-model", "input": "hi", "store": False}
    assert RESPONSES.stateful(live) == "previous_response_id"
    assert RESPONSES.stateful({"input": "x", "conversation": {"id": "conv_1"}}) == "conversation"
    assert RESPONSES.stateful({"input": "x"}) is None
    chat = {"model": "support-bot", "messages": [], "stream": True, "stream_options": {"include_usage": True},
            "store": True, "metadata": {"team": "a"}, "temperature": 0.2}
    assert CHAT.shadow_body(chat, "new-model") == {"model": "new-model", "messages": [], "temperature": 0.2}


# ---- Messages ------------------------------------------------------------------------------------


def _message(stop: str = "end_turn", content: list | None = None, **extra) -> dict:
    return {"id": "msg_1", "type": "message", "role": "assistant", "stop_reason": stop,
            "content": [{"type": "text", "text": "hello"}] if content is None else content, **extra}


def test_messages_outcomes_follow_the_stop_reason():
    request = {"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
    assert _cause(MESSAGES, request, _message()) is None
    assert _cause(MESSAGES, request, _message("max_tokens")) == "max_tokens"
    assert _cause(MESSAGES, request, _message("model_context_window_exceeded")) == "truncated"
    assert _cause(MESSAGES, request, _message("refusal")) == "refusal"
    assert _cause(MESSAGES, request, _message(content=[])) == "empty_output"
    tools = {**request, "tools": [{"name": "get_weather", "input_schema": WEATHER}]}

    def use(value: object) -> dict:
        return _message("tool_use", [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": value}])

    assert _cause(MESSAGES, tools, use({"city": "Bern"})) is None
    assert _cause(MESSAGES, tools, use({"town": "Bern"})) == "invalid_tool_call"
    assert _cause(MESSAGES, tools, use('{"city": "Be')) == "invalid_tool_call"  # streamed, not JSON


@pytest.mark.parametrize(("status", "kind", "message", "cause"), [
    (529, "overloaded_error", "Overloaded", "provider_5xx"),
    (500, "api_error", "Internal server error", "provider_5xx"),
    (429, "rate_limit_error", "Number of request tokens has exceeded your rate limit", "rate_limited"),
    (401, "authentication_error", "invalid x-api-key", "auth_error"),
    (403, "permission_error", "Your API key does not have permission", "auth_error"),
    (404, "not_found_error", "model: claude-x", "bad_request"),
    (400, "invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum", "context_length_exceeded"),
    (400, "invalid_request_error", "messages: Field required", "bad_request"),
    (400, "billing_error", "Your credit balance is too low", "quota_exceeded"),
])
def test_messages_error_types_map_to_causes(status, kind, message, cause):
    assert MESSAGES.error_cause(status, {"type": "error", "error": {"type": kind, "message": message}}) == cause


def test_messages_stream_reassembly_and_usage_with_cache_tokens():
    def event(kind: str, **fields) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

    start = event("message_start", message={"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                            "usage": {"input_tokens": 5, "output_tokens": 1,
                                                      "cache_read_input_tokens": 100,
                                                      "cache_creation_input_tokens": 20}})
    tool = event("content_block_start", index=0, content_block={"type": "tool_use", "id": "t1", "name": "f",
                                                                "input": {}}) + \
        event("content_block_delta", index=0, delta={"type": "input_json_delta", "partial_json": '{"city": "Be'})
    end = event("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 7}) + \
        event("message_stop")
    whole = MESSAGES.reassemble(start + tool + event("content_block_delta", index=0, delta={
        "type": "input_json_delta", "partial_json": 'rn"}'}) + end)
    assert whole.ended and whole.response["content"][0]["input"] == {"city": "Bern"}
    usage = MESSAGES.usage({}, whole.response)
    assert (usage.input, usage.output, usage.cache_read, usage.cache_write) == (5, 7, 100, 20)
    assert usage.total_input == 125
    broken = MESSAGES.reassemble(start + tool + end)
    request = {"max_tokens": 10, "messages": [], "tools": [{"name": "f", "input_schema": WEATHER}]}
    assert MESSAGES.classify(MESSAGES.view(request), broken.response, CHECKS).cause == "invalid_tool_call"
    cut = MESSAGES.reassemble(start + tool)
    assert not cut.ended and cut.cause == "bad_response"
    overloaded = MESSAGES.reassemble(start + event("error", error={"type": "overloaded_error", "message": "Overloaded"}))
    assert overloaded.cause == "provider_5xx"
    assert MESSAGES.has_output(tool) and not MESSAGES.has_output(start)


def test_format_of_a_recorded_request():
    assert format_of({"messages": []}, "anthropic") is MESSAGES
    assert format_of({"input": "hi"}, "openai") is RESPONSES
    assert format_of({"messages": []}, "openai").name == "chat"


# ---- config --------------------------------------------------------------------------------------


def test_a_route_mixing_provider_apis_is_refused_naming_it():
    cfg = {"providers": {"oa": {"base_url": "http://127.0.0.1:1/v1"},
                         "an": {"base_url": "http://127.0.0.1:2/v1", "api": "anthropic"}},
           "models": {"gpt": {"provider": "oa", "name": "g"}, "claude": {"provider": "an", "name": "c"}},
           "routes": {"support-bot": {"stable": "gpt", "candidate": "claude"}}}
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith("routes.support-bot.candidate: ") and "api" in e.value.problems[0]
    cfg["models"]["claude"]["provider"] = "oa"
    assert parse_config(cfg).providers["an"].api == "anthropic"
    cfg["providers"]["an"]["api"] = "gemini"
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    assert e.value.problems[0].startswith("providers.an.api: ")


# ---- a model's settings in each format -------------------------------------------------------------


def test_model_settings_map_onto_responses_fields():
    model = ModelConfig(provider="p", name="up", system_prompt="Be terse.",
                        params={"max_tokens": 7, "reasoning_effort": "low", "temperature": 0.2, "seed": 1})
    client = {"model": "route", "input": "hi", "instructions": "Mine.", "max_output_tokens": 50,
              "reasoning": {"summary": "auto"}}
    body = RESPONSES.model_body(client, model)
    assert body == {"model": "up", "input": "hi", "instructions": "Be terse.\n\nMine.", "max_output_tokens": 7,
                    "reasoning": {"summary": "auto", "effort": "low"}, "temperature": 0.2}  # no seed in Responses
    assert client["model"] == "route" and client["instructions"] == "Mine."  # the client's request is left as it was
    assert RESPONSES.model_body({"input": "hi"}, ModelConfig(provider="p", name="up", system_prompt="S"))[
        "instructions"] == "S"


def test_model_settings_map_onto_messages_fields():
    model = ModelConfig(provider="p", name="up", system_prompt="Be terse.",
                        params={"max_completion_tokens": 9, "stop": "END", "top_p": 0.5, "seed": 1})
    client = {"model": "route", "max_tokens": 100, "system": "Mine.", "messages": [{"role": "user", "content": "hi"}]}
    body = MESSAGES.model_body(client, model)
    assert body == {"model": "up", "max_tokens": 9, "stop_sequences": ["END"], "top_p": 0.5,
                    "system": [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Mine."}],
                    "messages": client["messages"]}
    assert MESSAGES.model_body({"max_tokens": 5, "messages": []}, ModelConfig(provider="p", name="up",
                                                                             system_prompt="S"))["system"] == "S"


def test_a_cap_the_client_set_is_a_completed_answer_in_every_format():
    capped = RESPONSES.classify(RESPONSES.view({"input": "hi", "max_output_tokens": 16}),
                                _response("incomplete", incomplete_details={"reason": "max_output_tokens"}), CHECKS)
    assert (capped.outcome, capped.cause, capped.blame) == ("completed", "max_tokens", "client")
    message = {"type": "message", "content": [{"type": "text", "text": "a b c"}], "stop_reason": "max_tokens"}
    capped = MESSAGES.classify(MESSAGES.view({"max_tokens": 3, "messages": []}), message, CHECKS)
    assert (capped.outcome, capped.cause, capped.blame) == ("completed", "max_tokens", "client")


def test_chat_time_to_first_token_waits_for_output():
    """Keep-alive comments and the role-only first chunk are not the first token."""
    def chunk(delta: dict, sep: tuple[str, str] = (",", ":")) -> bytes:
        body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
        return b"data: " + json.dumps(body, separators=sep).encode() + b"\n\n"

    assert not CHAT.has_output(b": ping\n\n")
    assert not CHAT.has_output(chunk({"role": "assistant", "content": ""}))
    assert CHAT.has_output(chunk({"content": "Hel"}))
    assert CHAT.has_output(chunk({"content": "Hel"}, sep=(", ", ": ")))  # llama-cpp-python's spacing
    assert CHAT.has_output(chunk({"tool_calls": [{"index": 0, "function": {"name": "get_weather"}}]}))
    assert CHAT.has_output(chunk({"refusal": "no"}))
