"""The proxy in front of a real LLM server (llama.cpp's, from llama-cpp-python, serving SmolLM2-135M):
every request's recorded outcome says what its client saw (issue 13).

`test_recorded_outcomes_match_what_clients_saw` drives several hundred mixed requests through the
openai SDK (streamed with and without `include_usage`, plain, JSON mode, tools on the
function-calling alias, prompts over the context window, bad requests, clients that hang up
mid-stream) at concurrency 1 to 4 over reused keep-alive connections, reads each request's
OutcomeEvent from Kafka, and compares its outcome, cause, blame and status with what the client
observed. The expectation is computed from the client's side only: what it received, and whether
it left.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field

import openai
import pytest
from jsonschema import Draft202012Validator

from service.bus.kafka import read_topic

pytestmark = [pytest.mark.real_llm, pytest.mark.timeout(1200)]

TOTAL = 500
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PROMPTS = ["Say hello.", "Reply with one word: yes or no?", "Name a colour.", "What is 2+2?",
           "Write a haiku about the sea.", "Give me a fruit name.", "Tell me a short joke.", "Say goodbye."]
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Quito"]
# about 3,000 tokens: longer than the server's n_ctx (2048)
OVERFLOW = "word " * 3000


@dataclass
class Seen:
    """One request as its client observed it, and what the record must then say."""

    kind: str
    request_id: str | None = None
    expected: tuple[str, str | None, str | None, int | None] | None = None  # outcome, cause, blame, status
    error: str | None = None


@dataclass
class Plan:
    kind: str
    route: str
    body: dict = field(default_factory=dict)


def _expect_answer(kind: str, request: dict, finish: str | None, content: str | None,
                   tool_calls: list[dict]) -> tuple[str, str | None, str | None, int]:
    """What a whole answer the client received must be recorded as (DESIGN §6, §12)."""
    if finish is None:
        return "failed", "bad_response", "provider", 200
    if finish == "length":
        return "completed", "max_tokens", "client", 200  # every request here sets max_tokens
    if tool_calls:
        schema = request["tools"][0]["function"]["parameters"]
        for call in tool_calls:
            try:
                args = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:
                return "failed", "invalid_tool_call", "model", 200
            if call["function"]["name"] != "get_weather" or not Draft202012Validator(schema).is_valid(args):
                return "failed", "invalid_tool_call", "model", 200
        return "completed", None, None, 200
    if not content:
        return "failed", "empty_output", "model", 200
    if kind.startswith("json"):
        try:
            json.loads(content)
        except ValueError:
            return "failed", "invalid_json", "model", 200
    return "completed", None, None, 200


def make_plan(rng: random.Random, n: int) -> list[Plan]:
    """Blocks of chat requests, then of tool requests (the server holds one alias in memory; switching
    costs ~1 s), in a shuffled mix."""
    chat_kinds = (["stream"] * 22 + ["stream_usage"] * 18 + ["plain"] * 22 + ["json"] * 8 + ["json_stream"] * 4
                  + ["abort"] * 10 + ["overflow"] * 2 + ["overflow_stream"] * 2 + ["bad_request"] * 3)
    plans: list[Plan] = []
    while len(plans) < n:
        block = [rng.choice(chat_kinds) for _ in range(100)]
        block += [rng.choice(("tools", "tools_stream")) for _ in range(16)]
        for kind in block:
            plans.append(_plan(rng, kind))
    return plans[:n]


def _plan(rng: random.Random, kind: str) -> Plan:
    prompt = rng.choice(PROMPTS)
    body: dict = {"messages": [{"role": "user", "content": prompt}], "max_tokens": rng.choice((2, 4, 6, 8, 12))}
    route = "chat"
    if kind in ("stream", "abort", "json_stream", "tools_stream", "overflow_stream"):
        body["stream"] = True
    if kind == "stream_usage":
        body.update(stream=True, stream_options={"include_usage": True})
    if kind.startswith("json"):
        body.update(response_format={"type": "json_object"}, max_tokens=rng.choice((8, 24)),
                    messages=[{"role": "user", "content": f"Give a JSON object describing {prompt.lower()}"}])
    if kind.startswith("tools"):
        route = "tools"
        body.update(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    max_tokens=24, messages=[{"role": "user", "content": f"What is the weather in {rng.choice(CITIES)}?"}])
    if kind == "abort":
        body.update(max_tokens=32, messages=[{"role": "user", "content": "Count from 1 to 100, one number a line."}])
    if kind.startswith("overflow"):
        body["messages"] = [{"role": "user", "content": OVERFLOW}]
    if kind == "bad_request":
        body["extra_body"] = {"top_k": "many"}  # an integer field of llama.cpp's server
    return Plan(kind, route, body)


async def run_one(client: openai.AsyncOpenAI, plan: Plan) -> Seen:
    seen = Seen(plan.kind)
    body = dict(plan.body)
    try:
        if body.get("stream"):
            await _stream(client, plan, body, seen)
        else:
            raw = await client.chat.completions.with_raw_response.create(model=plan.route, **body)
            seen.request_id = raw.headers.get("x-request-id")
            done = raw.parse()
            choice = done.choices[0]
            calls = [c.model_dump() for c in choice.message.tool_calls or ()]
            seen.expected = _expect_answer(plan.kind, body, choice.finish_reason, choice.message.content, calls)
    except openai.APIStatusError as e:
        seen.request_id = e.response.headers.get("x-request-id")
        code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        seen.error = f"{e.status_code} {code}"
        blame = {"context_length_exceeded": "client", "bad_request": "client"}.get(code or "", "provider")
        seen.expected = ("failed", code, blame, e.status_code)
    return seen


async def _stream(client: openai.AsyncOpenAI, plan: Plan, body: dict, seen: Seen) -> None:
    raw = await client.chat.completions.with_raw_response.create(model=plan.route, **body)
    seen.request_id = raw.headers.get("x-request-id")
    stream = raw.parse()
    content: list[str] = []
    calls: dict[int, dict] = {}
    finish = None
    chunks = 0
    try:
        async for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    content.append(delta.content)
                    chunks += 1
                for tc in delta.tool_calls or ():
                    call = calls.setdefault(tc.index, {"function": {"name": "", "arguments": ""}})
                    # llama.cpp's server repeats the whole name in every delta: the Agents SDK takes it once
                    if tc.function and tc.function.name and tc.function.name != call["function"]["name"]:
                        call["function"]["name"] += tc.function.name
                    if tc.function and tc.function.arguments:
                        call["function"]["arguments"] += tc.function.arguments
                finish = choice.finish_reason or finish
            if plan.kind == "abort" and chunks >= 2 and finish is None:
                await stream.close()  # hang up: the rest of the answer is still being generated
                seen.expected = ("failed", "client_cancelled", "client", 200)
                return
    except openai.APIError as e:  # an error event inside the stream
        code = getattr(e, "code", None)
        seen.error = f"stream error {code}"
        blame = "provider" if code in ("bad_response", "connection_error", "timeout", "provider_5xx") else "proxy"
        seen.expected = ("failed", code, blame, 200)
        return
    seen.expected = _expect_answer(plan.kind, body, finish, "".join(content) or None, list(calls.values()))


async def drive(base_url: str, plans: list[Plan], concurrency_of) -> list[Seen]:
    """The plans in order, each phase at its own concurrency, one client (keep-alive pool) throughout."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-client", max_retries=0, timeout=120)
    results: list[Seen] = []
    try:
        phase_len = len(plans) // 4 + 1
        for phase in range(4):
            todo = plans[phase * phase_len:(phase + 1) * phase_len]
            sem = asyncio.Semaphore(concurrency_of(phase))

            async def guarded(plan: Plan, sem: asyncio.Semaphore = sem) -> Seen:
                async with sem:
                    return await run_one(client, plan)

            results += await asyncio.gather(*(guarded(p) for p in todo))
    finally:
        await client.close()
    return results


def outcomes_by_id(bootstrap: str, topic: str, ids: set[str], timeout_s: float = 60) -> dict[str, list[dict]]:
    deadline = time.monotonic() + timeout_s
    found: dict[str, list[dict]] = {}
    while time.monotonic() < deadline:
        found = {}
        for rec in read_topic(bootstrap, topic, timeout_s=15):
            if rec.get("kind") == "request":
                found.setdefault(rec["request_id"], []).append(rec)
        if ids <= found.keys():
            break
        time.sleep(1)
    return found


def compare(bootstrap: str, prefix: str, seen: list[Seen]) -> list[tuple]:
    """Each request's one OutcomeEvent against what its client saw: the mismatches."""
    assert all(s.request_id for s in seen), [s for s in seen if not s.request_id][:3]
    records = outcomes_by_id(bootstrap, f"{prefix}.outcomes", {s.request_id for s in seen})
    mismatches = []
    for s in seen:
        got = records.get(s.request_id, [])
        if len(got) != 1:
            mismatches.append((s.kind, s.request_id, s.expected, f"{len(got)} outcome events"))
            continue
        rec = got[0]
        actual = (rec["outcome"], rec["cause"], rec["blame"], rec["status"])
        if actual != s.expected:
            mismatches.append((s.kind, s.request_id, s.expected, actual))
        elif actual[1] == "client_cancelled" and (rec["input_tokens"] < 1 or rec["output_tokens"] < 1):  # it saw output
            mismatches.append((s.kind, s.request_id, "tokens of the answer so far", (rec["input_tokens"], rec["output_tokens"])))
    return mismatches


def real_config(llama, bootstrap: str, prefix: str) -> dict:
    return {
        # no upstream retries: a connection the proxy reuses wrongly must show, not be retried away
        "providers": {"llama": {"base_url": llama.base_url, "timeout_s": 120, "max_retries": 0}},
        "models": {"small": {"provider": "llama", "name": llama.chat_model},
                   "small-tools": {"provider": "llama", "name": llama.tools_model}},
        "routes": {"chat": {"stable": "small"}, "tools": {"stable": "small-tools"}},
        "events": {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix,
                                                 "partitions": 2}},
    }


def test_recorded_outcomes_match_what_clients_saw(llama_server, kafka_broker, servers):
    prefix = "real" + uuid.uuid4().hex[:8]
    proxy = servers.proxy(real_config(llama_server, kafka_broker.bootstrap, prefix))
    plans = make_plan(random.Random(13), TOTAL)

    started = time.monotonic()
    seen = asyncio.run(drive(proxy.url + "/v1", plans, lambda phase: phase + 1))
    took = time.monotonic() - started

    mismatches = compare(kafka_broker.bootstrap, prefix, seen)
    kinds: dict[str, int] = {}
    for s in seen:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    print(f"\n{len(seen)} requests in {took:.0f} s; by kind {kinds}")
    assert not mismatches, f"{len(mismatches)} of {len(seen)} mismatched, e.g. {mismatches[:10]}"
    assert len(seen) >= 500
    # the mix really held what it claims: clients that left, capped answers, whole answers, errors
    expected = {s.expected[:2] for s in seen if s.expected}
    assert {("failed", "client_cancelled"), ("completed", "max_tokens"), ("completed", None),
            ("failed", "context_length_exceeded"), ("failed", "bad_request"), ("failed", "bad_response")} <= expected
    assert "Traceback" not in proxy.output()


def test_streams_the_server_cuts_short_are_its_failure(llama_server_factory, kafka_broker, servers):
    """llama.cpp's server by default (`interrupt_requests`) ends a stream with `[DONE]` but no
    finish_reason as soon as another request waits. The client got no whole answer: `bad_response`,
    blamed on the provider; never `client_cancelled`, never a connection error."""
    llama = llama_server_factory(interrupt_requests=True)
    prefix = "cut" + uuid.uuid4().hex[:8]
    proxy = servers.proxy(real_config(llama, kafka_broker.bootstrap, prefix))
    plans = [Plan("stream", "chat", {"stream": True, "max_tokens": 16,
                                     "messages": [{"role": "user", "content": f"Tell a story about {c}."}]})
             for c in CITIES * 2]
    seen = asyncio.run(drive(proxy.url + "/v1", plans, lambda phase: 2))
    assert not compare(kafka_broker.bootstrap, prefix, seen)
    cut = [s for s in seen if s.expected[1] == "bad_response"]
    assert cut, "no stream was interrupted: the scenario did not happen"
    assert all(s.expected == ("failed", "bad_response", "provider", 200) for s in cut)


def test_passed_through_endpoint_gets_the_same_error_rules(llama_server, servers):
    """`/v1/completions` is passed through, but an upstream error is read as on chat: llama.cpp's 500
    for a request it cannot validate is the client's `bad_request`, a 400 without the server's
    traceback in it."""
    from tests.fixtures.servers import metric_value, scrape

    proxy = servers.proxy({"providers": {"llama": {"base_url": llama_server.base_url, "max_retries": 0}},
                           "models": {"small": {"provider": "llama", "name": llama_server.chat_model}},
                           "routes": {"chat": {"stable": "small"}}})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="chat", prompt=5, max_tokens=3)  # type: ignore[arg-type]
    assert e.value.code == "bad_request" and "File \"" not in e.value.message, e.value.message
    answer = client.completions.with_raw_response.create(model="chat", prompt="Say hi.", max_tokens=3)
    assert answer.status_code == 200 and answer.parse().choices[0].text is not None
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_failures_total", route="chat", cause="bad_request", blame="client") == 1
    assert metric_value(text, "modelcanary_failures_total", route="chat", cause="provider_5xx") == 0
    with pytest.raises(openai.NotFoundError) as missing:  # llama.cpp has no Responses API: its own 404, kept
        client.responses.create(model="chat", input="Say hi.")
    assert missing.value.response.json() == {"detail": "Not Found"}, missing.value.response.text


def _tool_delta(name: str, arguments: str, call_id: str | None = "call_0") -> bytes:
    call = {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    chunk = {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def test_reassembly_keeps_a_tool_name_each_delta_repeats():
    """llama.cpp's server (llama-cpp-python) repeats the whole name, id and type in every delta of a
    streamed tool call; a provider that splits a name sends fragments once each."""
    from service.proxy.sse import reassemble

    repeated = b"".join(_tool_delta("get_weather", part) for part in ('{"city"', ': "Paris"', "}"))
    split = _tool_delta("get_", '{"city"') + _tool_delta("weather", ': "Paris"}', None)
    for raw in (repeated, split):
        (call,) = reassemble(raw + b"data: [DONE]\n\n").response["choices"][0]["message"]["tool_calls"]
        assert call == {"id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_a_streamed_tool_call_from_llama_is_recorded_completed(llama_server, servers):
    """A streamed call of the tool `tool_choice` names, with arguments that fit, is `completed`, as it
    is unstreamed (and as the Agents SDK, which runs the tool, sees it)."""
    from tests.fixtures.servers import metric_value, scrape

    proxy = servers.proxy({"providers": {"llama": {"base_url": llama_server.base_url, "max_retries": 0}},
                           "models": {"small-tools": {"provider": "llama", "name": llama_server.tools_model}},
                           "routes": {"tools": {"stable": "small-tools"}}})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=60)
    body = {"model": "tools", "tools": [WEATHER], "max_tokens": 24,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    with client.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or ()
    arguments = json.loads(call.function.arguments)
    assert Draft202012Validator(WEATHER["function"]["parameters"]).is_valid(arguments), arguments
    deadline = time.monotonic() + 10  # recorded once the proxy has read the stream's end
    while not metric_value(text := scrape(proxy.url), "modelcanary_requests_total", route="tools") and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric_value(text, "modelcanary_requests_total", route="tools", outcome="completed") == 1, \
        [line for line in text.splitlines() if line.startswith("modelcanary_failures_total")]
