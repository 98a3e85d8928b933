"""The LLM simulator (DESIGN §8b), started as a real subprocess and used over real HTTP."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import openai
import pytest
import yaml

from service.config import ConfigError
from service.proxy.segments import estimate_tokens
from service.simulator.config import FAILURE_KINDS, load_simulator_config, parse_simulator_config, resolve
from service.simulator.engine import REFUSAL_TEXT, InstanceGenerator
from service.simulator.facts import read_facts

ROOT = Path(__file__).resolve().parents[1]

FAILURE_MODELS = {f"f-{kind}": {"failures": {kind: 1.0}} for kind in FAILURE_KINDS}

MAIN_CONFIG = {
    "seed": 7,
    "time_scale": 0,
    "models": {
        "a": {},
        "b": {"latency_s": {"median": 0.1, "p95": 0.2}},   # other latency, same answers
        "div": {"divergence": 0.3},
        "seg": {"segments": {"tools": {"failures": {"invalid_tool_call": 1.0}},
                             "billing": {"failures": {"refusal": 1.0}}}},
        "ctx": {"context_tokens": 10},
        "wrong": {"segments": {"billing": {"wrong_content": 1.0}}},
        "judge": {"judge": True},
        "noisy-judge": {"judge": True, "judge_error": 0.3},
        "mixed": {"divergence": 0.2, "failures": {"rate_limited": 0.1, "provider_5xx": 0.1, "truncated": 0.1,
                                                  "refusal": 0.1}},
        **FAILURE_MODELS,
    },
}

TIMED_CONFIG = {
    "seed": 3,
    "time_scale": 1.0,
    "api_key": "sk-sim-test",
    "models": {
        "slow": {"latency_s": {"median": 0.3, "p95": 0.3}, "ttft_s": {"median": 0.1, "p95": 0.1},
                 "output_tokens": {"median": 20, "p95": 20}},
        "phased": {"latency_s": {"median": 0.001, "p95": 0.001}, "ttft_s": {"median": 0.001, "p95": 0.001},
                   "phases": [{"after_s": 2.0, "failures": {"provider_5xx": 1.0}}]},
    },
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    }, "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
        "filters": {"type": "array", "items": {"type": "string", "enum": ["news", "docs", "code"]},
                    "uniqueItems": True, "maxItems": 3},
    }, "required": ["query"]}}}

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "format": "uuid"},
        "status": {"enum": ["open", "shipped", "refunded"]},
        "total": {"type": "number", "minimum": 0, "exclusiveMaximum": 1000},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"$ref": "#/$defs/item"}},
        "customer": {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                                       "vip": {"type": "boolean"}},
                     "required": ["email", "vip"], "additionalProperties": False},
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    },
    "required": ["order_id", "status", "total", "items", "customer", "note"],
    "additionalProperties": False,
    "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string", "minLength": 3},
                                                        "qty": {"type": "integer", "minimum": 1, "multipleOf": 1}},
                       "required": ["sku", "qty"], "additionalProperties": False}},
}


# ---------------------------------------------------------------- helpers


@contextmanager
def simulator(config: dict, tmp_path: Path, name: str = "sim.yaml"):
    """Start `python -m service.simulator` on a free port; yield its base URL; stop it with SIGTERM."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "service.simulator", "--config", str(path), "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, f"simulator did not start: {line!r} {proc.stderr.read()}"
        url = line.split("listening on ", 1)[1].split()[0]
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, proc.stderr.read()


class Client:
    """Keep-alive HTTP/1.1 client on one connection (fast enough for hundreds of calls)."""

    def __init__(self, base: str, key: str | None = None):
        hostport = base.split("//", 1)[1].split("/", 1)[0]
        host, port = hostport.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=10)
        self.key = key

    def request(self, method: str, path: str, body: object = None, headers: dict | None = None,
                raw: bytes | None = None) -> tuple[int, dict, bytes]:
        h = {"content-type": "application/json", **(headers or {})}
        if self.key:
            h["authorization"] = f"Bearer {self.key}"
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        self.conn.request(method, path, body=data, headers=h)
        resp = self.conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()

    def chat(self, body: dict, headers: dict | None = None) -> tuple[int, dict]:
        status, _, data = self.request("POST", "/v1/chat/completions", body, headers)
        return status, json.loads(data)

    def close(self) -> None:
        self.conn.close()


def msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def answer_of(resp: dict) -> tuple:
    """The choice as sent: its content, refusal, tool calls and finish reason."""
    choice = resp["choices"][0]
    m = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return m["content"], m["refusal"], tuple(calls), choice["finish_reason"]


def content_of(resp: dict) -> tuple:
    """What the choice means, whatever its wording: the facts its text states (or its JSON value),
    refusal, tool calls with parsed arguments, and finish reason."""
    content, refusal, calls, finish = answer_of(resp)
    try:
        meaning = json.dumps(json.loads(content), sort_keys=True) if content else content
    except ValueError:
        meaning = tuple(read_facts(content))
    return meaning, refusal, tuple((n, json.dumps(json.loads(a), sort_keys=True)) for n, a in calls), finish


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    with simulator(MAIN_CONFIG, tmp_path_factory.mktemp("sim")) as url:
        yield url


@pytest.fixture
def client(sim):
    c = Client(sim)
    yield c
    c.close()


@pytest.fixture
def sdk(sim):
    return openai.OpenAI(base_url=sim, api_key="unused", max_retries=0, timeout=10)


# ---------------------------------------------------------------- config


def test_example_config_loads():
    cfg = load_simulator_config(ROOT / "examples" / "simulator.yaml")
    assert {"good-model", "new-model", "judge-model"} <= set(cfg.models)
    assert cfg.models["new-model"].segments["tools"].failures == {"invalid_tool_call": pytest.approx(0.15)}


@pytest.mark.parametrize("data, expected", [
    ({"models": {"a": {"failures": {"bogus": 0.1}}}}, "models.a.failures.bogus: unknown key; expected 'auth_error'"),
    ({"models": {"a": {"segments": {"t": {"failures": {"bogus": None}}}}}}, "models.a.segments.t.failures.bogus: unknown key"),
    ({"models": {"a": {"failures": {"timeout": None}}}}, "models.a.failures.timeout: Input should be a valid number"),
    ({"models": {"a": {"failures": {"timeout": 1.5}}}}, "models.a.failures.timeout: Input should be less than or equal to 1"),
    ({"models": {"a": {"latency_s": {"median": 1, "p95": 0.5}}}}, "models.a.latency_s: p95 (0.5) must be >= median (1.0)"),
    ({"models": {"a": {"phases": [{"failures": {"timeout": 0.1}}]}}}, "models.a.phases.0.after_s: required field is missing"),
    ({"models": {"a": {"segments": {"tools": {"divergence": 2}}}}}, "models.a.segments.tools.divergence:"),
    ({"time_scale": -1, "models": {"a": {}}}, "time_scale:"),
    ({"models": {}}, "models: needs at least one model"),
    ({"seed": 1}, "models: required field is missing"),
])
def test_config_errors_name_the_field(tmp_path, data, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_simulator_config(path)
    assert any(line.startswith(expected) for line in err.value.problems), err.value.problems


def test_failure_overrides_resolve_in_order_and_null_keeps_the_base():
    cfg = parse_simulator_config({"models": {"a": {
        "failures": {"timeout": 0.2, "refusal": 0.1},
        "segments": {"tools": {"failures": {"timeout": None, "invalid_tool_call": 0.5}}},
        "phases": [{"after_s": 10, "failures": {"refusal": 0.0}}]}}})
    model = cfg.models["a"]

    def kinds(segment, phases):
        return {k: p for k, p in zip(FAILURE_KINDS, resolve(model, segment, phases).failures, strict=True) if p}

    assert kinds(None, 0) == {"timeout": 0.2, "refusal": 0.1}
    assert kinds("tools", 0) == {"timeout": 0.2, "refusal": 0.1, "invalid_tool_call": 0.5}
    assert kinds("tools", 1) == {"timeout": 0.2, "invalid_tool_call": 0.5}


def test_cli_rejects_bad_config_without_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("models:\n  a: {divergence: 3}\n")
    proc = subprocess.run([sys.executable, "-m", "service.simulator", "--config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "models.a.divergence" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- shapes


def test_models_list_and_openai_sdk_shapes(sdk):
    ids = {m.id for m in sdk.models.list()}
    assert ids == set(MAIN_CONFIG["models"])
    r = sdk.chat.completions.create(model="a", messages=msgs("Hello there"))
    assert r.object == "chat.completion" and r.model == "a" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content and r.choices[0].message.refusal is None
    u = r.usage
    assert u.completion_tokens == estimate_tokens(len(r.choices[0].message.content))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_errors_are_openai_shaped(client, sdk):
    status, body = client.chat({"model": "nope", "messages": msgs("x")})
    assert status == 404
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert set(body["error"]) == {"message", "type", "code", "param"}
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=msgs("x"))
    status, _, data = client.request("POST", "/v1/chat/completions", raw=b'{"model": "a", "messa')
    assert status == 400 and json.loads(data)["error"]["type"] == "invalid_request_error"
    status, body = client.chat({"model": "a"})
    assert status == 400 and body["error"]["param"] == "messages"
    status, _, data = client.request("GET", "/v1/unknown")
    assert status == 404 and "error" in json.loads(data)


def test_embeddings_and_legacy_completions(sdk):
    e1 = sdk.embeddings.create(model="a", input=["hello", "world"])        # the SDK asks for base64
    e2 = sdk.embeddings.create(model="b", input="hello", encoding_format="float")
    assert len(e1.data) == 2 and len(e1.data[0].embedding) == 256
    assert e1.data[0].embedding == pytest.approx(e2.data[0].embedding, abs=1e-6)
    assert sum(x * x for x in e2.data[0].embedding) == pytest.approx(1.0, abs=1e-6)
    c = sdk.completions.create(model="a", prompt="Once upon a time", max_tokens=5)
    assert c.object == "text_completion" and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 5
    chunks = list(sdk.completions.create(model="a", prompt="Once upon a time", max_tokens=5, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text


def test_context_length_exceeded(client):
    status, body = client.chat({"model": "ctx", "messages": msgs("x" * 100)})
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "messages"
    assert client.chat({"model": "ctx", "messages": msgs("short")})[0] == 200


# ---------------------------------------------------------------- determinism and divergence


def test_models_share_content_and_rephrase_it(client):
    reworded = 0
    for i in range(20):
        prompt = msgs(f"Question {i}: what is the refund policy?")
        ra, rb = client.chat({"model": "a", "messages": prompt})[1], client.chat({"model": "b", "messages": prompt})[1]
        again = client.chat({"model": "a", "messages": prompt})[1]
        assert content_of(ra) == content_of(rb) == content_of(again)
        assert len(content_of(ra)[0]) >= 2  # facts, read back from the text
        reworded += answer_of(ra) != answer_of(again)
    assert reworded >= 18  # the same facts, in other words on (nearly) every call: exact match fails
    # different prompts, different content
    answers = {content_of(client.chat({"model": "a", "messages": msgs(f"p{i}")})[1]) for i in range(20)}
    assert len(answers) == 20
    # JSON keeps its values; its layout may change
    asked = {"model": "a", "messages": msgs("json please"), "response_format": {"type": "json_object"}}
    values = {json.dumps(json.loads(client.chat(asked)[1]["choices"][0]["message"]["content"]), sort_keys=True)
              for _ in range(8)}
    assert len(values) == 1


def test_divergence_rate_matches_config(client):
    prompt = msgs("Explain the billing cycle.")
    reference = content_of(client.chat({"model": "a", "messages": prompt})[1])
    n = 400
    differ = sum(content_of(client.chat({"model": "div", "messages": prompt})[1]) != reference for _ in range(n))
    sd = (n * 0.3 * 0.7) ** 0.5
    assert abs(differ - n * 0.3) < 4.5 * sd, differ


def test_same_seed_same_sequence_same_outcomes(tmp_path):
    config = {"seed": 99, "time_scale": 0, "models": MAIN_CONFIG["models"]}
    runs = []
    for k in range(2):
        with simulator(config, tmp_path, f"det{k}.yaml") as url:
            c = Client(url)
            out = []
            for i in range(150):
                status, body = c.chat({"model": "mixed", "messages": msgs(f"q{i % 7}")})
                out.append((status, answer_of(body) if status == 200 else body["error"]["code"]))
            c.close()
            runs.append(out)
    assert runs[0] == runs[1]
    assert len({o for o in runs[0]}) > 7  # failures and divergence did happen


# ---------------------------------------------------------------- JSON mode and tools


def test_json_object_mode(client):
    status, body = client.chat({"model": "a", "messages": msgs("Give me JSON"),
                                "response_format": {"type": "json_object"}})
    assert status == 200
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def test_json_schema_instances_fit(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True}}
    seen = set()
    for i in range(25):
        status, body = client.chat({"model": "a", "messages": msgs(f"order {i}"), "response_format": fmt})
        assert status == 200
        content = body["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), ORDER_SCHEMA)
        seen.add(content)
    assert len(seen) == 25
    # the same prompt gives the same instance on another model
    again = client.chat({"model": "b", "messages": msgs("order 0"), "response_format": fmt})[1]
    first = client.chat({"model": "a", "messages": msgs("order 0"), "response_format": fmt})[1]
    assert json.loads(again["choices"][0]["message"]["content"]) == json.loads(first["choices"][0]["message"]["content"])


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": ["integer", "null"], "minimum": 5, "maximum": 5}}},
    {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "minItems": 2},
    {"allOf": [{"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
               {"properties": {"y": {"const": 3}}, "required": ["y"]}]},
    {"type": "object", "properties": {"tree": {"$ref": "#"}}, "required": []},
    {"oneOf": [{"type": "string", "format": "date-time"}, {"type": "boolean"}]},
    {"type": "integer", "multipleOf": 7, "minimum": 10, "maximum": 30},
    {"type": "string", "minLength": 30, "maxLength": 40},
])
def test_instance_generator_subset(schema):
    import random
    for seed in range(30):
        jsonschema.validate(InstanceGenerator(random.Random(seed), schema).value(schema), schema)


def test_tool_calls_fit_the_schema(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, SEARCH_TOOL)}
    names = set()
    for i in range(30):
        status, body = client.chat({"model": "a", "messages": msgs(f"task {i}"), "tools": [WEATHER_TOOL, SEARCH_TOOL]})
        assert status == 200
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        names.add(call["function"]["name"])
    assert names == {"get_weather", "search"}


def test_tool_choice_named_none_and_after_tool_result(client):
    named = {"type": "function", "function": {"name": "search"}}
    for i in range(5):
        body = client.chat({"model": "a", "messages": msgs(f"t{i}"), "tools": [WEATHER_TOOL, SEARCH_TOOL],
                            "tool_choice": named})[1]
        assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "search"
    body = client.chat({"model": "a", "messages": msgs("t"), "tools": [WEATHER_TOOL], "tool_choice": "none"})[1]
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["content"]
    status, body = client.chat({"model": "a", "messages": msgs("t"), "tools": [WEATHER_TOOL],
                                "tool_choice": {"type": "function", "function": {"name": "missing"}}})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    loop = msgs("weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                               "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = client.chat({"model": "a", "messages": loop, "tools": [WEATHER_TOOL]})[1]
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["content"]
    body = client.chat({"model": "a", "messages": loop, "tools": [WEATHER_TOOL], "tool_choice": "required"})[1]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_segment_overrides(client):
    body = client.chat({"model": "seg", "messages": msgs("x"), "tools": [WEATHER_TOOL]})[1]
    args = body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    with pytest.raises(ValueError):
        json.loads(args)
    body = client.chat({"model": "seg", "messages": msgs("x")})[1]
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["content"]
    body = client.chat({"model": "seg", "messages": msgs("x")}, headers={"x-task-type": "billing"})[1]
    assert body["choices"][0]["message"]["refusal"] and body["choices"][0]["message"]["content"] is None
    body = client.chat({"model": "seg", "messages": msgs("x")}, headers={"x-task-type": "other"})[1]
    assert body["choices"][0]["finish_reason"] == "stop"


# ---------------------------------------------------------------- wrong content and the judge


def test_wrong_content_states_one_wrong_fact_where_configured(client):
    for i in range(10):
        prompt = msgs(f"Where is order {i}?")
        right = content_of(client.chat({"model": "a", "messages": prompt})[1])[0]
        elsewhere = content_of(client.chat({"model": "wrong", "messages": prompt})[1])[0]
        assert elsewhere == right  # wrong_content is set for the billing segment only
        wrong = content_of(client.chat({"model": "wrong", "messages": prompt}, headers={"x-task-type": "billing"})[1])[0]
        assert [(s, a) for s, a, _ in wrong] == [(s, a) for s, a, _ in right]  # same subjects, fluent
        assert sum(x != y for x, y in zip(wrong, right)) == 1                  # one value is not the planted one


def judge_body(model: str, conversation: list, a: dict, b: dict) -> dict:
    from collectors.evaluators.llm_judge import pairwise_request, shown_answer

    return {"model": model, **pairwise_request("rubric", {"messages": conversation}, shown_answer(a), shown_answer(b))}


def winner(client, body: dict) -> str:
    status, answer = client.chat(body)
    assert status == 200
    return json.loads(answer["choices"][0]["message"]["content"])["winner"]


def test_judge_model_prefers_the_planted_facts_in_either_order(client):
    for i in range(10):
        prompt = msgs(f"What is the status of ticket {i}?")
        right = client.chat({"model": "a", "messages": prompt})[1]
        rephrased = client.chat({"model": "b", "messages": prompt})[1]
        wrong = client.chat({"model": "wrong", "messages": prompt}, headers={"x-task-type": "billing"})[1]
        assert winner(client, judge_body("judge", prompt, right, wrong)) == "A"
        assert winner(client, judge_body("judge", prompt, wrong, right)) == "B"
        assert winner(client, judge_body("judge", prompt, right, rephrased)) == "tie"
    # a judge model answers other prompts like any model
    assert content_of(client.chat({"model": "judge", "messages": msgs("hello")})[1]) == \
        content_of(client.chat({"model": "a", "messages": msgs("hello")})[1])


def test_judge_error_rate(client):
    prompt = msgs("What is the refund deadline?")
    right = client.chat({"model": "a", "messages": prompt})[1]
    wrong = client.chat({"model": "wrong", "messages": prompt}, headers={"x-task-type": "billing"})[1]
    n = 300
    off = sum(winner(client, judge_body("noisy-judge", prompt, right, wrong)) != "A" for _ in range(n))
    p = 0.3 * 2 / 3  # a random verdict is the right one a third of the time
    assert abs(off - n * p) < 4.5 * (n * p * (1 - p)) ** 0.5, off


# ---------------------------------------------------------------- failures


def test_http_level_failures(client, sdk):
    status, headers, data = client.request("POST", "/v1/chat/completions", {"model": "f-rate_limited", "messages": msgs("x")})
    assert status == 429 and json.loads(data)["error"]["code"] == "rate_limit_exceeded"
    assert "retry-after" in headers
    with pytest.raises(openai.RateLimitError) as e:
        sdk.chat.completions.create(model="f-quota_exceeded", messages=msgs("x"))
    assert e.value.code == "insufficient_quota"
    with pytest.raises(openai.AuthenticationError):
        sdk.chat.completions.create(model="f-auth_error", messages=msgs("x"))
    statuses = set()
    for _ in range(30):
        status, body = client.chat({"model": "f-provider_5xx", "messages": msgs("x")})
        assert body["error"]["type"] == "server_error"
        statuses.add(status)
    assert statuses == {500, 503}
    # bad_response: 200 with a cut-off JSON body
    status, headers, data = client.request("POST", "/v1/chat/completions", {"model": "f-bad_response", "messages": msgs("x")})
    assert status == 200 and int(headers["content-length"]) == len(data)
    with pytest.raises(ValueError):
        json.loads(data)


def test_timeout_hangs_until_client_gives_up(sim):
    sdk = openai.OpenAI(base_url=sim, api_key="unused", max_retries=0, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        sdk.chat.completions.create(model="f-timeout", messages=msgs("x"))
    assert time.monotonic() - t0 < 5
    # the server is unaffected
    assert sdk.chat.completions.create(model="a", messages=msgs("x")).choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kind, check", [
    ("truncated", lambda m, fr: fr == "length" and m["content"]),
    ("content_filtered", lambda m, fr: fr == "content_filter" and m["content"] == ""),
    ("refusal", lambda m, fr: fr == "stop" and m["refusal"] and m["content"] is None),
    ("empty_output", lambda m, fr: fr == "stop" and m["content"] == ""),
])
def test_model_failures(client, kind, check):
    status, body = client.chat({"model": f"f-{kind}", "messages": msgs("a long enough question")})
    assert status == 200
    choice = body["choices"][0]
    assert check(choice["message"], choice["finish_reason"]), body


def test_invalid_json_and_tool_call_only_where_they_apply(client):
    fmt = {"type": "json_object"}
    body = client.chat({"model": "f-invalid_json", "messages": msgs("x"), "response_format": fmt})[1]
    with pytest.raises(ValueError):
        json.loads(body["choices"][0]["message"]["content"])
    body = client.chat({"model": "f-invalid_json", "messages": msgs("x")})[1]   # not JSON mode: no effect
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["content"]
    body = client.chat({"model": "f-invalid_tool_call", "messages": msgs("x"), "tools": [WEATHER_TOOL]})[1]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    with pytest.raises(ValueError):
        json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    body = client.chat({"model": "f-invalid_tool_call", "messages": msgs("x")})[1]
    assert body["choices"][0]["finish_reason"] == "stop"


# ---------------------------------------------------------------- streaming


def test_streaming_matches_non_streaming(sdk):
    full = sdk.chat.completions.create(model="a", messages=msgs("stream me"))
    chunks = list(sdk.chat.completions.create(model="a", messages=msgs("stream me"), stream=True,
                                              stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) > 3
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert read_facts(streamed) == read_facts(full.choices[0].message.content)  # the same facts, reworded
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    # usage counts this call's own text (another call words the same facts differently)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == estimate_tokens(len(streamed))
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    without = list(sdk.chat.completions.create(model="a", messages=msgs("stream me"), stream=True))
    assert all(c.choices for c in without)


def test_streaming_tool_call_deltas(sdk):
    stream = sdk.chat.completions.create(model="a", messages=msgs("weather"), tools=[WEATHER_TOOL], stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    first = deltas[0].tool_calls[0]
    assert first.id.startswith("call_") and first.function.name == "get_weather" and first.function.arguments == ""
    pieces = [d.tool_calls[0].function.arguments for d in deltas[1:] if d.tool_calls]
    assert len(pieces) > 2 and all(d.tool_calls[0].id is None for d in deltas[1:] if d.tool_calls)
    jsonschema.validate(json.loads("".join(pieces)), WEATHER_TOOL["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streaming_refusal_and_bad_response(sim, sdk):
    chunks = list(sdk.chat.completions.create(model="f-refusal", messages=msgs("x"), stream=True))
    assert "".join(c.choices[0].delta.refusal or "" for c in chunks if c.choices) == REFUSAL_TEXT
    # bad_response while streaming: a few chunks, a cut-off one, then the connection drops
    c = Client(sim)
    with pytest.raises(http.client.IncompleteRead):
        c.request("POST", "/v1/chat/completions", {"model": "f-bad_response", "messages": msgs("x"), "stream": True})
    c.close()


# ---------------------------------------------------------------- HTTP details


def test_pipelining_chunked_upload_and_expect(sim):
    host, port = sim.split("//")[1].split("/")[0].rsplit(":", 1)
    body = json.dumps({"model": "a", "messages": msgs("pipelined")}).encode()
    one = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    last = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(one * 3 + chunked + last)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 5 and data.count(b'"object":"chat.completion"') == 4
    assert data.rstrip().endswith(b"}]}")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200 OK")


def test_time_scale_zero_answers_fast(client):
    t0 = time.monotonic()
    for i in range(300):
        assert client.chat({"model": "b", "messages": msgs(f"fast {i}")})[0] == 200
    assert time.monotonic() - t0 < 1.5


# ---------------------------------------------------------------- api_key, latency, phases


def test_api_key_latency_and_phases(tmp_path):
    with simulator(TIMED_CONFIG, tmp_path) as url:
        started = time.monotonic()
        good = Client(url, key="sk-sim-test")
        # phase 0: the phased model works
        assert good.chat({"model": "phased", "messages": msgs("x")})[0] == 200
        # api key
        anon, wrong = Client(url), Client(url, key="nope")
        status, body = anon.chat({"model": "slow", "messages": msgs("x")})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert wrong.request("GET", "/v1/models")[0] == 401
        assert anon.request("GET", "/healthz")[0] == 200
        # latency: median == p95 == 0.3 s, so every call takes 0.3 s
        t0 = time.monotonic()
        assert good.chat({"model": "slow", "messages": msgs("x")})[0] == 200
        assert 0.27 < time.monotonic() - t0 < 0.8
        # streaming: first content at ttft (0.1 s), the end at the latency (0.3 s)
        sdk = openai.OpenAI(base_url=url, api_key="sk-sim-test", max_retries=0, timeout=5)
        t0 = time.monotonic()
        first = None
        n = 0
        for chunk in sdk.chat.completions.create(model="slow", messages=msgs("y"), stream=True):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - t0
            n += 1
        total = time.monotonic() - t0
        assert 0.08 < first < 0.25 and 0.27 < total < 0.8 and n > 10
        # phase 1 after 2 s of wall clock: provider_5xx always
        assert time.monotonic() - started < 2.0
        time.sleep(max(0.0, 2.05 - (time.monotonic() - started)))
        assert good.chat({"model": "phased", "messages": msgs("x")})[0] in (500, 503)
        for c in (good, anon, wrong):
            c.close()



# ---------------------------------------------------------------- usage agrees with the text


def _usage_cases() -> list[tuple[str, dict]]:
    """(API, request) for text, capped text, JSON, capped JSON, tool calls, refusals and truncations."""
    out: list[tuple[str, dict]] = []
    for i in range(12):
        prompt = msgs(f"Tell me about my account, question {i}")
        for model, extra in [("a", {}), ("a", {"max_tokens": 7}), ("a", {"response_format": {"type": "json_object"}}),
                             ("a", {"response_format": {"type": "json_object"}, "max_tokens": 9}),
                             ("a", {"tools": [WEATHER_TOOL, SEARCH_TOOL]}), ("a", {"tools": [SEARCH_TOOL], "max_tokens": 3}),
                             ("div", {}), ("f-refusal", {}), ("f-truncated", {})]:
            out.append(("chat", {"model": model, "messages": prompt, **extra}))
            out.append(("chat", {"model": model, "messages": prompt, "n": 3, **extra}))
            responses: dict = {"model": model, "input": prompt[0]["content"]}
            messages: dict = {"model": model, "messages": prompt, "max_tokens": extra.get("max_tokens", 4096)}
            if "max_tokens" in extra:
                responses["max_output_tokens"] = extra["max_tokens"]
            if "tools" in extra:
                functions = [t["function"] for t in extra["tools"]]
                responses["tools"] = [{"type": "function", **f} for f in functions]
                messages["tools"] = [{"name": f["name"], "input_schema": f["parameters"]} for f in functions]
            if "response_format" in extra:
                responses["text"] = {"format": {"type": "json_object"}}
            out += [("responses", responses), ("messages", messages)]
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_reported_output_tokens_match_the_text_as_the_proxy_counts_it(client, stream):
    """Every API shape, streamed or not: the output tokens the simulator reports are its answer's
    text counted as the proxy estimates an answer that tells no usage (4 characters a token, every
    choice, a cap that cut the answer counted whole), so benchmarks and the demo cost what they say."""
    from service.proxy.formats import CHAT, MESSAGES, RESPONSES, base

    formats = {"chat": (CHAT, "/v1/chat/completions"), "responses": (RESPONSES, "/v1/responses"),
               "messages": (MESSAGES, "/v1/messages")}
    seen: dict[str, int] = {}
    for api, body in _usage_cases():
        fmt, path = formats[api]
        if stream:
            body = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if api == "chat" else {})}
        status, _, data = client.request("POST", path, body)
        assert status == 200, data
        response = fmt.reassemble(data).response if stream else json.loads(data)
        assert response is not None
        view = fmt.view(body)
        told = fmt.usage(view, response)
        assert not told.estimated, (api, body, response)
        # the proxy takes a Messages answer cut short as cut by the cap: a truncation below it counts its text alone
        below_cap = response.get("stop_reason") == "model_context_window_exceeded"
        assert told.output == base.estimated_output({} if below_cap else view, fmt.chat_view(response)), \
            (api, body, response)
        seen[api] = seen.get(api, 0) + told.output
    assert all(seen.get(api, 0) > 1000 for api in formats), seen
