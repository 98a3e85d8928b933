"""Golden sets, reproduced faults: credentials and PII that reached a dataset (legacy function
results, camelCase credential keys, an email used as a key), and replay verdicts that did not say
what happened (latencies thrown away at the default concurrency, a candidate that answered nothing,
the checks comparison's source)."""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import openai
import pytest

from collectors.golden import dataset
from collectors.worker import LoopLag
from tests.fixtures.servers import SIM_MODEL, proxy_config, sim_config, write_yaml
from tests.test_golden import ROUTE, admin_lines, captured, chat_request, cli, in_process, wait_for

pytestmark = pytest.mark.timeout(180)
EMAIL = "jane.doe@example.com"


# ---- redaction ---------------------------------------------------------------------------------------------------


def test_capture_parses_and_redacts_legacy_function_results():
    secret = "tok-" + uuid.uuid4().hex
    request = {"functions": [{"name": "login", "parameters": {"type": "object"}}], "messages": [
        {"role": "user", "content": "log me in"},
        {"role": "assistant", "content": None, "function_call": {"name": "login",
                                                                 "arguments": json.dumps({"password": secret})}},
        {"role": "function", "name": "login",
         "content": json.dumps({"password": secret, "session": {"api_key": secret}, "user": "bob"})}]}
    case = captured(request)
    assert secret not in case.model_dump_json(), "a credential of a role=function result is in the dataset"
    assert json.loads(case.request["messages"][2]["content"]) == \
        {"password": "[REDACTED]", "session": {"api_key": "[REDACTED]"}, "user": "bob"}


def test_capture_redacts_credential_keys_whatever_their_case_style():
    secret = "tok-" + uuid.uuid4().hex
    arguments = {"user": "bob", "accessToken": secret, "clientSecret": secret, "API-Key": secret,
                 "privateKey": secret, "max_tokens": 10, "tokens": 3, "token_count": 4}
    request = {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "login", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"refreshToken": secret, "ok": True})}]}
    case = captured(request)
    assert secret not in case.model_dump_json(), "a camelCase credential key kept its value"
    kept = json.loads(case.request["messages"][0]["tool_calls"][0]["function"]["arguments"])
    assert kept == {"user": "bob", "accessToken": "[REDACTED]", "clientSecret": "[REDACTED]",
                    "API-Key": "[REDACTED]", "privateKey": "[REDACTED]", "max_tokens": 10, "tokens": 3,
                    "token_count": 4}
    assert json.loads(case.request["messages"][1]["content"]) == {"refreshToken": "[REDACTED]", "ok": True}


def test_capture_redacts_patterns_in_keys_and_keeps_both_values_when_keys_collide():
    request = {"metadata": {EMAIL: "vip", "bob@example.com": "basic", "plan": "gold"},
               "messages": [{"role": "user", "content": "hello"}]}
    case = captured(request)
    assert EMAIL not in case.model_dump_json(), "an email used as a key is in the dataset"
    assert sorted(case.request["metadata"].values()) == ["basic", "gold", "vip"]
    assert case.request["metadata"]["plan"] == "gold"


def test_a_memory_proxy_redacts_an_email_used_as_a_key_in_the_traffic_event_and_the_dataset(servers, tmp_path):
    token = "adm-" + uuid.uuid4().hex
    sim = servers.simulator()
    cfg = proxy_config(sim.url, shadow={"sample_rate": 1.0, "max_per_minute": 100_000,
                                        "redact": ["builtin:email"]})
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": token})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=20)
    client.chat.completions.create(model=ROUTE, **chat_request(1),
                                   metadata={EMAIL: "vip", "bob@example.com": "basic"})
    traffic = wait_for(lambda: [x for x in admin_lines(proxy.url, token) if x["schema"] == "modelcanary.traffic/v1"],
                       what="the sampled request in the proxy's memory")
    assert EMAIL not in json.dumps(traffic), "the email used as a key left the proxy in the TrafficEvent"
    assert sorted(traffic[0]["request"]["metadata"].values()) == ["basic", "vip"]
    out = tmp_path / "set.jsonl"
    r = cli(["capture", "--config", str(proxy.config_path), "--url", proxy.url, "--out", str(out)],
            {"MODELCANARY_ADMIN_TOKEN": token})
    assert r.returncode == 0, r.stderr
    assert EMAIL not in out.read_text()


# ---- replay ------------------------------------------------------------------------------------------------------


def timed_model(median: float, p95: float) -> dict:
    model = copy.deepcopy(SIM_MODEL)
    model["latency_s"] = {"median": median, "p95": p95}
    return model


def cases_with_checks(path: Path, n: int) -> Path:
    """n chat cases, each with an `expected` check (a pass rate to compare), no live answer needed."""
    dataset.write(path, [dataset.Case(request_id=f"chat-{i:03d}", route=ROUTE, request=chat_request(i),
                                      checks={"expected": "the sea", "min_similarity": 0.0}) for i in range(n)])
    return path


@pytest.fixture
def slow_candidate(servers, tmp_path) -> tuple[Path, Path]:
    """A simulator in real time: the stable model ~0.1 s, the candidate ~0.6 s; 80 cases."""
    sim = servers.simulator(sim_config({"good-model": timed_model(0.1, 0.15), "new-model": timed_model(0.6, 0.8)},
                                       time_scale=1.0))
    config = write_yaml(tmp_path / "replay.yaml", proxy_config(sim.url))  # collect.concurrency: the default
    return cases_with_checks(tmp_path / "golden.jsonl", 80), config


def test_replay_at_the_default_concurrency_keeps_latencies_and_finds_a_slow_candidate_worse(slow_candidate):
    golden, config = slow_candidate
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(config), "--json"])
    result = json.loads(r.stdout)
    route = result["routes"][ROUTE]
    kept = sum(1 for rec in result["records"] if rec["candidate"]["latency_s"] is not None)
    assert kept >= 60, f"only {kept} of 80 candidate latencies kept; {route.get('latency')}"
    latency = next(c for c in route["comparisons"]
                   if c["metric"] == "latency_p95_exceedance" and c["segment"] == "overall")
    assert latency["verdict"] == "worse", latency
    assert r.returncode == 1, r.stderr[-2000:]
    assert route["latency"]["pairs"] >= 40 and set(route["latency"]["discarded"]) == {"candidate", "stable"}
    checks = [c for c in route["comparisons"] if c["metric"] == "checks_pass_rate"]
    assert checks and all(c["source"] == "shadow" for c in checks), checks


def test_replay_says_when_latencies_were_discarded_and_too_few_pairs_are_left(slow_candidate, capsys, monkeypatch):
    """Every latency discarded (as when the machine itself is too busy): the user is told, never silently
    "nothing confidently worse" with no word about latency."""
    golden, config = slow_candidate
    monkeypatch.setattr(LoopLag, "stop", lambda self, latency_s, mark: False)
    code, out, err = in_process(capsys, ["replay", str(golden), "--candidate", "candidate-m", "--config",
                                         str(config)])
    assert f"warning: route {ROUTE}: 0 latency pairs" in err, err[-2000:]
    assert "80 of 80 candidate and 80 of 80 stable latencies were discarded" in err
    assert f"route {ROUTE}: latency pairs 0" in out
    code, out, _ = in_process(capsys, ["replay", str(golden), "--candidate", "candidate-m", "--config",
                                       str(config), "--json"])
    assert json.loads(out)["routes"][ROUTE]["latency"] == \
        {"pairs": 0, "completed": {"candidate": 80, "stable": 80}, "discarded": {"candidate": 80, "stable": 80}}


def test_a_candidate_that_answers_nothing_is_not_compared_rather_than_worse(servers, tmp_path):
    denied = copy.deepcopy(SIM_MODEL)
    denied["failures"] = {"auth_error": 1.0}
    sim = servers.simulator(sim_config({"good-model": copy.deepcopy(SIM_MODEL), "new-model": denied}))
    config = write_yaml(tmp_path / "replay.yaml", proxy_config(sim.url))
    golden = cases_with_checks(tmp_path / "golden.jsonl", 40)
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(config)])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "nothing could be compared" in r.stdout
    assert not [line for line in r.stdout.splitlines() if line.startswith("worse ")], r.stdout[-3000:]
    r = cli(["replay", str(golden), "--candidate", "candidate-m", "--config", str(config), "--json"])
    result = json.loads(r.stdout)
    verdicts = result["routes"][ROUTE]["verdicts"]
    assert result["exit_code"] == 2 and verdicts and set(verdicts.values()) == {"not_compared"}, verdicts
