"""Bad flag values end in one line on stderr naming the flag and the value, and exit 2 (bad input),
never a traceback: malformed URLs (admin commands, capture --url, replay --against-report, dashboards
push --grafana-url, whose password is never shown), an admin token no HTTP header can carry, and a
capture --out that cannot be written (checked before any traffic is fetched). Client keys that name
no route are a config error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from collectors.golden import dataset
from tests.fixtures.servers import canned_upstream, free_port, proxy_config, write_yaml

BAD_URLS = [("notaurl", "is not an http(s) URL"), ("http://[::1", "Invalid IPv6 URL"),
            ("ftp://example.org", "is not an http(s) URL"), ("http://127.0.0.1:port", "is not a URL")]


def run(capsys, args: list[str]) -> tuple[int, str, str]:
    from modelcanary.compose import main

    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, start: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(start), err


@pytest.fixture
def config(tmp_path):
    """A config whose provider is nowhere: nothing here may get as far as asking it."""
    return write_yaml(tmp_path / "c.yaml", proxy_config(f"http://127.0.0.1:{free_port()}"))


def one_case_golden_set(tmp_path):
    path = tmp_path / "golden.jsonl"
    dataset.write(path, [dataset.Case(request_id="a", route="support-bot",
                                      request={"messages": [{"role": "user", "content": "hi"}]})])
    return path


golden = pytest.fixture(one_case_golden_set)


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
@pytest.mark.parametrize("command", [["status"], ["status", "support-bot"], ["report", "support-bot"],
                                     ["promote", "support-bot"]])
def test_admin_commands_refuse_a_malformed_url(capsys, command, url, why):
    code, _, err = run(capsys, [*command, "--url", url, "--token", "t"])
    assert code == 2
    one_error_line(err, f"error: --url: {url!r}")
    assert why in err and "http://HOST:PORT" in err


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
def test_capture_refuses_a_malformed_url(capsys, tmp_path, config, url, why):
    out = tmp_path / "c.jsonl"
    code, _, err = run(capsys, ["capture", "--config", str(config), "--out", str(out), "--url", url])
    assert code == 2
    one_error_line(err, f"error: --url: {url!r}")
    assert why in err and not out.exists()


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
def test_replay_refuses_a_malformed_against_report_url_before_replaying(capsys, config, golden, url, why):
    code, out, err = run(capsys, ["replay", str(golden), "--candidate", "candidate-m", "--config", str(config),
                                  "--against-report", url])
    assert code == 2  # not 1, which a CI gate reads as "confidently worse"
    one_error_line(err, f"error: --against-report: {url!r}")
    assert why in err and "replay:" not in out + err


def test_capture_refuses_an_out_in_a_missing_directory_before_fetching(capsys, tmp_path, config):
    out = tmp_path / "nonexistent" / "dir" / "c.jsonl"
    unreachable = f"http://127.0.0.1:{free_port()}"  # had capture fetched first, it would say so, exit 1
    code, _, err = run(capsys, ["capture", "--config", str(config), "--out", str(out), "--url", unreachable])
    assert code == 2
    one_error_line(err, f"error: --out: cannot write {str(out)!r}")
    assert f"the directory {str(out.parent)!r} does not exist" in err and "cannot reach" not in err


def test_capture_refuses_an_out_that_is_a_directory(capsys, tmp_path, config):
    code, _, err = run(capsys, ["capture", "--config", str(config), "--out", str(tmp_path),
                                "--url", f"http://127.0.0.1:{free_port()}"])
    assert code == 2
    one_error_line(err, f"error: --out: {str(tmp_path)!r} is a directory")
    assert "is a directory" in err and "cannot reach" not in err


def test_capture_out_check_leaves_an_existing_file_and_creates_none(tmp_path):
    existing = tmp_path / "old.jsonl"
    existing.write_text("kept\n")
    dataset.check_writable(existing)
    assert existing.read_text() == "kept\n"
    fresh = tmp_path / "new.jsonl"
    dataset.check_writable(fresh)
    assert not fresh.exists()


@pytest.mark.parametrize("command", ["serve", "simulate"])
@pytest.mark.parametrize("port", ["99999", "-1", "80x"])
def test_a_port_flag_out_of_range_is_refused_naming_it(capsys, config, command, port):
    with pytest.raises(SystemExit) as exit_:
        run(capsys, [command, "--config", str(config), "--port", port])
    assert exit_.value.code == 2
    assert f"argument --port: '{port}' is not a port" in capsys.readouterr().err


@pytest.mark.parametrize("since", ["nan", "inf", "1e400"])
def test_capture_refuses_a_since_that_is_no_time(capsys, config, tmp_path, since):
    code, _, err = run(capsys, ["capture", "--config", str(config), "--url", "http://127.0.0.1:1",
                                "--out", str(tmp_path / "g.jsonl"), "--since", since])
    assert code == 2
    one_error_line(err, f"error: --since: '{since}' is not a time")


@pytest.mark.parametrize("duration", ["-5", "0", "nan", "soon"])
def test_a_demo_duration_that_is_no_time_is_refused_naming_it(capsys, duration):
    with pytest.raises(SystemExit) as exit_:
        run(capsys, ["demo", "--duration", duration])
    assert exit_.value.code == 2
    assert f"argument --duration: '{duration}' is not a duration" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["collect", "control"])
def test_collect_and_control_name_a_broker_they_cannot_reach(servers, tmp_path, command):
    """Not minutes of silence: the first try says which bootstrap servers do not answer."""
    import time

    nowhere = f"127.0.0.1:{free_port()}"
    port = free_port()
    cfg = proxy_config("http://127.0.0.1:9")
    cfg["events"] = {"backend": "kafka", "spool": {"dir": str(tmp_path / "spool")},
                     "kafka": {"bootstrap_servers": nowhere}}
    cfg[command] = {"metrics_port": port}
    proc = servers.process([command, "--config", str(write_yaml(tmp_path / "c.yaml", cfg))], command,
                           ready_url=f"http://127.0.0.1:{port}/healthz")
    deadline = time.monotonic() + 20
    while f"no Kafka broker reachable at {nowhere}" not in proc.output():
        assert time.monotonic() < deadline and proc.proc.poll() is None, proc.output()[-2000:]
        time.sleep(0.1)


@pytest.mark.parametrize("workers", ["0", "-1", "two"])
def test_serve_refuses_a_number_of_workers_that_is_none(capsys, config, workers):
    with pytest.raises(SystemExit) as exit_:
        run(capsys, ["serve", "--config", str(config), "--workers", workers])
    assert exit_.value.code == 2
    assert f"argument --workers: '{workers}' is not a number of worker processes" in capsys.readouterr().err


def test_dashboards_build_into_a_place_it_cannot_write_says_so_in_one_line(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, _, err = run(capsys, ["dashboards", "build", "--out", str(blocker)])
    assert code == 1
    one_error_line(err, f"error: --out {blocker}: cannot write there")


# ---- dashboards push: the Grafana URL --------------------------------------------------------------------

GRAFANA_PASSWORD = "pw-" + "9f3c1e"


@pytest.mark.parametrize(("url", "why"), [*BAD_URLS, ("http://127.0.0.1:99999", "is not a URL"),
                                          (f"http://admin:{GRAFANA_PASSWORD}@127.0.0.1:port", "is not a URL")])
def test_dashboards_push_refuses_a_malformed_grafana_url(capsys, url, why):
    code, _, err = run(capsys, ["dashboards", "push", "--grafana-url", url])
    assert code == 2
    one_error_line(err, "error: --grafana-url: ")
    assert why in err and "http://HOST:PORT" in err
    assert GRAFANA_PASSWORD not in err


def test_dashboards_push_never_prints_the_grafana_password(capsys):
    """README's `http://user:pass@host:3000`: the password is used, and shown nowhere (an error or
    the success lines end up in CI logs)."""
    nowhere = f"http://admin:{GRAFANA_PASSWORD}@127.0.0.1:{free_port()}"
    code, out, err = run(capsys, ["dashboards", "push", "--grafana-url", nowhere])
    assert code == 1
    one_error_line(err, "error: cannot reach Grafana at http://***@127.0.0.1:")
    assert GRAFANA_PASSWORD not in out + err

    with canned_upstream(b"{}") as (url, seen):
        grafana = url.replace("http://", f"http://admin:{GRAFANA_PASSWORD}@")
        code, out, err = run(capsys, ["dashboards", "push", "--grafana-url", grafana])
    assert code == 0, err
    assert "pushed modelcanary-rollout to http://***@127.0.0.1:" in out, out
    assert GRAFANA_PASSWORD not in out + err
    assert all(h.get("authorization", "").startswith("Basic ") for h in seen), seen  # the password was used


# ---- the admin token: what an HTTP header can carry ------------------------------------------------------


@pytest.mark.parametrize(("given", "source", "why"), [
    ({"--token": "тест"}, "--token", "outside Latin-1"),
    ({"--token": "sekrit\ntoken"}, "--token", "control character"),
    ({"env": "sekrit\rtoken"}, "MODELCANARY_ADMIN_TOKEN", "control character"),
])
@pytest.mark.parametrize("command", [["status"], ["report", "support-bot"], ["promote", "support-bot"]])
def test_an_admin_token_no_header_can_carry_is_refused_before_asking(capsys, monkeypatch, command, given, source,
                                                                     why):
    """Nothing is sent, so the operator knows the action did not happen: exit 2 naming where the token
    came from (never the token), not 'the answer is not JSON'."""
    monkeypatch.setenv("MODELCANARY_ADMIN_TOKEN", given.get("env", "unused"))
    flag = ["--token", given["--token"]] if "--token" in given else []
    with canned_upstream(b"{}") as (url, seen):
        code, _, err = run(capsys, [*command, "--url", url, *flag])
    assert code == 2, err
    one_error_line(err, f"error: {source}: ")
    assert why in err and seen == []
    assert "тест" not in err and "sekrit" not in err


# ---- client keys name routes that exist ------------------------------------------------------------------


def test_check_config_and_serve_refuse_a_client_key_for_a_route_that_does_not_exist(capsys, monkeypatch, tmp_path):
    """A misspelt route would give that client 403 on every call: refused up front, naming the
    variable, the entry and the name (never the key)."""
    cfg = proxy_config("http://127.0.0.1:9")
    cfg["server"] = {"client_keys_env": "MC_TEST_KEYS"}
    path = write_yaml(tmp_path / "c.yaml", cfg)
    monkeypatch.setenv("MC_TEST_KEYS", "sk-teamA-secret=support-bot;sk-teamB-secret=suport-bot,candidate-m")
    code, out, err = run(capsys, ["check-config", str(path)])
    expected = ("server.client_keys_env: entry 2 of environment variable 'MC_TEST_KEYS' names 'suport-bot', "
                "which is neither a route nor a model")
    assert code == 1 and expected in err, out + err
    assert "secret" not in out + err
    served = subprocess.run([sys.executable, "-m", "modelcanary", "serve", "--config", str(path), "--port", "0"],
                            capture_output=True, text=True, timeout=30)
    assert served.returncode == 1 and expected in served.stderr, served.stderr
    assert "secret" not in served.stdout + served.stderr
    monkeypatch.setenv("MC_TEST_KEYS", "sk-teamA-secret=support-bot,stable-m;sk-ops-secret=*")
    assert run(capsys, ["check-config", str(path)])[0] == 0
