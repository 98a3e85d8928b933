"""Config loader fuzz (hypothesis): any YAML either loads or fails with ConfigError and clear
'path: reason' lines, never another exception (DESIGN §4: a bad file fails with the field path and
the reason, never a stack trace)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import tempfile

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from service.config import Config, ConfigError, load_config, parse_config

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
LINE = re.compile(r"^\S[^\n]*: \S")

VALID = {
    "server": {"host": "127.0.0.1", "port": 8080, "drain_seconds": 5, "client_keys_env": "KEYS"},
    "providers": {"sim": {"base_url": "http://127.0.0.1:9001/v1", "api_key_env": "SIM_KEY", "timeout_s": 60}},
    "models": {"stable-m": {"provider": "sim", "name": "good-model", "price": {"input_per_mtok": 0.4}},
               "candidate-m": {"provider": "sim", "name": "new-model"}},
    "routes": {"support-bot": {
        "stable": "stable-m", "candidate": "candidate-m",
        "checks": {"json_schema": None, "require_tool_args_valid": True},
        "shadow": {"sample_rate": 0.2, "max_per_minute": 600, "noise_floor": True,
                   "redact": ["builtin:email", r"acct-\d+"]},
        "rollout": {"steps": [1, 5, 25, 50], "min_shadow_samples": 300, "alpha": 0.01,
                    "margins": {"completion_rate": 0.01}, "on_inconclusive": "hold", "mode": "auto"},
        "task_types": ["billing", "search"]}},
    "events": {"backend": "memory", "kafka": {"bootstrap_servers": "127.0.0.1:9092", "topic_prefix": "mc"},
               "spool": {"dir": ".modelcanary/spool", "max_bytes": 1000000}},
    "state_dir": ".modelcanary/state",
    "tracing": {"otlp_endpoint": None, "capture_content": False},
    "notify": {"webhook_url": None},
}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["builtin:email", "builtin:nope", "[unclosed", "(?P<x", "http://h/v1", "ftp://x", "sim",
                     "stable-m", "candidate-m", "kafka", "memory", "hold", "rollback", "advisory", "", "*"]),
)
yaml_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=12), st.integers()), inner, max_size=4)),
    max_leaves=12)


def assert_clear(err: ConfigError) -> None:
    assert isinstance(err.problems, list) and err.problems, err
    for line in err.problems:
        assert isinstance(line, str) and LINE.match(line), repr(line)
        assert "Traceback" not in line and "File \"" not in line, line


def paths(obj, prefix=()):
    """Every path into a nested dict/list (the places a mutation can hit)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, (*prefix, i))


ALL_PATHS = [p for p in paths(VALID) if p]


def test_the_base_config_is_valid():
    assert isinstance(parse_config(copy.deepcopy(VALID)), Config)


@SETTINGS
@given(st.text(max_size=400))
@example("routes: [")
@example("providers: {a: 1}\n  bad indent: x")
@example("!!python/object/apply:os.system ['echo hi']")
@example("a: &x [*x]")
@example("\x00\x01")
@example("- 1\n- 2")
@example("42")
@example("")
def test_any_text_loads_or_fails_clearly(text):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, encoding="utf-8") as f:
        f.write(text)
    try:
        try:
            cfg = load_config(f.name)
        except ConfigError as e:
            assert_clear(e)
        else:
            assert isinstance(cfg, Config)
    finally:
        os.unlink(f.name)


@SETTINGS
@given(yaml_values)
def test_any_yaml_document_loads_or_fails_clearly(data):
    try:
        parse_config(data)
    except ConfigError as e:
        assert_clear(e)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(ALL_PATHS), yaml_values), min_size=1, max_size=4))
def test_mutated_valid_config_loads_or_fails_clearly(mutations):
    """Deep mutations of a valid config reach every validator (references, regexes, steps, ...)."""
    data = copy.deepcopy(VALID)
    for path, value in mutations:
        node = data
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation replaced a parent
    text = yaml.safe_dump(data, allow_unicode=True)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, encoding="utf-8") as f:
        f.write(text)
    try:
        try:
            load_config(f.name)
        except ConfigError as e:
            assert_clear(e)
    finally:
        os.unlink(f.name)


def test_errors_name_the_field_path():
    data = copy.deepcopy(VALID)
    data["routes"]["support-bot"]["shadow"]["redact"] = ["builtin:ssn"]
    data["routes"]["support-bot"]["rollout"]["steps"] = [5, 1]
    data["providers"]["sim"]["timeout_s"] = "soon"
    data["models"]["stable-m"]["provider"] = "nowhere"
    try:
        parse_config(data)
    except ConfigError as e:
        text = "\n".join(e.problems)
    else:
        raise AssertionError("should not load")
    assert "routes.support-bot.shadow.redact: entry 1: unknown built-in pattern 'builtin:ssn'" in text
    assert "routes.support-bot.rollout.steps:" in text
    assert "providers.sim.timeout_s:" in text


def test_check_config_cli_prints_lines_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"providers: {sim: {base_url: nope}}\nmodels: 3\nroutes: {r: {stable: x, surprise: 1}}\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    for path in (bad, binary, tmp_path / "missing.yaml"):
        r = subprocess.run([sys.executable, "-m", "modelcanary", "check-config", str(path)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r
        assert "Traceback" not in r.stderr and r.stderr.strip(), r.stderr
    r = subprocess.run([sys.executable, "-m", "modelcanary", "check-config", str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert "providers.sim.base_url: must be an http(s) URL" in r.stderr
    assert "routes.r.surprise: unknown key" in r.stderr
