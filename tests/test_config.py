"""The config file and `modelcanary check-config` (DESIGN §4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for d in ("examples", "service/demo/configs") for p in (ROOT / d).rglob("*.yaml")
                  if "simulator" not in p.name)


def check_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", "check-config", str(path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_examples_pass_check_config(path):
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_minimal_config_gets_every_default(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1"}},
        "models": {"m": {"provider": "p", "name": "x"}},
        "routes": {"r": {"stable": "m"}},
    }))
    config = load_config(path)
    assert config.server.port == 8080 and config.server.max_body_bytes == 10485760
    assert config.events.backend == "memory" and config.events.kafka.topic_prefix == "modelcanary"
    assert config.routes["r"].rollout.steps == [1, 5, 25, 50] and config.routes["r"].rollout.alpha == 0.01
    assert config.routes["r"].shadow.sample_rate == 0.2 and config.tracing.capture_content is False


BROKEN = [
    ({"routes": {"support-bot": {"stable": "x"}}}, "routes.support-bot.stable: unknown model 'x'"),
    ({"routes": {"support-bot": {"stable": "m", "candidate": "nope"}}}, "routes.support-bot.candidate: unknown model 'nope'"),
    ({"models": {"m": {"provider": "ghost", "name": "x"}}}, "models.m.provider: unknown provider 'ghost'"),
    ({"server": {"port": "eighty"}}, "server.port:"),
    ({"server": {"colour": "blue"}}, "server.colour: unknown key"),
    ({"routes": {"support-bot": {"stable": "m", "rollout": {"steps": [5, 1]}}}}, "routes.support-bot.rollout.steps:"),
    ({"routes": {"support-bot": {"stable": "m", "shadow": {"sample_rate": 2}}}}, "routes.support-bot.shadow.sample_rate:"),
    ({"providers": {"p": {"base_url": "ftp://x"}}}, "providers.p.base_url:"),
    ({"events": {"backend": "redis"}}, "events.backend:"),
]


@pytest.mark.parametrize("change,expected", BROKEN, ids=[e for _, e in BROKEN])
def test_check_config_names_the_field(tmp_path, change, expected):
    base = {
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1"}},
        "models": {"m": {"provider": "p", "name": "x"}},
        "routes": {"support-bot": {"stable": "m"}},
    }
    for key, value in change.items():
        base[key] = {**base.get(key, {}), **value}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(base))
    result = check_config(path)
    assert result.returncode == 1
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(ConfigError):
        load_config(path)


def test_missing_file_and_bad_yaml(tmp_path):
    result = check_config(tmp_path / "absent.yaml")
    assert result.returncode == 1 and "file not found" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("providers: [unclosed\n")
    result = check_config(bad)
    assert result.returncode == 1 and "line" in result.stderr and "Traceback" not in result.stderr


def test_serve_refuses_a_bad_config_with_the_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"providers": {}, "models": {}, "routes": {"r": {"stable": "m"}}}))
    result = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--config", str(path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 1
    assert "routes.r.stable: unknown model 'm'" in result.stderr and "Traceback" not in result.stderr
