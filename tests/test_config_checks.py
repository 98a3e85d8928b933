"""What `check-config` and `serve` refuse besides field errors: variables the config names, every
problem at once, the state directory, and a port in use (`simulate` as `serve`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.config import ConfigError, environment_problems, parse_config

ROOT = Path(__file__).resolve().parents[1]
UNSET = "MC_TEST_UNSET_VARIABLE"


def base(**top) -> dict:
    return {
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1"}},
        "models": {"m": {"provider": "p", "name": "x"}, "m2": {"provider": "p", "name": "y"}},
        "routes": {"bot": {"stable": "m", "candidate": "m2"}},
        **top,
    }


def run(tmp_path: Path, *argv: str, config: dict | None = None, env: dict | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess:
    """`modelcanary ARGV`; `config` is written to a file and its path put where ARGV says {config}."""
    path = tmp_path / "c.yaml"
    if config is not None:
        path.write_text(yaml.safe_dump(config))
    full_env = {k: v for k, v in os.environ.items() if k != UNSET} | (env or {})
    return subprocess.run([sys.executable, "-m", "modelcanary", *(a.format(config=path) for a in argv)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=full_env)


def check_config(tmp_path: Path, config: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    return run(tmp_path, "check-config", "{config}", config=config, env=env)


def serve(tmp_path: Path, config: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    return run(tmp_path, "serve", "--config", "{config}", "--port", "0", config=config, env=env, timeout=30)


def assert_refused(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and " ok " not in result.stdout


# ---- 1. check-config checks the Kafka secret variables, as serve does ---------------------------


def test_check_config_reports_an_unset_kafka_secret_variable(tmp_path):
    config = base(events={"backend": "kafka", "kafka": {"security": {"sasl_plain_password_env": UNSET}}})
    assert_refused(check_config(tmp_path, config),
                   f"events.kafka.security.sasl_plain_password_env: environment variable {UNSET!r} is not set")


# ---- 2. server.client_keys_env must give at least one key ---------------------------------------

CLIENT_KEYS = [
    (None, f"server.client_keys_env: environment variable {UNSET!r} is not set"),
    ("", f"server.client_keys_env: environment variable {UNSET!r} holds no keys"),
    (" ; ;", f"server.client_keys_env: environment variable {UNSET!r} holds no keys"),
    ("ck-secret-1=bot;=bot", f"server.client_keys_env: entry 2 of environment variable {UNSET!r} has no key"),
]


@pytest.mark.parametrize("value,expected", CLIENT_KEYS, ids=["unset", "empty", "only-separators", "empty-key"])
@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_client_keys_that_give_no_key_are_refused(tmp_path, command, value, expected):
    config = base(server={"client_keys_env": UNSET})
    env = {} if value is None else {UNSET: value}
    result = check_config(tmp_path, config, env) if command == "check-config" else serve(tmp_path, config, env)
    assert_refused(result, expected)
    assert "ck-secret-1" not in result.stderr + result.stdout


def test_only_the_proxy_needs_the_client_keys(monkeypatch):
    """Shadow workers and the controller (`collect`, `control`) never read client keys: their pods
    need not carry the variable."""
    monkeypatch.delenv(UNSET, raising=False)
    config = parse_config(base(server={"client_keys_env": UNSET}))
    assert environment_problems(config, proxy=False) == []
    assert environment_problems(config, proxy=True) == [
        f"server.client_keys_env: environment variable {UNSET!r} is not set"]


def test_client_keys_that_give_a_key_pass(tmp_path):
    result = check_config(tmp_path, base(server={"client_keys_env": UNSET}), {UNSET: "k1=bot;k2=*"})
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


# ---- 3. rate margins are fractions; steps are numbers -------------------------------------------

RATE_MARGINS = ["completion_rate", "model_failure_rate", "client_retry_rate", "task_success_rate",
                "latency_p95_exceedance", "agreement_gap", "similarity_gap", "judge_preference", "stability_gap"]


@pytest.mark.parametrize("margin", RATE_MARGINS)
def test_a_rate_margin_above_one_is_refused(margin):
    data = base()
    data["routes"]["bot"]["rollout"] = {"margins": {margin: 1.5}}
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.problems == [f"routes.bot.rollout.margins.{margin}: Input should be less than or equal to 1 "
                                "(got 1.5)"]


def test_margins_at_their_bounds_pass():
    data = base()
    data["routes"]["bot"]["rollout"] = {"margins": {**{m: 1 for m in RATE_MARGINS}, "cost_per_completion_ratio": 3}}
    margins = parse_config(data).routes["bot"].rollout.margins
    assert margins.completion_rate == 1.0 and margins.cost_per_completion_ratio == 3.0


@pytest.mark.parametrize("rollout,expected", [
    ({"steps": [True, 50]}, "routes.bot.rollout.steps.0: Input should be a valid number (got True)"),
    ({"steps": [1, "50"]}, "routes.bot.rollout.steps.1: Input should be a valid number (got '50')"),
    ({"margins": {"completion_rate": True}},
     "routes.bot.rollout.margins.completion_rate: Input should be a valid number (got True)"),
    # all the live traffic on the candidate: no stable outcomes in the step's windows, so no verdict ever
    ({"steps": [50, 100]}, "routes.bot.rollout.steps: a step of 100% leaves no stable traffic to judge the "
                           "candidate against; promotion, after the last step, sends it all the traffic"),
])
def test_steps_and_margins_are_numbers_not_booleans(rollout, expected):
    data = base()
    data["routes"]["bot"]["rollout"] = rollout
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.problems == [expected]


# ---- 4. every problem at once: reference problems besides field errors and unknown keys ---------


def test_check_config_prints_reference_problems_with_field_errors(tmp_path):
    data = base(server={"colour": "blue"})
    data["routes"]["bot"] = {"stable": "m", "candidate": "nope", "rollout": {"steps": [1, 200]}}
    data["models"]["m2"]["provider"] = "ghost"
    result = check_config(tmp_path, data)
    assert result.returncode == 1, result.stdout
    lines = result.stderr.splitlines()
    assert lines == [
        "server.colour: unknown key",
        "routes.bot.rollout.steps.1: Input should be less than or equal to 100 (got 200)",
        "models.m2.provider: unknown provider 'ghost'",
        "routes.bot.candidate: unknown model 'nope'",
        f"{tmp_path / 'c.yaml'}: 4 problem(s)",
    ], result.stderr


def test_load_config_reports_them_too():
    data = base()
    data["routes"]["bot"]["candidate"] = "nope"
    data["routes"]["bot"]["shadow"] = {"sample_rate": 2}
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.problems == ["routes.bot.shadow.sample_rate: Input should be less than or equal to 1 (got 2)",
                                "routes.bot.candidate: unknown model 'nope'"]


@pytest.mark.parametrize("route", [
    # a field the reference checks read is itself invalid: they would only guess
    {"stable": "m", "candidates": ["m2", 7], "rollout": {"scope": "segment"}},
    {"stable": "m", "candidate": "m2", "rollout": {"scope": "segments", "select": "best"}},
    {"candidate": "m2"},  # stable is missing
])
def test_no_reference_guesses_when_their_own_fields_are_invalid(route):
    data = base()
    data["routes"]["bot"] = route
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert len(e.value.problems) == 1, e.value.problems
    assert "unknown model" not in e.value.problems[0] and "several candidates" not in e.value.problems[0]


def test_the_second_pass_leaves_the_callers_data_alone():
    data = base(server={"port": "eighty"})
    data["routes"]["bot"]["candidate"] = "nope"
    before = yaml.safe_dump(data)
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.problems == ["server.port: Input should be a valid integer, unable to parse string as an integer "
                                "(got 'eighty')", "routes.bot.candidate: unknown model 'nope'"]
    assert yaml.safe_dump(data) == before


# ---- 6. serve refuses a state directory it cannot write -----------------------------------------


def test_serve_refuses_a_state_dir_it_cannot_write(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    state_dir = blocker / "state"
    result = serve(tmp_path, base(state_dir=str(state_dir)))
    assert_refused(result, f"state_dir: cannot create or write the directory {str(state_dir)!r}")


def test_check_config_does_not_touch_the_state_dir(tmp_path):
    state_dir = tmp_path / "not-yet"
    result = check_config(tmp_path, base(state_dir=str(state_dir)))
    assert result.returncode == 0, result.stderr
    assert not state_dir.exists()


# ---- 7. simulate on a port in use: one line, exit 3, as serve ------------------------------------


def test_simulate_on_a_port_in_use_says_so_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(tmp_path, "simulate", "--config", "examples/simulator.yaml", "--port", str(port), timeout=30)
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR:") and "[Errno 98]" in lines[0], result.stderr


def test_serve_on_an_address_it_cannot_have_says_so_in_one_line_before_starting_anything(tmp_path):
    """Named by where it came from (the flag or `server.host`/`server.port`), exit 3, and no shadow
    child or controller started on the way."""
    result = run(tmp_path, "serve", "--config", "{config}", "--host", "no-such-host.invalid", "--port", "0",
                 config=base(state_dir=str(tmp_path / "state")), timeout=30)
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip() == ("error: cannot listen on --host no-such-host.invalid, --port 0: "
                                     "Name or service not known"), result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(tmp_path, "serve", "--config", "{config}", timeout=30, config=base(
            state_dir=str(tmp_path / "state"), server={"host": "127.0.0.1", "port": port}))
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip() == f"error: cannot listen on server.host 127.0.0.1, server.port {port}: " \
                                    "Address already in use", result.stderr


# ---- 5. URLs that can't be called, and values that must not be shown ---------------------------------


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/v1", "http://127.0.0.1:0/v1", "http://127.0.0.1:x/v1",
                                 "http:///v1", "ftp://host/v1"])
def test_a_base_url_the_proxy_could_never_call_is_a_config_error(url):
    """They passed check-config, then `serve` died with a traceback ("Port out of range")."""
    data = base()
    data["providers"]["p"]["base_url"] = url
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.problems == [f"providers.p.base_url: must be an http(s) URL with a host and a valid port, "
                                f"got {url!r}"]


def test_config_errors_never_show_a_secret():
    data = base(events={"backend": "kafka", "kafka": {"security": {"sasl_plain_password": 98765432123}}})
    data["providers"]["p"]["base_url"] = "htp://user:sk-in-the-url-42@host/v1"
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    text = "\n".join(e.value.problems)
    assert "98765432123" not in text and "sk-in-the-url-42" not in text, text
    assert e.value.problems == [
        "providers.p.base_url: must be an http(s) URL with a host and a valid port, got 'htp://***@host/v1'",
        "events.kafka.security.sasl_plain_password: Input should be a valid string",
    ]


# ---- 8. what check-config passed and serve then tripped on, or showed -------------------------------


def with_(path: str, value: object, data: dict | None = None) -> dict:
    """`base()` with the dotted `path` set to `value`."""
    data = data or base()
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return data


KAFKA = {"backend": "kafka", "kafka": {}}


@pytest.mark.parametrize(("path", "value", "expected"), [
    ("providers.p.base_url", "http://[::1/v1", "providers.p.base_url: must be an http(s) URL with a host and a valid "
                                               "port, got 'http://[::1/v1'"),
    ("providers.p.base_url", "https://host/v1?api-key=SECRET-Q 1", "providers.p.base_url: must be an http(s) URL "
                                                                   "with a host and a valid port, got 'https://host/v1?…'"),
    ("tracing.otlp_endpoint", "ftp://user:SECRET-PW@host:99", "tracing.otlp_endpoint: must be an http(s) URL with a "
                                                              "host and a valid port, got one whose scheme 'ftp' is not"),
    ("events", {**KAFKA, "kafka": {"bootstrap_servers": "127.0.0.1:notaport"}},
     "events.kafka.bootstrap_servers: must be HOST:PORT, or several of them comma-separated"),
    ("events", {**KAFKA, "kafka": {"security": {"sasl_mechanism": "BOGUS"}}},
     "events.kafka.security.sasl_mechanism: Input should be 'PLAIN', 'GSSAPI'"),
    ("providers.p.api_key_env", "sk-proj-SECRET-K", "providers.p.api_key_env: must name an environment variable"),
    ("server.client_keys_env", "k1=bot;SECRET-C=*", "server.client_keys_env: must name an environment variable"),
    ("routes. ", {"stable": "m"}, "routes: name ' ' is empty or has spaces around it"),
    ("models.m.name", "", "models.m.name: String should have at least 1 character"),
    ("routes.bot.task_types", ["billing", "billing"], "routes.bot.task_types: task type 'billing' is listed twice"),
    ("control.interval_s", 60, "control.interval_s: Input should be less than or equal to 5"),
    ("routes.bot.task_types", ["a b", "ok", "c d"], "routes.bot.task_types: entry 1: task type 'a b' must be 1-64 "
                                                     "chars of letters, digits, '_', '.', '-'; entry 3: task type 'c d'"),
])
def test_what_would_fail_at_run_time_is_a_config_error_that_shows_no_secret(path, value, expected):
    with pytest.raises(ConfigError) as e:
        parse_config(with_(path, value))
    text = "\n".join(e.value.problems)
    assert expected in text and "SECRET" not in text, text


def test_deeply_nested_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("[" * 500 + "]" * 500)
    result = run(tmp_path, "check-config", str(path))
    assert result.returncode == 1 and "(yaml) nested too deeply" in result.stderr and "Traceback" not in result.stderr


def test_kafka_tls_files_and_the_spool_directory_are_checked_before_serving(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    data = base(events={"backend": "kafka", "kafka": {"security": {"ssl_cafile": str(tmp_path / "no-ca.pem")}},
                        "spool": {"dir": str(blocker / "spool")}})
    result = serve(tmp_path, data)  # check-config may run where the files are not mounted: serve checks them
    assert_refused(result, f"events.kafka.security.ssl_cafile: {str(tmp_path / 'no-ca.pem')!r} is not a readable file")
    data["events"]["kafka"]["security"]["ssl_cafile"] = str(blocker)
    assert_refused(check_config(tmp_path, data),
                   f"events.spool.dir: cannot create or write the directory {str(blocker / 'spool')!r}")
    assert_refused(serve(tmp_path, data), "events.spool.dir: cannot create or write the directory")
