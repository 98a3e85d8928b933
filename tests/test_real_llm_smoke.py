"""Smoke test of the real LLM server (tests/fixtures/llama_server.py): the openai SDK pointed
DIRECTLY at llama.cpp's server (llama-cpp-python 0.3.36, SmolLM2-135M-Instruct), no proxy.

Besides what a user relies on (an answer, a finish_reason, a parseable tool call), these tests pin
the server behaviours the proxy has to cope with, so that a new llama-cpp-python that changes
them fails here first:
- `stream_options.include_usage` is ignored: no usage chunk arrives;
- a stream's body ends right after `data: [DONE]` and the connection stays open for reuse;
- a prompt longer than n_ctx: 400 `context_length_exceeded` when plain, but an EMPTY 200 stream
  (no event, no [DONE]; the server then drops the connection) when streamed;
- a request body that fails validation: 500 `internal_server_error`, not 400/422.
"""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest

pytestmark = pytest.mark.real_llm

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(llama_server):
    with llama_server.openai_client() as c:
        yield c


def test_serves_both_aliases(llama_server):
    assert {llama_server.chat_model, llama_server.tools_model} <= set(llama_server.models())
    assert llama_server.base_url == f"http://127.0.0.1:{llama_server.port}/v1"


def test_plain_completion(llama_server, client):
    r = client.chat.completions.create(model=llama_server.chat_model, messages=QUESTION, max_tokens=32,
                                       temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip()
    assert choice.finish_reason == "stop"
    # the GGUF's own chat template is in use: a sensible answer, not template garbage
    assert "paris" in choice.message.content.lower(), choice.message.content
    assert r.model == llama_server.chat_model
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 32
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_plain_completion_cut_by_max_tokens(llama_server, client):
    r = client.chat.completions.create(model=llama_server.chat_model, max_tokens=5, temperature=0,
                                       messages=[{"role": "user", "content": "Write a long story about a dragon."}])
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.choices[0].message.content.strip()


def test_streamed_completion(llama_server, client):
    stream = client.chat.completions.create(model=llama_server.chat_model, messages=QUESTION, max_tokens=32,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() and "paris" in text.lower(), text
    assert finish == ["stop"]  # exactly one, in the last chunk
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    # llama-cpp-python 0.3.36 ignores stream_options: no usage chunk, ever. If this starts
    # failing, the server now reports streamed usage (update the fixture notes and the proxy's).
    assert [c.usage for c in chunks if getattr(c, "usage", None)] == []


def _post_sse(conn: http.client.HTTPConnection, body: dict) -> tuple[http.client.HTTPResponse, list[str], float]:
    """POST a streamed chat request; read events line by line until `[DONE]`; returns the
    response, the data lines and the time [DONE] was read."""
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    resp = conn.getresponse()
    data: list[str] = []
    while True:
        line = resp.readline()
        assert line, f"stream ended before [DONE]: {data[-3:]}"
        line = line.decode().strip()
        if line.startswith("data:"):
            data.append(line[5:].strip())
            if data[-1] == "[DONE]":
                return resp, data, time.monotonic()


def test_stream_body_ends_at_done_and_connection_is_reused(llama_server):
    """What a proxy sees on the wire: after `data: [DONE]` the chunked body ends at once, and the
    keep-alive connection serves the next request (uvicorn closes it after ~5 s idle)."""
    conn = http.client.HTTPConnection("127.0.0.1", llama_server.port, timeout=60)
    try:
        body = {"model": llama_server.chat_model, "messages": QUESTION, "max_tokens": 16, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        resp, data, done_at = _post_sse(conn, body)
        assert resp.status == 200
        assert resp.getheader("content-type", "").startswith("text/event-stream")
        assert resp.getheader("transfer-encoding") == "chunked"
        assert resp.read().strip() == b""  # only the event's blank line after [DONE]: no ping, no usage
        after_done_s = time.monotonic() - done_at
        assert after_done_s < 1.0, f"the body stayed open {after_done_s:.2f}s after [DONE]"
        events = [json.loads(d) for d in data[:-1]]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        assert not any("usage" in e for e in events)
        sock = conn.sock
        assert sock is not None  # kept alive
        resp, data, _ = _post_sse(conn, body)
        assert resp.status == 200 and conn.sock is sock  # same connection reused
        resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_forced_tool_call(llama_server, client, stream):
    kwargs = dict(model=llama_server.tools_model, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                  tool_choice=FORCE_WEATHER, max_tokens=64, temperature=0)
    if stream:
        name, arguments, finish = "", "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            choice = chunk.choices[0]
            for call in choice.delta.tool_calls or ():
                assert call.index == 0
                name = call.function.name or name
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    else:
        r = client.chat.completions.create(**kwargs)
        message = r.choices[0].message
        assert len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.id
        name, arguments, finish = call.function.name, call.function.arguments, r.choices[0].finish_reason
    assert finish == "tool_calls"
    assert name == "get_weather"
    args = json.loads(arguments)
    assert isinstance(args, dict) and isinstance(args.get("city"), str) and args["city"], arguments


def test_context_overflow_plain_is_400_context_length_exceeded(llama_server, client):
    too_long = [{"role": "user", "content": "hello world " * (llama_server.n_ctx + 200)}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=llama_server.chat_model, messages=too_long, max_tokens=16)
    assert e.value.status_code == 400
    assert e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == "messages"
    assert f"maximum context length is {llama_server.n_ctx} tokens" in e.value.body["message"]


def test_context_overflow_streamed_is_an_empty_200_stream(llama_server):
    """The error is raised after the 200 and the SSE headers went out: the body is empty (no event,
    no [DONE]), and the openai SDK sees a stream of zero chunks, no exception."""
    too_long = [{"role": "user", "content": "hello world " * (llama_server.n_ctx + 200)}]
    with llama_server.openai_client() as c:  # its own client: the server drops this connection
        chunks = list(c.chat.completions.create(model=llama_server.chat_model, messages=too_long, max_tokens=16,
                                                stream=True))
    assert chunks == []


def test_bad_request_is_500_internal_server_error(llama_server, client):
    """Request validation errors come back as 500 `internal_server_error` (the server's error
    handler catches FastAPI's validation error), with pydantic's errors in the message."""
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=llama_server.chat_model,
                                       messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.status_code == 500
    assert e.value.body["type"] == "internal_server_error"
    assert e.value.body["code"] is None
    assert "validation error" in e.value.body["message"]
