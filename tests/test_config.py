"""The config file and `modelcanary check-config` (DESIGN §4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.config import ConfigError, load_config, read_yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for d in ("examples", "service/demo/configs") for p in (ROOT / d).rglob("*.yaml")
                  if "simulator" not in p.name)


def check_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modelcanary", "check-config", str(path)], capture_output=True,
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
    shadow, margins = config.routes["r"].shadow, config.routes["r"].rollout.margins
    assert (shadow.similarity.backend, shadow.similarity.model, shadow.similarity.agree_at) == ("local", None, 0.8)
    assert (shadow.stability.sample_rate, shadow.stability.k, shadow.judge) == (0.05, 3, None)
    assert (margins.similarity_gap, margins.judge_preference, margins.stability_gap) == (0.05, 0.05, 0.05)


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
    ({"events": {"kafka": {"security": {"sasl_plain_pasword": "x"}}}},
     "events.kafka.security.sasl_plain_pasword: unknown key"),
    ({"events": {"kafka": {"security": {"security_protocol": "SASL_TLS"}}}}, "events.kafka.security.security_protocol:"),
    ({"events": {"kafka": {"security": {"ssl_password": "x", "ssl_password_env": "X"}}}},
     "events.kafka.security: ssl_password and ssl_password_env are both set"),
    # several candidates (rollout.scope: segment)
    ({"models": {"m2": {"provider": "p", "name": "y"}},
      "routes": {"support-bot": {"stable": "m", "candidates": ["m2", "nope"], "rollout": {"scope": "segment"}}}},
     "routes.support-bot.candidates.1: unknown model 'nope'"),
    ({"models": {"m2": {"provider": "p", "name": "y"}, "m3": {"provider": "p", "name": "z"}},
      "routes": {"support-bot": {"stable": "m", "candidates": ["m2", "m3"]}}},
     "routes.support-bot.candidates: several candidates need rollout.scope: segment"),
    ({"models": {"m2": {"provider": "p", "name": "y"}},
      "routes": {"support-bot": {"stable": "m", "candidate": "m2", "rollout": {"select": "cheapest"}}}},
     "routes.support-bot.rollout.select: chooses among several candidates"),
    ({"models": {"m2": {"provider": "p", "name": "y"}, "m3": {"provider": "p", "name": "z"}},
      "routes": {"support-bot": {"stable": "m", "candidate": "m3", "candidates": ["m2"]}}},
     "routes.support-bot.candidate: give candidate (one model) or candidates (a list), not both"),
    ({"models": {"m2": {"provider": "p", "name": "y"}},
      "routes": {"support-bot": {"stable": "m", "candidates": ["m2", "m2"], "rollout": {"scope": "segment"}}}},
     "routes.support-bot.candidates.1: 'm2' is listed twice"),
    ({"routes": {"support-bot": {"stable": "m", "candidatez": ["m"]}}}, "routes.support-bot.candidatez: unknown key"),
    ({"routes": {"support-bot": {"stable": "m", "rollout": {"scope": "segments"}}}},
     "routes.support-bot.rollout.scope: Input should be 'route' or 'segment'"),
    # answer quality: similarity backend, pairwise judge, margins
    ({"routes": {"support-bot": {"stable": "m", "shadow": {"similarity": {"backend": "model", "model": "emb"}}}}},
     "routes.support-bot.shadow.similarity.model: unknown model 'emb'"),
    ({"routes": {"support-bot": {"stable": "m", "shadow": {"similarity": {"backend": "model"}}}}},
     "routes.support-bot.shadow.similarity: backend 'model' needs `model`"),
    ({"routes": {"support-bot": {"stable": "m", "shadow": {"similarity": {"model": "m"}}}}},
     "routes.support-bot.shadow.similarity: `model` is only used with backend: model"),
    ({"routes": {"support-bot": {"stable": "m", "shadow": {"similarity": {"backend": "onnx"}}}}},
     "routes.support-bot.shadow.similarity.backend: Input should be 'local' or 'model'"),
    ({"routes": {"support-bot": {"stable": "m", "shadow": {"similarity": {"agree_at": 1.5}}}}},
     "routes.support-bot.shadow.similarity.agree_at:"),
    ({"routes": {"support-bot": {"stable": "m", "shadow": {"judge": {"model": "m", "mode": "single"}}}}},
     "routes.support-bot.shadow.judge.mode: Input should be 'pairwise'"),
    ({"routes": {"support-bot": {"stable": "m", "rollout": {"margins": {"judge_preference": -1}}}}},
     "routes.support-bot.rollout.margins.judge_preference:"),
    ({"routes": {"support-bot": {"stable": "m", "checks": {"json_schema": {"type": "nonsense"}}}}},
     "routes.support-bot.checks.json_schema: not a valid JSON schema"),
    ({"providers": {"claude": {"base_url": "http://127.0.0.1:1/v1", "api": "anthropic"}},
      "models": {"sonnet": {"provider": "claude", "name": "claude-sonnet"}},
      "routes": {"support-bot": {"stable": "m", "shadow": {"judge": {"model": "sonnet"}}}}},
     "routes.support-bot.shadow.judge.model: the judge 'sonnet' is served by an api: anthropic provider"),
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


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    """YAML keeps the last of two equal keys: a model defined twice would silently lose one."""
    path = tmp_path / "twice.yaml"
    path.write_text("providers: {p: {base_url: 'http://127.0.0.1:1/v1'}}\n"
                    "models:\n  m: {provider: p, name: x}\n  m: {provider: p, name: y}\n"
                    "routes: {support-bot: {stable: m}}\n")
    result = check_config(path)
    assert result.returncode == 1 and "line 4, column 3: key 'm' is given twice" in result.stderr, result.stderr
    merged = tmp_path / "merged.yaml"  # a merge key's keys may be given again: that is what it is for
    merged.write_text("base: &p {base_url: 'http://127.0.0.1:1/v1', timeout_s: 5}\n"
                      "providers: {p: {<<: *p, timeout_s: 9}}\nmodels: {m: {provider: p, name: x}}\n"
                      "routes: {support-bot: {stable: m}}\n")
    assert read_yaml(merged)["providers"]["p"]["timeout_s"] == 9


def test_check_config_refuses_a_state_dir_serve_could_not_write_without_creating_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1"}}, "models": {"m": {"provider": "p", "name": "x"}},
        "routes": {"support-bot": {"stable": "m"}}, "state_dir": str(blocker / "state")}))
    result = check_config(path)
    assert result.returncode == 1 and "state_dir: cannot create or write the directory" in result.stderr, result.stderr
    fine = tmp_path / "fine.yaml"
    fine.write_text(path.read_text().replace(str(blocker / "state"), str(tmp_path / "new" / "state")))
    assert check_config(fine).returncode == 0 and not (tmp_path / "new").exists()


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
    result = subprocess.run([sys.executable, "-m", "modelcanary", "serve", "--config", str(path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 1
    assert "routes.r.stable: unknown model 'm'" in result.stderr and "Traceback" not in result.stderr


def test_check_config_says_which_providers_forward_the_clients_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {"own-key": {"base_url": "http://127.0.0.1:1/v1", "api_key_env": "PATH"},
                      "no-env": {"base_url": "http://127.0.0.1:1/v1"},
                      "unset": {"base_url": "http://127.0.0.1:1/v1", "api_key_env": "MC_TEST_UNSET_KEY"}},
        "models": {"m": {"provider": "own-key", "name": "x"}},
        "routes": {"r": {"stable": "m"}},
    }))
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: provider no-env has no api_key_env: each client's own Authorization header is forwarded to it",
        "note: provider unset has api_key_env MC_TEST_UNSET_KEY, which is not set: "
        "each client's own Authorization header is forwarded to it",
    ]


def test_check_config_says_which_rollouts_can_never_leave_shadow_on_their_own(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1", "api_key_env": "PATH"}},
        "models": {"m": {"provider": "p", "name": "x"}, "n": {"provider": "p", "name": "y"}},
        "routes": {"off": {"stable": "m", "candidate": "n", "shadow": {"sample_rate": 0}},
                   "skip": {"stable": "m", "candidate": "n", "shadow": {"sample_rate": 0},
                            "rollout": {"min_shadow_samples": 0}},
                   "on": {"stable": "m", "candidate": "n"}},
    }))
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("note:")] == [
        "note: route off: shadow.sample_rate is 0, so the 300 shadow samples of rollout.min_shadow_samples never "
        "come and the judge never moves the rollout out of shadow: promote it by hand, or set "
        "rollout.min_shadow_samples: 0"]


def test_check_config_says_which_candidates_cost_cant_be_compared(tmp_path):
    price = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1", "api_key_env": "PATH"}},
        "models": {"self-hosted": {"provider": "p", "name": "x"}, "self-hosted-2": {"provider": "p", "name": "z"},
                   "paid": {"provider": "p", "name": "y", "price": price},
                   "paid-2": {"provider": "p", "name": "w", "price": price}},
        "routes": {"free-stable": {"stable": "self-hosted", "candidate": "paid"},
                   "free-candidate": {"stable": "paid", "candidate": "self-hosted"},
                   "both-priced": {"stable": "paid", "candidate": "paid-2"},
                   "neither": {"stable": "self-hosted", "candidate": "self-hosted-2"}},
    }))
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("note:")] == [
        f"note: route {route}: {free} has no price and {priced} has one, so the judge can't compare cost per "
        f"completion (no estimate, it never gates promotion): give models.{free}.price, or neither a price"
        for route, free, priced in (("free-candidate", "self-hosted", "paid"), ("free-stable", "self-hosted", "paid"))]


def test_serve_logs_once_that_the_clients_key_is_forwarded(servers):
    from tests.fixtures.servers import proxy_config

    proxy = servers.proxy(proxy_config("http://127.0.0.1:1"))
    proxy.stop()
    lines = [line for line in proxy.output().splitlines() if "Authorization header is forwarded" in line]
    assert len(lines) == 1 and "provider sim has no api_key_env" in lines[0], proxy.output()[-2000:]


@pytest.mark.parametrize("command", ["serve", "collect", "control"])
def test_an_unset_kafka_secret_variable_stops_start_with_its_field(tmp_path, command):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1"}},
        "models": {"m": {"provider": "p", "name": "x"}},
        "routes": {"r": {"stable": "m"}},
        "events": {"backend": "kafka", "kafka": {"bootstrap_servers": "127.0.0.1:1",
                                                 "security": {"sasl_plain_password_env": "MC_TEST_UNSET_SECRET"}}},
    }))
    result = subprocess.run([sys.executable, "-m", "modelcanary", command, "--config", str(path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 1
    assert ("events.kafka.security.sasl_plain_password_env: environment variable 'MC_TEST_UNSET_SECRET' is not set"
            in result.stderr), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("url,problem", [
    ("https://hooks.slack.com:44x/services/T0SECRET/B0SECRET/XXXXSECRETTOKEN", "port '44x' is not a number"),
    ("https://hooks.slack.com:99999/services/T0SECRET/B0SECRET/XXXXSECRETTOKEN", "port '99999' is not a number"),
    ("https://user:SECRETPASS@hooks.slack.com:4x/services/T0SECRET", "port '4x' is not a number"),
    ("ftp://hooks.slack.com/services/T0SECRET/B0SECRET/XXXXSECRETTOKEN", "scheme 'ftp' is not http or https"),
    ("hooks.slack.com/services/T0SECRET/B0SECRET/XXXXSECRETTOKEN", "scheme is not http or https"),
    ("https:///services/T0SECRET/B0SECRET/XXXXSECRETTOKEN", "host is missing"),
    ("http://[::1/services/T0SECRET/B0SECRET/XXXXSECRETTOKEN", "host part does not parse"),
])
def test_check_config_refuses_a_webhook_url_that_cannot_work_without_showing_its_secret(tmp_path, url, problem):
    """A typo in notify.webhook_url fails at start naming the field, not at the first phase change
    (where the webhook task died and asyncio logged the whole URL); the secret path is never shown."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1"}},
        "models": {"m": {"provider": "p", "name": "x"}},
        "routes": {"r": {"stable": "m"}},
        "notify": {"webhook_url": url},
    }))
    result = check_config(path)
    assert result.returncode == 1
    assert "notify.webhook_url: must be an http(s) URL" in result.stderr and problem in result.stderr, result.stderr
    assert "SECRET" not in result.stderr + result.stdout and "Traceback" not in result.stderr
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "SECRET" not in str(e.value)


def test_a_working_webhook_url_passes_check_config(tmp_path):
    path = tmp_path / "c.yaml"
    url = "https://hooks.slack.com:443/services/T0/B0/XX"
    path.write_text(yaml.safe_dump({
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1"}},
        "models": {"m": {"provider": "p", "name": "x"}},
        "routes": {"r": {"stable": "m"}},
        "notify": {"webhook_url": url},
    }))
    assert check_config(path).returncode == 0
    assert load_config(path).notify.webhook_url == url


def _notify_config(tmp_path: Path, notify: dict) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {"p": {"base_url": "http://127.0.0.1:1/v1"}},
        "models": {"m": {"provider": "p", "name": "x"}},
        "routes": {"r": {"stable": "m"}},
        "notify": notify,
    }))
    return path


def test_the_webhook_url_can_come_from_an_environment_variable(servers):
    """A Slack-style URL whose path is the secret is given as notify.webhook_url_env (from a Secret, as
    providers' api_key_env): check-config takes it, and the proxy POSTs the phase changes to it, a
    Secret file's trailing line break left out, without ever logging it."""
    import json
    import threading
    import urllib.request

    from tests.fixtures.servers import QuietHandler, http_server, proxy_config

    posted: list[str] = []
    arrived = threading.Event()

    class Hook(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            posted.append(self.path)
            arrived.set()
            self.send_response(204)
            self.end_headers()

    with http_server(Hook) as base:
        url = base + "/services/T0SECRET/B0SECRET/XXSECRET"
        env = {"MC_TEST_WEBHOOK": url + "\n", "MODELCANARY_ADMIN_TOKEN": "t0ken"}
        cfg = proxy_config("http://127.0.0.1:1") | {"notify": {"webhook_url_env": "MC_TEST_WEBHOOK"}}
        proxy = servers.proxy(cfg, env=env)
        checked = subprocess.run([sys.executable, "-m", "modelcanary", "check-config", str(proxy.config_path)],
                                 capture_output=True, text=True, cwd=ROOT, timeout=60, env={**os.environ, **env})
        assert checked.returncode == 0, checked.stderr
        req = urllib.request.Request(proxy.url + "/admin/rollouts/support-bot/pause", method="POST", data=b"",
                                     headers={"Authorization": "Bearer t0ken"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["phase"] == "paused"
        assert arrived.wait(10), proxy.output()[-2000:]
        proxy.stop()
    assert posted == ["/services/T0SECRET/B0SECRET/XXSECRET"]
    assert "SECRET" not in proxy.output() + checked.stdout + checked.stderr


@pytest.mark.parametrize("notify,expected", [
    ({"webhook_url": "https://hooks.slack.com/services/T0SECRET", "webhook_url_env": "HOOK"},
     "notify: give webhook_url or webhook_url_env, not both"),
    ({"webhook_url_env": "https://hooks.slack.com/services/T0SECRET"},
     "notify.webhook_url_env: must name an environment variable"),
])
def test_check_config_refuses_a_webhook_url_env_that_cannot_work_without_showing_it(tmp_path, notify, expected):
    result = check_config(_notify_config(tmp_path, notify))
    assert result.returncode == 1
    assert expected in result.stderr, result.stderr
    assert "SECRET" not in result.stderr + result.stdout


@pytest.mark.parametrize("value,problem", [
    (None, "environment variable 'MC_TEST_WEBHOOK' is not set"),
    ("  ", "environment variable 'MC_TEST_WEBHOOK' is not set"),
    ("ftp://hooks.slack.com/services/T0SECRET", "the value of 'MC_TEST_WEBHOOK' must be an http(s) URL"),
])
def test_an_unset_or_unusable_webhook_variable_turns_notifications_off_with_a_warning(
        tmp_path, monkeypatch, caplog, value, problem):
    """As with a provider's unset api_key_env or the admin token's: the process starts, and says why
    no notification will come, naming the variable but never its value."""
    from service.bus.memory import MemoryBus
    from service.rollout.book import RolloutBook
    from service.rollout.controller import Controller

    if value is None:
        monkeypatch.delenv("MC_TEST_WEBHOOK", raising=False)
    else:
        monkeypatch.setenv("MC_TEST_WEBHOOK", value)
    config = load_config(_notify_config(tmp_path, {"webhook_url_env": "MC_TEST_WEBHOOK"}))
    controller = Controller(config, MemoryBus(), RolloutBook(config))
    assert controller.notifier.url is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("notify.webhook_url_env" in w and problem in w for w in warnings), warnings
    assert "SECRET" not in caplog.text
