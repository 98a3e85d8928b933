"""Golden sets (issue 18): capture live traffic from a memory-mode proxy and from Kafka, with
redaction and no credentials in the file; curate; replay a candidate offline against the
simulator and gate on the exit code; compare with a live rollout's report."""

from __future__ import annotations

import copy
import json
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

from collectors.golden import capture as capturing
from collectors.golden import dataset
from collectors.golden import replay as replaying
from collectors.golden.verdicts import against_live, per_segment
from service.bus.kafka import read_topic
from service.config import parse_config
from service.records import PrimaryResult, TrafficEvent
from tests.fixtures.servers import CLI, ROOT, SIM_MODEL, proxy_config, sim_config, write_yaml

pytestmark = pytest.mark.timeout(300)
ROUTE = "support-bot"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def cli(args: list[str], env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def in_process(capsys, args: list[str]) -> tuple[int, str, str]:
    """The same command without a new interpreter (exit code, stdout, stderr): for the quick ones."""
    from modelcanary.compose import main

    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def tool_request(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is the weather in city number {i}?"}], "tools": WEATHER,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


def chat_request(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Tell me fact number {i} about the sea."}]}


def admin_lines(url: str, token: str) -> list[dict]:
    req = urllib.request.Request(url + "/admin/traffic", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return [json.loads(line) for line in r.read().splitlines() if line.strip()]


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


# ---- capture from a memory-mode proxy, with planted secrets ------------------------------------------------


def test_capture_from_memory_proxy_redacts_and_keeps_no_credential(servers, tmp_path, capsys, monkeypatch):
    tag = uuid.uuid4().hex
    secrets = {"client key": "sk-client-" + tag, "provider key": "sk-provider-" + uuid.uuid4().hex,
               "admin token": "adm-" + uuid.uuid4().hex, "pasted key": "sk-live-" + uuid.uuid4().hex,
               "body credential": "body-" + uuid.uuid4().hex}
    pii = {"email": f"jane.{tag[:8]}@example.com", "account": "acct-734201"}
    sim_cfg = sim_config()
    sim_cfg["api_key"] = secrets["provider key"]
    sim = servers.simulator(sim_cfg)
    cfg = proxy_config(sim.url, shadow={"sample_rate": 1.0, "max_per_minute": 100_000,
                                        "redact": ["builtin:email", r"acct-\d{6}"]})
    cfg["providers"]["sim"]["api_key_env"] = "SIM_PROVIDER_KEY"
    cfg["server"] = {"client_keys_env": "MC_CLIENT_KEYS", "admin_token_env": "MC_ADMIN"}
    cfg["control"] = {"interval_s": 0.5, "report_interval_s": 0.5}
    env = {"SIM_PROVIDER_KEY": secrets["provider key"], "MODELCANARY_ADMIN_TOKEN": secrets["admin token"],
           "MC_CLIENT_KEYS": f"{secrets['client key']}=*"}
    proxy = servers.proxy(cfg, env=env | {"MC_ADMIN": secrets["admin token"]})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=secrets["client key"], max_retries=0, timeout=20)
    started = time.time()
    ids: dict[str, str] = {}   # request id -> segment
    for i in range(12):
        r = client.chat.completions.with_raw_response.create(model=ROUTE, **tool_request(i))
        ids[r.headers["x-request-id"]] = "tools"
        body = chat_request(i)
        if i == 0:  # PII, a pasted key and a credential field in the body: none may reach the dataset
            body["messages"][0]["content"] += (f" I am {pii['email']}, account {pii['account']}, "
                                               f"my key is {secrets['pasted key']}")
        r = client.chat.completions.with_raw_response.create(
            model=ROUTE, **body, extra_body={"metadata": {"api_key": secrets["body credential"]}} if i == 0 else None)
        ids[r.headers["x-request-id"]] = "chat"
    for i in range(3):  # the same questions again: deduplicated by fingerprint
        client.chat.completions.create(model=ROUTE, **chat_request(5 + i), stream=i == 0)
    rated = list(ids)[:2]
    for rid, success in zip(rated, (True, False)):
        req = urllib.request.Request(proxy.url + "/v1/feedback", method="POST", headers={
            "Authorization": f"Bearer {secrets['client key']}", "Content-Type": "application/json"},
            data=json.dumps({"request_id": rid, "success": success,  # the client's words hold PII too
                             "reason": f"refund to {pii['email']}, {pii['account']}; {secrets['pasted key']}"}).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status in (200, 202)
    wait_for(lambda: sum(1 for x in admin_lines(proxy.url, secrets["admin token"])
                         if x["schema"] == "modelcanary.outcome/v1") >= 2, what="feedback in the proxy's memory")
    assert sum(1 for x in admin_lines(proxy.url, secrets["admin token"])
               if x["schema"] == "modelcanary.traffic/v1") == 27
    reasons = [x["reason"] for x in admin_lines(proxy.url, secrets["admin token"]) if x.get("kind") == "feedback"]
    assert len(reasons) == 2 and all("[REDACTED]" in r and pii["email"] not in r and pii["account"] not in r
                                     for r in reasons), reasons

    monkeypatch.delenv("MODELCANARY_ADMIN_TOKEN", raising=False)
    code, _, err = in_process(capsys, ["capture", "--config", str(proxy.config_path), "--url", proxy.url, "--out",
                                       str(tmp_path / "x.jsonl")])
    assert code == 1 and "HTTP 401" in err and "set MC_ADMIN or MODELCANARY_ADMIN_TOKEN" in err, err

    everything = tmp_path / "all.jsonl"
    r = cli(["capture", "--config", str(proxy.config_path), "--url", proxy.url, "--out", str(everything),
             "--since", "1h"], env)
    assert r.returncode == 0, r.stderr
    assert "24 cases from 27 sampled requests" in r.stdout and "3 duplicates" in r.stdout, r.stdout
    cases = dataset.load(everything)
    assert {c.request_id: c.segment for c in cases} == ids  # each case traces back to its live request
    assert all(c.live is not None and c.live.body and c.config_version for c in cases)
    feedback = {c.request_id: c.feedback.success for c in cases if c.feedback is not None}
    assert feedback == {rated[0]: True, rated[1]: False}

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    capped = tmp_path / "capped.jsonl"
    code, out, _ = in_process(capsys, ["capture", "--config", str(proxy.config_path), "--url", proxy.url, "--out",
                                       str(capped), "--per-segment", "5"])
    assert code == 0 and "14 over the per-segment cap" in out, out
    assert {s: sum(1 for c in dataset.load(capped) if c.segment == s) for s in ("tools", "chat")} == \
        {"tools": 5, "chat": 5}
    before = tmp_path / "before.jsonl"
    code, out, err = in_process(capsys, ["capture", "--config", str(proxy.config_path), "--url", proxy.url, "--out",
                                         str(before), "--until", str(started - 1)])
    assert code == 1 and "0 cases from" in out and "no case to write" in err and not before.exists(), (out, err)
    code, _, err = in_process(capsys, ["capture", "--config", str(proxy.config_path), "--out", str(before),
                                       "--since", "yesterday"])
    assert code == 2 and "--since: 'yesterday' is not a time" in err

    code, out, _ = in_process(capsys, ["dataset", "stats", str(everything)])
    assert code == 0 and "24 cases, 0 with checks" in out and "tools" in out

    text = everything.read_text() + capped.read_text()
    for name, secret in {**secrets, **pii}.items():
        assert secret not in text, f"{name} is in the dataset"
    assert "[REDACTED]" in text

    # bridge to live: the same candidate, offline and in the proxy's own shadow rollout
    def live_overall() -> bool:
        body = json.loads(urllib.request.urlopen(urllib.request.Request(
            proxy.url + f"/admin/rollouts/{ROUTE}/report",
            headers={"Authorization": f"Bearer {secrets['admin token']}"}), timeout=10).read())
        judged = ((body["report"] or {}).get("judge") or {}).get("comparisons") or []
        return any(c["segment"] == "overall" for c in judged)

    wait_for(live_overall, 60, "the live judge's comparisons of the shadow records")
    r = cli(["replay", str(everything), "--candidate", "candidate-m", "--config", str(proxy.config_path), "--json",
             "--against-report", proxy.url], env)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    rows = {a["segment"]: a for a in result["routes"][ROUTE]["against_report"]}
    assert rows["overall"]["offline"] == result["routes"][ROUTE]["verdicts"]["overall"]
    assert rows["overall"]["live"] in ("worse", "within", "inconclusive")
    code, _, err = in_process(capsys, ["replay", str(everything), "--candidate", "stable-m", "--config",
                                       str(proxy.config_path), "--against-report", proxy.url])
    assert code == 2 and "canaries 'candidate-m', not 'stable-m'" in err


# ---- capture's redaction: tool-call arguments (JSON in a string) and schemas -------------------------------


def captured(request: dict, body: dict | None = None) -> dataset.Case:
    """One sampled request (and its live answer) through `capture`'s selection, with `builtin:email`."""
    config = parse_config(proxy_config("http://127.0.0.1:9", shadow={"sample_rate": 1.0,
                                                                      "redact": ["builtin:email"]}))
    live = PrimaryResult(model="stable-m", status=200, body=body, latency_s=0.1, outcome="completed")
    event = TrafficEvent(request_id="r1", ts=time.time(), route=ROUTE, segment="tools", request=request,
                         primary=live, config_version="v1")
    sel = capturing.select([event], config)
    assert len(sel.cases) == 1
    return sel.cases[0]


def arguments_of(case_part: dict, *path) -> str:
    value: object = case_part
    for key in path:
        value = value[key]  # type: ignore[index]
    assert isinstance(value, str), f"{path}: the arguments are no longer a JSON string: {value!r}"
    return value


def test_a_case_says_when_its_live_usage_was_estimated():
    """A stream the upstream told no usage for: the case's live usage is a guess, and says so."""
    case = captured({"model": ROUTE, "messages": [{"role": "user", "content": "hi"}]})
    assert case.live is not None and not case.live.usage_estimated
    config = parse_config(proxy_config("http://127.0.0.1:9", shadow={"sample_rate": 1.0}))
    live = PrimaryResult(model="stable-m", status=200, latency_s=0.1, outcome="completed", usage_estimated=True,
                         usage={"prompt_tokens": 9, "completion_tokens": 3})
    event = TrafficEvent(request_id="r1", ts=time.time(), route=ROUTE, segment="chat", primary=live,
                         request={"model": ROUTE, "messages": [{"role": "user", "content": "hi"}]}, config_version="v1")
    [case] = capturing.select([event], config).cases
    assert case.live is not None and case.live.usage_estimated and case.live.usage == live.usage


def test_a_case_keeps_the_anthropic_headers_its_request_came_with_and_replays_them(tmp_path):
    config = parse_config(proxy_config("http://127.0.0.1:9", shadow={"sample_rate": 1.0}))
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "output-128k-2025-02-19"}
    live = PrimaryResult(model="stable-m", status=200, body=None, latency_s=0.1, outcome="completed")
    event = TrafficEvent(request_id="r1", ts=time.time(), route=ROUTE, segment="chat", headers=headers,
                         request={"model": ROUTE, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]},
                         primary=live, config_version="v1")
    path = tmp_path / "set.jsonl"
    dataset.write(path, capturing.select([event], config).cases)
    [case] = dataset.load(path)
    assert case.headers == headers
    assert replaying._event(case, "stable-m", "v2").headers == headers


def test_capture_redacts_credentials_inside_tool_call_arguments_of_requests_and_answers():
    secret, key = "hunter2-" + uuid.uuid4().hex, "sk-live-" + uuid.uuid4().hex
    chat = {"messages": [
        {"role": "user", "content": "log me in"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "login", "arguments": json.dumps({"password": secret, "city": "Paris"})}},
            {"id": "c2", "type": "function",   # nested, in a list, with an email for the route's pattern
             "function": {"name": "sync", "arguments": json.dumps(
                 {"accounts": [{"user": "jane@example.com", "auth": {"api_key": secret}}]})}},
            {"id": "c3", "type": "function",   # not JSON: kept as text, with the text patterns
             "function": {"name": "raw", "arguments": f"key={key}"}},
            {"id": "c4", "type": "function",   # nothing to redact: the very same text
             "function": {"name": "weather", "arguments": '{"city":  "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"session": {"secret": secret}, "ok": True})}],
        "tools": WEATHER}
    answer = {"id": "x", "object": "chat.completion", "model": "good-model", "choices": [
        {"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c5", "type": "function",
             "function": {"name": "login", "arguments": json.dumps({"user": "bob", "password": secret})}}]}}]}
    case = captured(chat, answer)
    text = case.model_dump_json()
    assert secret not in text and key not in text and "jane@example.com" not in text

    calls = case.request["messages"][1]["tool_calls"]
    assert json.loads(arguments_of(calls[0], "function", "arguments")) == {"password": "[REDACTED]", "city": "Paris"}
    assert json.loads(arguments_of(calls[1], "function", "arguments")) == \
        {"accounts": [{"user": "[REDACTED]", "auth": {"api_key": "[REDACTED]"}}]}
    assert arguments_of(calls[2], "function", "arguments") == "key=[REDACTED]"
    assert arguments_of(calls[3], "function", "arguments") == '{"city":  "Paris"}'
    assert json.loads(case.request["messages"][2]["content"]) == {"session": {"secret": "[REDACTED]"}, "ok": True}
    assert case.live is not None and case.live.body is not None
    message = case.live.body["choices"][0]["message"]
    assert json.loads(arguments_of(message, "tool_calls", 0, "function", "arguments")) == \
        {"user": "bob", "password": "[REDACTED]"}

    # the Responses API (function_call items, their outputs) and a streamed Anthropic tool_use's text input
    responses = {"input": [
        {"type": "function_call", "call_id": "c1", "name": "login", "arguments": json.dumps({"password": secret})},
        {"type": "function_call_output", "call_id": "c1", "output": json.dumps({"access_token": secret})}]}
    answer = {"object": "response", "output": [
        {"type": "function_call", "call_id": "c2", "name": "login", "arguments": json.dumps({"Password": secret})}]}
    case = captured(responses, answer)
    assert secret not in case.model_dump_json()
    assert json.loads(arguments_of(case.request, "input", 0, "arguments")) == {"password": "[REDACTED]"}
    assert json.loads(arguments_of(case.request, "input", 1, "output")) == {"access_token": "[REDACTED]"}
    assert case.live is not None and case.live.body is not None
    assert json.loads(arguments_of(case.live.body, "output", 0, "arguments")) == {"Password": "[REDACTED]"}
    anthropic = {"max_tokens": 100, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "login", "input": {"password": secret}},
        {"type": "tool_use", "id": "t2", "name": "login", "input": json.dumps({"password": secret})}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": json.dumps({"client_secret": secret})}]}]}
    case = captured(anthropic)
    assert secret not in case.model_dump_json()
    blocks = case.request["messages"][0]["content"]
    assert blocks[0]["input"] == {"password": "[REDACTED]"}
    assert json.loads(arguments_of(blocks[1], "input")) == {"password": "[REDACTED]"}
    assert json.loads(arguments_of(case.request["messages"][1]["content"][0], "content")) == \
        {"client_secret": "[REDACTED]"}


def test_capture_keeps_tool_schemas_with_credential_named_properties_as_valid_schemas():
    from jsonschema import Draft202012Validator

    def schema() -> dict:
        return {"type": "object", "required": ["user", "password"], "properties": {
            "user": {"type": "string", "description": "the login, e.g. jane@example.com"},
            "password": {"type": "string", "minLength": 8},
            "api_key": {"type": "string"}, "secret": {"type": "object", "properties": {"token": {"type": "string"}}}}}

    def cleaned(s: dict) -> dict:  # the schema as capture keeps it: only the email in a description goes
        s = copy.deepcopy(s)
        s["properties"]["user"]["description"] = "the login, e.g. [REDACTED]"
        return s

    chat = {"messages": [{"role": "user", "content": "log me in"}],
            "tools": [{"type": "function", "function": {"name": "login", "parameters": schema()}}],
            "functions": [{"name": "login", "parameters": schema()}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "creds", "schema": schema()}},
            "metadata": {"password": "p-" + uuid.uuid4().hex}}   # data outside the schemas is still redacted
    case = captured(chat)
    request = case.request
    for got in (request["tools"][0]["function"]["parameters"], request["functions"][0]["parameters"],
                request["response_format"]["json_schema"]["schema"]):
        assert got == cleaned(schema())
        Draft202012Validator.check_schema(got)
    assert request["metadata"] == {"password": "[REDACTED]"}

    responses = {"input": "log me in", "tools": [{"type": "function", "name": "login", "parameters": schema()}],
                 "text": {"format": {"type": "json_schema", "name": "creds", "schema": schema()}}}
    echo = {"object": "response", "output": [], "tools": copy.deepcopy(responses["tools"]),
            "text": copy.deepcopy(responses["text"])}   # a Responses answer echoes the tools and the format
    case = captured(responses, echo)
    assert case.live is not None and case.live.body is not None
    for got in (case.request["tools"][0]["parameters"], case.request["text"]["format"]["schema"],
                case.live.body["tools"][0]["parameters"], case.live.body["text"]["format"]["schema"]):
        assert got == cleaned(schema())
        Draft202012Validator.check_schema(got)

    anthropic = {"max_tokens": 100, "messages": [{"role": "user", "content": "log me in"}],
                 "tools": [{"name": "login", "input_schema": schema()}],
                 "output_format": {"type": "json_schema", "schema": schema()}}
    case = captured(anthropic)
    for got in (case.request["tools"][0]["input_schema"], case.request["output_format"]["schema"]):
        assert got == cleaned(schema())
        Draft202012Validator.check_schema(got)


# ---- capture from Kafka ---------------------------------------------------------------------------------------


def test_capture_from_kafka_with_feedback_by_request_and_by_session(kafka_broker, servers, tmp_path):
    prefix = "golden" + uuid.uuid4().hex[:8]
    sim = servers.simulator()
    cfg = proxy_config(sim.url, shadow={"sample_rate": 1.0, "max_per_minute": 100_000, "redact": ["builtin:email"]})
    cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": kafka_broker.bootstrap,
                                                   "topic_prefix": prefix, "partitions": 2}}
    proxy = servers.proxy(cfg)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=20)
    ids = []
    for i in range(6):
        body = tool_request(i) if i % 2 else chat_request(i)
        if i == 0:
            body["messages"][0]["content"] += " write to bob@example.org"
        r = client.chat.completions.with_raw_response.create(model=ROUTE, **body,
                                                             extra_headers={"x-session-id": f"s{i // 3}"})
        ids.append(r.headers["x-request-id"])
    for body in ({"request_id": ids[0], "success": False}, {"session_id": "s1", "success": True}):
        req = urllib.request.Request(proxy.url + "/v1/feedback", method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status in (200, 202)
    wait_for(lambda: len(read_topic(kafka_broker.bootstrap, f"{prefix}.traffic", timeout_s=5)) >= 6, 60,
             "traffic on the topic")
    wait_for(lambda: sum(1 for v in read_topic(kafka_broker.bootstrap, f"{prefix}.outcomes", timeout_s=5)
                         if v.get("kind") == "feedback") >= 2, 60, "feedback on the topic")

    out = tmp_path / "kafka.jsonl"
    r = cli(["capture", "--config", str(proxy.config_path), "--out", str(out)])
    assert r.returncode == 0, r.stderr
    assert f"Kafka {kafka_broker.bootstrap} ({prefix}.traffic)" in r.stdout
    cases = {c.request_id: c for c in dataset.load(out)}
    assert set(cases) == set(ids)
    assert [cases[i].segment for i in ids] == ["chat", "tools"] * 3
    # by request id; and by session: the session's latest request before the feedback
    assert {rid: c.feedback.success for rid, c in cases.items() if c.feedback} == {ids[0]: False, ids[5]: True}
    assert "bob@example.org" not in out.read_text()


# ---- replay against the simulator -------------------------------------------------------------------------------


def golden_set(sim_url: str, path: Path, n: int = 35) -> Path:
    """n tool and n chat cases, answered live by the stable model (good-model), some with checks."""
    client = openai.OpenAI(base_url=sim_url + "/v1", api_key="k", max_retries=0, timeout=20)
    cases = []
    for i in range(n):
        for segment, request in (("tools", tool_request(i)), ("chat", chat_request(i))):
            started = time.perf_counter()
            answer = client.chat.completions.create(model="good-model", **request).model_dump(exclude_none=True)
            checks = {"tool_call": {"name": "get_weather", "arguments": {"city": ".+"}}} \
                if segment == "tools" else None
            cases.append(dataset.Case(
                request_id=f"{segment}-{i}", ts=time.time(), route=ROUTE, segment=segment, request=request,
                live={"model": "stable-m", "status": 200, "body": answer, "latency_s": time.perf_counter() - started,
                      "outcome": "completed"}, checks=checks, tags=["typical"]))
    dataset.write(path, cases)
    return path


@pytest.fixture
def replay_setup(servers, tmp_path):
    breaks_tools = copy.deepcopy(SIM_MODEL)
    breaks_tools["segments"] = {"tools": {"failures": {"invalid_tool_call": 0.7}}}
    sim = servers.simulator(sim_config({"good-model": copy.deepcopy(SIM_MODEL), "new-model": breaks_tools}))
    config = write_yaml(tmp_path / "replay.yaml", proxy_config(sim.url))
    return golden_set(sim.url, tmp_path / "golden.jsonl"), config


def test_replay_of_a_tool_breaking_candidate_fails_the_build_with_evidence(replay_setup):
    golden, config = replay_setup
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(config)])
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])
    out = r.stdout
    assert "replay: something is confidently worse (exit 1)" in out
    assert "worse segment tools: invalid_tool_call rate" in out  # the evidence, with its numbers
    assert "worse segment tools: case checks pass rate" in out
    assert "worse segment chat" not in out
    assert "replay: evaluated 70/70 cases" in r.stderr  # plain progress lines when not on a terminal


def test_replay_of_the_stable_model_against_itself_passes(replay_setup):
    golden, config = replay_setup
    r = cli(["replay", str(golden), "--candidate", "stable-m", "--config", str(config), "--repeats", "3", "--json"])
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    route = result["routes"][ROUTE]
    assert result["exit_code"] == 0 and route["cases"] == 70 and "worse" not in route["verdicts"].values()
    comparisons = route["comparisons"]
    metrics = {c["metric"] for c in comparisons}
    assert {"checks_pass_rate", "stability_gap", "similarity_gap"} <= metrics
    for c in comparisons:
        lo, hi = c["interval"]
        no_effect = 1.0 if c["unit"] == "ratio" else 0.0
        assert lo <= no_effect <= hi, c
    repro = result["repro"]
    assert {"agreement", "stability", "checks"} <= set(repro["evaluator_versions"])
    assert set(repro["models"]) == {"stable-m"}  # candidate and noise floor: the same model
    assert repro["models"]["stable-m"]["served"] == ["good-model"] and repro["params"]["stability_k"] == 3
    assert repro["boundary"] == "fixed" and len(repro["dataset"]["sha256"]) == 64
    assert len(result["records"]) == 70 and all(rec["stable_again"] for rec in result["records"])


def test_replay_stability_asks_the_stable_model_now_not_its_recorded_answer(servers, tmp_path):
    """A golden set recorded from an older stable version: its live answers all say something else.
    Stability is about the model now, so the recorded answer is no part of the stable side's."""
    steady = copy.deepcopy(SIM_MODEL)
    steady["divergence"] = 0.0  # same content on every call, in its own wording
    sim = servers.simulator(sim_config({"good-model": steady, "new-model": steady}))
    older = {"id": "chatcmpl-old", "object": "chat.completion", "created": 1, "model": "good-model",
             "choices": [{"index": 0, "finish_reason": "stop", "message": {
                 "role": "assistant", "content": "Our office opens at nine and parking is behind the library."}}],
             "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}}
    cases = [dataset.Case(request_id=f"chat-{i}", ts=time.time(), route=ROUTE, segment="chat", request=chat_request(i),
                          live={"model": "stable-m", "status": 200, "body": older, "latency_s": 0.1,
                                "outcome": "completed"}) for i in range(12)]
    golden = tmp_path / "older.jsonl"
    dataset.write(golden, cases)
    config = write_yaml(tmp_path / "replay.yaml", proxy_config(sim.url))
    r = cli(["replay", str(golden), "--candidate", "stable-m", "--config", str(config), "--repeats", "3", "--json"])
    assert r.returncode == 0, r.stderr[-3000:]
    records = json.loads(r.stdout)["records"]
    assert max(rec["similarity"]["candidate_vs_stable"] for rec in records) < 0.6  # the recorded answer differs
    stable = [rec["stability"]["stable"] for rec in records]
    candidate = [rec["stability"]["candidate"] for rec in records]
    assert min(stable) > 0.8, stable  # with the recorded answer in: about 0.4
    assert abs(sum(stable) - sum(candidate)) / len(stable) < 0.05, (stable, candidate)


# ---- bad input --------------------------------------------------------------------------------------------------


def test_a_malformed_dataset_is_refused_naming_the_line_and_field(tmp_path, capsys):
    good = dataset.line_of(dataset.Case(request_id="a", route=ROUTE, request=chat_request(1)))
    lines = [good, good.replace('"a"', '"b"'), '{"request_id": "c", "route": ', good.replace('"a"', '"d"'),
             json.dumps({"request_id": "e", "route": ROUTE, "checks": {"tool_call": {"arguments": {"x": "("}}}}),
             good]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = write_yaml(tmp_path / "c.yaml", proxy_config("http://127.0.0.1:9"))
    r = cli(["replay", str(path), "--candidate", "candidate-m", "--config", str(config)])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "line 3: not JSON" in r.stderr
    assert "line 5: request: required field is missing" in r.stderr
    assert "line 5: checks.tool_call.name: required field is missing" in r.stderr
    assert "line 5: checks.tool_call.arguments: argument 'x': invalid regex" in r.stderr
    assert "line 6: request_id: 'a' is already the case on line 1" in r.stderr
    ok = tmp_path / "ok.jsonl"
    ok.write_text(good + "\n")
    code, _, err = in_process(capsys, ["replay", str(ok), "--candidate", "nope", "--config", str(config)])
    assert code == 2 and "--candidate: 'nope' is not a model of the config" in err
    code, _, err = in_process(capsys, ["replay", str(ok), "--candidate", "candidate-m", "--config", str(config),
                                       "--repeats", "0"])
    assert code == 2 and "--repeats: must be 1 (no stability) to 10" in err
    mixed = proxy_config("http://127.0.0.1:9")
    mixed["providers"]["claude"] = {"base_url": "http://127.0.0.1:9/v1", "api": "anthropic"}
    mixed["models"]["claude-m"] = {"provider": "claude", "name": "claude"}
    code, _, err = in_process(capsys, ["replay", str(ok), "--candidate", "claude-m", "--config",
                                       str(write_yaml(tmp_path / "mixed.yaml", mixed))])
    assert code == 2 and "--candidate: no route of the dataset can be replayed against it: route 'support-bot': " \
        "stable 'stable-m' is served by an api: openai" in err, err
    code, _, err = in_process(capsys, ["dataset", "stats", str(path)])
    assert code == 2 and "line 3" in err
    # what replay would send or read as a number, refused when the file is read
    odd = [good.replace('"a"', '"h1"').replace('"request":', '"headers":{"host":"evil"},"request":'),
           good.replace('"a"', '"h2"').replace('"request":', '"headers":{"anthropic-beta":"x\\r\\nhost: evil"},"request":'),
           good.replace('"a"', '"u1"').replace('"request":', '"live":{"model":"stable-m","status":200,"latency_s":0.1,'
                                              '"usage":{"prompt_tokens":"x"},"outcome":"completed"},"request":')]
    path.write_text("\n".join(odd) + "\n")
    code, _, err = in_process(capsys, ["dataset", "stats", str(path)])
    assert code == 2, err
    assert "line 1: headers: 'host': only the client's anthropic-* headers are repeated" in err, err
    assert "line 2: headers: 'anthropic-beta': the value has a line break" in err, err
    assert "line 3: live: usage.prompt_tokens must be a whole number of tokens, got 'x'" in err, err


def test_text_with_unicode_line_separators_is_read_back_as_written(tmp_path):
    """capture writes JSON without escaping U+2028 / U+0085 (ensure_ascii=False); they are no line ends."""
    cases = [dataset.Case(request_id="ls", route=ROUTE, request={"messages": [
        {"role": "user", "content": "first line\u2028second line\u0085third\r\n"}]}),
             dataset.Case(request_id="two", route=ROUTE, request=chat_request(2))]
    path = tmp_path / "ls.jsonl"
    assert dataset.write(path, cases) == 2
    assert "\u2028" in path.read_text(encoding="utf-8")
    back = dataset.load(path)
    assert [c.request for c in back] == [c.request for c in cases]


def test_replay_refuses_a_case_in_no_segment_and_leaves_out_routes_on_another_api(tmp_path, capsys):
    """A case whose segment the route does not know would count in no verdict: refused, naming it. A
    dataset captured from routes on two APIs replays the routes the candidate can serve, saying which it
    leaves out; --route picks routes."""
    cfg = proxy_config(unreachable_url())
    cfg["providers"]["claude"] = {"base_url": unreachable_url() + "/v1", "api": "anthropic", "max_retries": 0}
    cfg["models"]["claude-m"] = {"provider": "claude", "name": "claude"}
    cfg["routes"]["claude"] = {"stable": "claude-m"}
    config = str(write_yaml(tmp_path / "two.yaml", cfg))
    typo = tmp_path / "typo.jsonl"
    dataset.write(typo, [dataset.Case(request_id="t", route=ROUTE, segment="tool", request=tool_request(1))])
    code, _, err = in_process(capsys, ["replay", str(typo), "--candidate", "candidate-m", "--config", config])
    assert code == 2 and "case 1: segment: 'tool' is not a segment of route 'support-bot'; its segments: billing, " \
        "search, tools, json, long_context, multi_turn, chat" in err, err
    both = tmp_path / "both.jsonl"
    claude = {"model": "claude", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    dataset.write(both, [*(dataset.Case(request_id=f"c{i}", route=ROUTE, request=chat_request(i)) for i in range(3)),
                         dataset.Case(request_id="a1", route="claude", request=claude)])
    code, out, err = in_process(capsys, ["replay", str(both), "--candidate", "candidate-m", "--config", config])
    assert "replay: route claude left out: stable 'claude-m' is served by an api: anthropic provider" in err, err
    assert code == 2 and f"route {ROUTE}: no case got an answer from the candidate" in err  # replayed (nobody answers)
    code, _, err = in_process(capsys, ["replay", str(both), "--candidate", "candidate-m", "--config", config,
                                       "--route", "claude"])
    assert code == 2 and "--candidate: route 'claude': stable 'claude-m' is served by an api: anthropic" in err, err
    code, _, err = in_process(capsys, ["replay", str(both), "--candidate", "candidate-m", "--config", config,
                                       "--route", "nope"])
    assert code == 2 and "--route: 'nope' is not a route of the config" in err, err


def test_a_replay_that_fails_exits_2_never_1(tmp_path, capsys, monkeypatch, caplog):
    """Exit 1 says "confidently worse": a CI gate must never read a crash as a verdict."""
    from collectors.golden import commands

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(commands, "run", broken)
    golden = chat_cases(tmp_path / "golden.jsonl")
    config = write_yaml(tmp_path / "c.yaml", proxy_config(unreachable_url()))
    code, _, _ = in_process(capsys, ["replay", str(golden), "--candidate", "candidate-m", "--config", str(config)])
    assert code == 2 and "the replay failed; no verdict" in caplog.text


def test_segment_verdicts_and_where_offline_and_live_differ():
    offline = per_segment([{"segment": "tools", "verdict": "worse"}, {"segment": "tools", "verdict": "within"},
                           {"segment": "overall", "verdict": "within"}, {"segment": "chat", "verdict": "within"},
                           {"segment": "chat", "verdict": "inconclusive"}])
    assert offline == {"overall": "within", "chat": "inconclusive", "tools": "worse"}
    report = {"report": {"judge": {"comparisons": [{"segment": "overall", "verdict": "within"},
                                                   {"segment": "tools", "verdict": "within"},
                                                   {"segment": "json", "verdict": "inconclusive"}]}}}
    rows = {a.segment: a.differs for a in against_live(offline, report, "candidate-m")}
    assert rows == {"overall": False, "chat": True, "json": True, "tools": True}


# ---- a real model -------------------------------------------------------------------------------------------------


def test_replay_a_dozen_cases_against_a_real_model(llama_server, tmp_path):
    config = write_yaml(tmp_path / "llama.yaml", {
        "providers": {"llama": {"base_url": llama_server.base_url, "timeout_s": 120, "max_retries": 1}},
        "models": {"small": {"provider": "llama", "name": llama_server.chat_model},
                   "terse": {"provider": "llama", "name": llama_server.chat_model,
                             "system_prompt": "Answer in as few words as possible."}},
        "routes": {ROUTE: {"stable": "small", "shadow": {"stability": {"sample_rate": 0.0}}}},
        "collect": {"concurrency": 2},
    })
    questions = ["What is 2 + 2?", "What colour is the sky?", "Name a fruit.", "What is the capital of France?",
                 "How many legs has a cat?", "Say hello.", "What is water made of?", "Name a planet.",
                 "What day comes after Monday?", "What is 10 minus 3?", "Name an animal that swims.",
                 "What do bees make?"]
    client = llama_server.openai_client()
    cases = []
    for i, q in enumerate(questions):
        request = {"messages": [{"role": "user", "content": q}], "max_tokens": 16, "temperature": 0}
        answer = client.chat.completions.create(model=llama_server.chat_model, **request)
        cases.append(dataset.Case(request_id=f"q{i}", route=ROUTE, request=request,
                                  live={"model": "small", "status": 200, "body": answer.model_dump(exclude_none=True),
                                        "latency_s": 0.5, "outcome": "completed"},
                                  checks={"expected": "4"} if i == 0 else None))
    golden = tmp_path / "real.jsonl"
    dataset.write(golden, cases)
    r = cli(["replay", str(golden), "--candidate", "terse", "--config", str(config), "--json"], timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]  # a dozen cases: too few for any confident verdict
    result = json.loads(r.stdout)
    records = result["records"]
    assert len(records) == 12
    assert all(rec["candidate"]["cause"] in (None, "max_tokens") for rec in records), records
    assert sum(rec["candidate"]["outcome"] == "completed" for rec in records) >= 6
    assert any(rec["similarity"]["candidate_vs_stable"] is not None for rec in records)
    assert any(e["name"] == "checks" for e in records[0]["evaluations"])
    assert result["repro"]["models"]["terse"]["served"]  # the version the server reported
    assert set(result["routes"][ROUTE]["verdicts"].values()) <= {"inconclusive", "within"}


# ---- replay that cannot compare anything -------------------------------------------------------------------------


def unreachable_url() -> str:
    from tests.fixtures.servers import free_port

    return f"http://127.0.0.1:{free_port()}"


def chat_cases(path: Path, n: int = 6) -> Path:
    dataset.write(path, [dataset.Case(request_id=f"chat-{i}", route=ROUTE, request=chat_request(i))
                         for i in range(n)])
    return path


def test_replay_with_every_call_unanswered_exits_2_naming_both_sides(tmp_path):
    golden = chat_cases(tmp_path / "golden.jsonl")
    config = write_yaml(tmp_path / "down.yaml", proxy_config(unreachable_url()))
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(config)])
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])  # not 0: a CI gate must not pass
    assert "Traceback" not in r.stderr and "nothing confidently worse" not in r.stdout
    assert "replay: nothing could be compared on a route: see the error (exit 2)" in r.stdout
    error = next(line for line in r.stderr.splitlines() if line.startswith("error:"))
    assert f"route {ROUTE}: no case got an answer from the candidate 'candidate-m'" in error
    assert "nor from the stable 'stable-m'" in error
    assert error.count("connection_error on 6 of 6 calls") == 2
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(config), "--json"])
    assert r.returncode == 2
    result = json.loads(r.stdout)
    assert result["exit_code"] == 2
    assert [(u["role"], u["cause"]) for u in result["routes"][ROUTE]["unanswered"]] == \
        [("candidate", "connection_error"), ("stable", "connection_error")]


def test_replay_with_every_case_skipped_by_the_spend_cap_exits_2(tmp_path):
    """A cap already spent asks no model at all: that is nothing compared, not "nothing worse"."""
    golden = chat_cases(tmp_path / "golden.jsonl")
    config = write_yaml(tmp_path / "capped.yaml",
                        proxy_config(unreachable_url(), shadow={"max_usd_per_hour": 0}))
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(config)])
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert "nothing confidently worse" not in r.stdout and "Traceback" not in r.stderr, r.stderr[-2000:]
    error = next(line for line in r.stderr.splitlines() if line.startswith("error:"))
    assert f"route {ROUTE}: every case was skipped (shadow.max_usd_per_hour reached: 6)" in error
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(config), "--json"])
    result = json.loads(r.stdout)
    assert (r.returncode, result["exit_code"], result["routes"][ROUTE]["skipped"]) == \
        (2, 2, {"shadow.max_usd_per_hour reached": 6})


def test_replay_with_only_the_candidate_unanswered_exits_2_naming_the_candidate(servers, tmp_path):
    sim = servers.simulator()
    cfg = proxy_config(sim.url)
    cfg["providers"]["down"] = {"base_url": unreachable_url() + "/v1", "timeout_s": 5, "connect_timeout_s": 2,
                                "max_retries": 1}
    cfg["models"]["candidate-m"]["provider"] = "down"
    config = write_yaml(tmp_path / "half.yaml", cfg)
    golden = chat_cases(tmp_path / "golden.jsonl")
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(config)])
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    error = next(line for line in r.stderr.splitlines() if line.startswith("error:"))
    assert "the candidate 'candidate-m' (provider down: connection_error on 6 of 6 calls)" in error
    assert "stable" not in error
    # the stable model against itself on the same cases: answered, so nothing to refuse
    r = cli(["replay", str(golden), "--candidate", "stable-m", "--config", str(config)])
    assert r.returncode == 0, r.stderr[-2000:]


# ---- against a live report, with several routes and candidates -----------------------------------------------------


def test_replay_against_report_compares_only_the_routes_that_canary_the_candidate(servers, tmp_path, capsys,
                                                                                 monkeypatch):
    token = "adm-" + uuid.uuid4().hex
    env = {"MODELCANARY_ADMIN_TOKEN": token}
    sim = servers.simulator()
    shadow = {"sample_rate": 1.0, "max_per_minute": 100_000}
    cfg = proxy_config(sim.url, shadow=shadow)
    cfg["models"]["other-m"] = {"provider": "sim", "name": "good-model"}
    cfg["routes"]["billing-bot"] = {"stable": "stable-m", "candidate": "other-m", "shadow": shadow}
    cfg["control"] = {"interval_s": 0.5, "report_interval_s": 0.5}
    proxy = servers.proxy(cfg, env=env)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=20)
    for i in range(8):
        for route in (ROUTE, "billing-bot"):
            client.chat.completions.create(model=route, **chat_request(i))

    def reported(route: str) -> bool:
        req = urllib.request.Request(proxy.url + f"/admin/rollouts/{route}/report",
                                     headers={"Authorization": f"Bearer {token}"})
        return bool(json.loads(urllib.request.urlopen(req, timeout=10).read())["report"])

    wait_for(lambda: reported(ROUTE) and reported("billing-bot"), 60, "live reports of both routes")
    golden = tmp_path / "all.jsonl"
    r = cli(["capture", "--config", str(proxy.config_path), "--url", proxy.url, "--out", str(golden)], env)
    assert r.returncode == 0, r.stderr
    assert {c.route for c in dataset.load(golden)} == {ROUTE, "billing-bot"}

    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(proxy.config_path),
             "--against-report", proxy.url], env)
    assert r.returncode in (0, 1), r.stderr[-3000:]  # judged, not refused
    assert ("route billing-bot: not compared against a live report: its live rollout canaries 'other-m', not "
            "'candidate-m'") in r.stdout
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(proxy.config_path), "--json",
             "--against-report", proxy.url], env)
    routes = json.loads(r.stdout)["routes"]
    assert routes[ROUTE]["against_report"] and routes[ROUTE]["against_report_skipped"] is None
    assert routes["billing-bot"]["against_report"] is None
    assert "canaries 'other-m'" in routes["billing-bot"]["against_report_skipped"]

    monkeypatch.delenv("MODELCANARY_ADMIN_TOKEN", raising=False)  # replay has no --token: the hint names the variable
    code, _, err = in_process(capsys, ["replay", str(golden), "--candidate", "candidate-m", "--config",
                                       str(proxy.config_path), "--against-report", proxy.url])
    assert code == 2 and "HTTP 401" in err and "(set MODELCANARY_ADMIN_TOKEN)" in err and "--token" not in err, err
    # a capture that selects nothing leaves the curated file as it was
    before = golden.read_bytes()
    r = cli(["capture", "--config", str(proxy.config_path), "--url", proxy.url, "--out", str(golden),
             "--since", "2000-01-01T00:00:00Z", "--until", "2000-01-02T00:00:00Z"], env)
    assert r.returncode == 1 and f"no case to write; {golden} was not written" in r.stderr, r.stderr
    assert golden.read_bytes() == before
    r = cli(["capture", "--config", str(proxy.config_path), "--url", proxy.url, "--out", str(golden),
             "--since", "1h", "--until", "2h"], env)
    assert r.returncode == 2 and "--since 1h is not before --until 2h" in r.stderr, r.stderr
    assert golden.read_bytes() == before

    monkeypatch.setenv("MODELCANARY_ADMIN_TOKEN", token)
    code, _, err = in_process(capsys, ["replay", str(golden), "--candidate", "stable-m", "--config",
                                       str(proxy.config_path), "--against-report", proxy.url])
    assert code == 2 and "no route of the dataset canaries 'stable-m' live" in err
    assert "route billing-bot: its live rollout canaries 'other-m'" in err
    assert "route support-bot: its live rollout canaries 'candidate-m'" in err
