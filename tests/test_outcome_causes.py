"""Causes of real upstream answers (issue 13): the error bodies OpenAI-compatible servers document or
send, mapped to DESIGN §6's causes; answers cut by the client's own cap (`max_tokens`, blamed on the
client, completed) against answers cut short otherwise (`truncated`, blamed on the model)."""

from __future__ import annotations

import time

import pytest

from service.config import Checks, ModelConfig
from service.proxy.outcome import CAUSE_BLAME, classify_chat, failed
from service.upstream.errors import RETRYABLE_STATUS, error_cause
from service.upstream.model_settings import model_body, requested_cap

# (server, status, body, cause): bodies as each server documents or sends them
ERROR_SHAPES = [
    # OpenAI
    ("openai", 400, {"error": {"message": "This model's maximum context length is 128000 tokens. However, your "
                               "messages resulted in 130000 tokens.", "type": "invalid_request_error",
                               "param": "messages", "code": "context_length_exceeded"}}, "context_length_exceeded"),
    ("openai", 429, {"error": {"message": "Rate limit reached for gpt-4o", "type": "requests",
                               "param": None, "code": "rate_limit_exceeded"}}, "rate_limited"),
    ("openai", 429, {"error": {"message": "You exceeded your current quota", "type": "insufficient_quota",
                               "param": None, "code": "insufficient_quota"}}, "quota_exceeded"),
    ("openai", 401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                               "param": None, "code": "invalid_api_key"}}, "auth_error"),
    ("openai", 400, {"error": {"message": "Invalid 'messages[0].role'", "type": "invalid_request_error",
                               "param": "messages", "code": "invalid_value"}}, "bad_request"),
    ("openai", 503, {"error": {"message": "The engine is currently overloaded, please try again later",
                               "type": "server_error", "param": None, "code": None}}, "provider_5xx"),
    ("azure", 400, {"error": {"message": "The response was filtered", "type": None, "param": "prompt",
                              "code": "content_filter"}}, "content_filtered"),
    # llama-cpp-python's server (also produced for real in tests/test_real_upstream.py)
    ("llama-cpp-python", 400, {"error": {"message": "This model's maximum context length is 2048 tokens. However, "
                                         "you requested 3039 tokens (3031 in the messages, 8 in the completion).",
                                         "type": "invalid_request_error", "param": "messages",
                                         "code": "context_length_exceeded"}}, "context_length_exceeded"),
    ("llama-cpp-python", 500, {"error": {"message": "1 validation error:\n  {'type': 'int_parsing', 'loc': ('body', "
                                         "'top_k'), 'msg': 'Input should be a valid integer'}\n\n  File \"app.py\"",
                                         "type": "internal_server_error", "param": None, "code": None}}, "bad_request"),
    ("llama-cpp-python", 500, {"error": {"message": "llama_decode returned -3", "type": "internal_server_error",
                                         "param": None, "code": None}}, "provider_5xx"),
    # llama.cpp's own llama-server
    ("llama-server", 400, {"error": {"code": 400, "message": "request (4476 tokens) exceeds the available context "
                                     "size (4096 tokens)", "type": "exceed_context_size_error",
                                     "n_prompt_tokens": 4476, "n_ctx": 4096}}, "context_length_exceeded"),
    ("llama-server", 503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
     "provider_5xx"),
    # vLLM: the OpenAI shape with an integer code, and older releases' top-level fields
    ("vllm", 400, {"error": {"message": "This model's maximum context length is 4096 tokens. However, your request "
                             "has 5000 input tokens.", "type": "BadRequestError", "param": None, "code": 400}},
     "context_length_exceeded"),
    ("vllm", 400, {"object": "error", "message": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This "
                   "model's maximum context length is 4096 tokens and your request has 2778 input tokens",
                   "type": "BadRequestError", "param": None, "code": 400}, "context_length_exceeded"),
    ("vllm", 400, {"error": {"message": "temperature must be non-negative", "type": "BadRequestError",
                             "param": "temperature", "code": 400}}, "bad_request"),
    ("vllm", 404, {"error": {"message": "The model `gpt-x` does not exist.", "type": "NotFoundError",
                             "param": "model", "code": 404}}, "bad_request"),
    # Ollama: a string on its native API, the OpenAI shape on /v1
    ("ollama", 400, {"error": "the input length exceeds the context length"}, "context_length_exceeded"),
    ("ollama", 404, {"error": "model 'llama3.2' not found"}, "bad_request"),
    ("ollama", 500, {"error": "the model failed to generate a response"}, "provider_5xx"),
    ("ollama", 400, {"error": {"message": "invalid message format", "type": "invalid_request_error", "param": None,
                               "code": None}}, "bad_request"),
    ("ollama", 402, {"error": "payment required"}, "quota_exceeded"),
    # Anthropic-style overload, a gateway's HTML page, a timeout, a redirect
    ("anthropic", 529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
     "provider_5xx"),
    ("gateway", 502, None, "provider_5xx"),
    ("gateway", 408, None, "timeout"),
    ("gateway", 418, None, "bad_request"),
    ("gateway", 302, None, "bad_response"),
]


@pytest.mark.parametrize("server,status,body,cause", ERROR_SHAPES,
                         ids=[f"{s}-{st}-{c}" for s, st, _, c in ERROR_SHAPES])
def test_error_shapes_map_to_causes(server, status, body, cause):
    assert error_cause(status, body) == cause
    assert cause in CAUSE_BLAME


def test_a_context_overflow_is_the_clients_whatever_the_server():
    overflows = [c for _, _, _, c in ERROR_SHAPES if c == "context_length_exceeded"]
    assert len(overflows) >= 5
    assert CAUSE_BLAME["context_length_exceeded"] == "client"


def test_overloaded_answers_are_retried():
    assert {429, 503, 529} <= RETRYABLE_STATUS
    assert 500 not in RETRYABLE_STATUS and 400 not in RETRYABLE_STATUS


def answer(finish: str, content: str | None = "some words", completion_tokens: int | None = None) -> dict:
    body: dict = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                               "finish_reason": finish}]}
    if completion_tokens is not None:
        body["usage"] = {"prompt_tokens": 10, "completion_tokens": completion_tokens}
    return body


@pytest.mark.parametrize("request_fields,response,expected", [
    ({"max_tokens": 8}, answer("length", completion_tokens=8), ("completed", "max_tokens", "client")),
    ({"max_completion_tokens": 8}, answer("length", completion_tokens=8), ("completed", "max_tokens", "client")),
    ({"max_tokens": 8}, answer("length"), ("completed", "max_tokens", "client")),  # no usage: the cap's doing
    ({"max_tokens": 64}, answer("length", completion_tokens=20), ("failed", "truncated", "model")),  # short of the cap
    ({}, answer("length", completion_tokens=20), ("failed", "truncated", "model")),  # no cap: the model's
    ({"max_tokens": True}, answer("length"), ("failed", "truncated", "model")),  # not a cap
    ({"max_tokens": 8}, answer("stop"), ("completed", None, None)),
])
def test_length_stops_blame_whoever_set_the_limit(request_fields, response, expected):
    request = {"messages": [{"role": "user", "content": "hi"}], **request_fields}
    verdict = classify_chat(request, response, Checks())
    assert (verdict.outcome, verdict.cause, verdict.blame) == expected


def test_a_capped_json_answer_is_the_clients_cap_not_invalid_json():
    request = {"messages": [{"role": "user", "content": "json"}], "response_format": {"type": "json_object"},
               "max_tokens": 4}
    verdict = classify_chat(request, answer("length", '{"a": ', completion_tokens=4), Checks())
    assert (verdict.outcome, verdict.cause) == ("completed", "max_tokens")


def test_model_settings_go_first_and_override_the_client():
    model = ModelConfig(provider="p", name="up-model", system_prompt="You are terse.",
                        params={"temperature": 0.2, "max_tokens": 32})
    client = {"model": "route", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0,
              "max_completion_tokens": 500, "user": "u1"}
    asked = model_body(client, model)
    assert asked["model"] == "up-model"
    assert asked["messages"] == [{"role": "system", "content": "You are terse."},
                                 {"role": "user", "content": "hi"}]
    assert asked["temperature"] == 0.2 and asked["user"] == "u1"
    assert "max_completion_tokens" not in asked and requested_cap(asked) == 32  # the model's cap replaces the client's
    assert client["messages"] == [{"role": "user", "content": "hi"}] and client["temperature"] == 1.0  # untouched
    plain = ModelConfig(provider="p", name="up-model")
    assert model_body(client, plain) == {**client, "model": "up-model"}


def capped(role: str, n: int, share: float, now: float) -> list:
    """n completed outcomes of one arm, a `share` of them at the client's own cap."""
    from service.records import OutcomeEvent

    out = []
    for i in range(n):
        at_cap = (i * share) % 1 + share >= 1  # spread evenly
        out.append(OutcomeEvent(
            request_id=f"{role}-{i}", ts=now - 300, route="bot", model="stable-m" if role == "stable" else "candidate-m",
            role=role, segment="chat", outcome="completed", cause="max_tokens" if at_cap else None,
            blame="client" if at_cap else None, latency_s=0.3, cost_usd=0.001))
    return out


def test_the_judge_compares_the_max_tokens_rate_on_its_own():
    """A candidate that runs into the client's cap far more often is rolled back on `max_tokens_rate`,
    while its completion and model failure rates stay those of the stable model."""
    from service.judge.decide import WORSE, judge
    from service.judge.evidence import RouteEvidence
    from service.rollout.book import RolloutBook
    from tests.judge_traffic import make_config

    config = make_config(shadow={"sample_rate": 0.0})
    rc = config.routes["bot"]
    now = time.time()
    state = RolloutBook(config).get("bot").model_copy(update={
        "phase": "canary", "step_index": 0, "since": now - 600, "canary_weight": rc.rollout.steps[0] / 100})
    ev = RouteEvidence("bot", rc, state.stable, state.candidate)
    ev.sync(state)
    for rec in capped("stable", 3000, 0.05, now) + capped("canary", 3000, 0.40, now):
        ev.add_outcome(rec)
    j = judge(state, rc, ev, now)
    verdicts = {(c.spec.name, c.segment): c.verdict for c in j.comparisons}
    assert verdicts[("max_tokens_rate", "overall")] == WORSE
    assert verdicts.get(("completion_rate", "overall")) != WORSE  # every answer was completed
    assert verdicts.get(("model_failure_rate", "overall")) != WORSE
    assert j.decision.decision == "rollback"
    assert any("max_tokens rate" in r for r in j.decision.reasons), j.decision.reasons


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}},   # a reference to nothing
    {"$ref": "https://schemas.example.invalid/order.json"},                   # to another document
])
def test_a_schema_the_verifier_cannot_resolve_is_not_held_against_the_model(schema):
    tool_call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    answer = {"choices": [{"index": 0, "finish_reason": "tool_calls",
                           "message": {"role": "assistant", "content": None, "tool_calls": [tool_call]}}]}
    request = {"messages": [{"role": "user", "content": "hi"}],
               "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    assert classify_chat(request, answer, Checks()).ok
    as_json = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "{}"}}]}
    request = {"messages": [{"role": "user", "content": "hi"}],
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    assert classify_chat(request, as_json, Checks()).ok


def test_estimated_tokens_count_what_the_model_was_asked_and_a_stream_left_before_its_first_event():
    """Without usage (llama.cpp's streams): the input is what the upstream was asked, the model's
    system prompt included; a stream the upstream began bills its input even if the client left at once."""
    from service.proxy.recorder import Call, usage_tokens

    request = {"model": "bot", "messages": [{"role": "user", "content": "Say hi."}]}
    asked = {"model": "m", "messages": [{"role": "system", "content": "Be terse. " * 150}, *request["messages"]]}
    call = Call(request_id="r", route="bot", model_key="m", role="stable", segment="chat", started=0.0,
                request=request, stream=True, status=200)
    call.response = answer("stop", "hi")
    alone = usage_tokens(call)[0]
    call.asked = asked
    assert usage_tokens(call)[0] > alone + 300
    call.response = None  # the client left before the first event
    call.verdict = failed("client_cancelled")
    assert usage_tokens(call) == (usage_tokens(call)[0], 0) and usage_tokens(call)[0] > 300
    call.verdict = failed("bad_response", "no chunks in the stream")  # ended without an event (llama.cpp
    assert usage_tokens(call) == (0, 0)                                # past its context): nothing evaluated
    call.verdict = failed("client_cancelled")
    call.status = 429  # refused: nothing billed
    assert usage_tokens(call) == (0, 0)


def test_a_refusal_counts_as_output():
    """A streamed refusal (`delta.refusal`) without usage is the model's output, estimated like text."""
    from service.proxy.recorder import Call, usage_tokens

    call = Call(request_id="r", route="bot", model_key="m", role="stable", segment="chat", started=0.0,
                request={"messages": [{"role": "user", "content": "help me"}]}, stream=True, status=200)
    call.response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": None, "refusal": "I'm sorry, but I can't help with that request."}}]}
    assert usage_tokens(call)[1] >= 10


@pytest.mark.parametrize("chunks,expected", [
    (None, ("completed", "max_tokens", "client")),  # neither usage nor a stream: taken as the cap's
    (402, ("completed", "max_tokens", "client")),   # a token a chunk, the role and last chunks besides
    (120, ("completed", "max_tokens", "client")),   # a server that groups a few tokens a chunk
    (9, ("failed", "truncated", "model")),          # 7 tokens of 400: the context filled up, not the cap
])
def test_a_streamed_length_stop_without_usage_is_told_by_its_chunks(chunks, expected):
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
    verdict = classify_chat(request, answer("length"), Checks(), chunks=chunks)
    assert (verdict.outcome, verdict.cause, verdict.blame) == expected
