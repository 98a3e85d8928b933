"""How `modelcanary` ends, as an operator's terminal and a CI script see it: Ctrl-C or SIGTERM at any
point (the imports included) ends it quietly by that signal (a shell says 130 or 143), and each kind of
failure has the exit code README's "Exit codes" table gives it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

import pytest

from tests.fixtures.servers import CLI, ROOT, free_port, proxy_config, write_yaml
from tests.test_cli_errors import one_case_golden_set

IMPORT_TIME = "import time:"


def imported(line: str) -> str:
    """The module a `-X importtime` line says has just been imported."""
    return line.rsplit("|", 1)[-1].strip()


def signalled_while_importing(args: list[str], sig: int, repeat: bool = False) -> tuple[int, str, str, list[str]]:
    """Run `modelcanary ARGS` with `-X importtime` (a stderr line as each module is imported) and send
    `sig` once the first pydantic module is in, which every command imports (through service.config)
    well before it does anything; with `repeat`, again and again until it exits, as an impatient
    operator does. (exit status, stdout, stderr without the import lines, modules imported)."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", *CLI[1:], *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stderr is not None and proc.stdout is not None
    err: list[str] = []
    for line in proc.stderr:
        err.append(line)
        if imported(line).startswith("pydantic"):
            proc.send_signal(sig)
            break
    else:
        pytest.fail(f"no pydantic import seen: {''.join(err)[-2000:]}")
    reader = threading.Thread(target=lambda: err.extend(proc.stderr or ()))
    reader.start()
    while repeat:
        try:
            proc.wait(timeout=0.02)
            break
        except subprocess.TimeoutExpired:
            proc.send_signal(sig)
    out = proc.stdout.read()
    code = proc.wait(timeout=60)
    reader.join(10)
    modules = [imported(line) for line in err if line.startswith(IMPORT_TIME)]
    return code, out, "".join(line for line in err if not line.startswith(IMPORT_TIME)), modules


@pytest.fixture
def config(tmp_path):
    """A valid config whose provider is nowhere."""
    cfg = proxy_config(f"http://127.0.0.1:{free_port()}")
    cfg["state_dir"] = str(tmp_path / "state")
    return write_yaml(tmp_path / "c.yaml", cfg)


def quiet(err: str) -> bool:
    return "Traceback" not in err and "KeyboardInterrupt" not in err and len(err.strip().splitlines()) <= 1


# each command with a module it imports only once its own work begins
COMMANDS = [(["check-config", "{config}"], "service.rollout.state_file"),
            (["serve", "--config", "{config}", "--port", "0"], "uvicorn"),
            (["status", "--url", "http://127.0.0.1:9"], "service.admin.cli"),
            (["replay", "{config}", "--candidate", "candidate-m"], "collectors.golden.commands")]


@pytest.mark.parametrize(("command", "working"), COMMANDS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_is_still_importing_ends_it_quietly_by_that_signal(config, command, working, sig):
    code, out, err, modules = signalled_while_importing([a.format(config=config) for a in command], sig)
    assert working not in modules, "the signal came after the imports: this test tests nothing"
    assert code == -sig, (code, err)  # a shell says 128 + the signal's number: 130, 143
    assert quiet(err), err
    assert out == ""


@pytest.mark.parametrize(("command", "working"), COMMANDS[:2])
def test_ctrl_c_again_and_again_while_it_starts_still_ends_it_quietly(config, command, working):
    code, out, err, _ = signalled_while_importing([a.format(config=config) for a in command], signal.SIGINT,
                                                  repeat=True)
    assert code == -signal.SIGINT, (code, err)
    assert quiet(err), err


def test_ctrl_c_while_a_command_waits_on_the_network_ends_it_quietly_by_sigint():
    """`status` against an admin URL that accepts and never answers: Ctrl-C once it has connected."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.Popen([*CLI, "status", "--url", url], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        conn, _ = silent.accept()  # the command is now waiting for the answer
        with conn:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err)
    assert quiet(err) and out == "", err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_once_up_drains_on_ctrl_c_or_sigterm_and_exits_0(servers, sig):
    proxy = servers.proxy(proxy_config(f"http://127.0.0.1:{free_port()}"))
    assert proxy.proc is not None
    proxy.signal(sig)
    assert proxy.proc.wait(30) == 0
    assert "draining: 0 request(s) in flight" in proxy.output() and quiet_log(proxy.output())


def quiet_log(text: str) -> bool:
    return "Traceback" not in text and "KeyboardInterrupt" not in text


def test_ctrl_c_while_replay_waits_on_a_model_ends_it_quietly_by_sigint(tmp_path):
    """Replay's calls are under way (the provider accepted the connection and is silent): what asyncio
    cancels on the way out says nothing either."""
    from collectors.golden import dataset

    golden = tmp_path / "golden.jsonl"
    dataset.write(golden, [dataset.Case(request_id=str(i), route="support-bot",
                                        request={"messages": [{"role": "user", "content": f"hi {i}"}]})
                           for i in range(3)])
    with socket.create_server(("127.0.0.1", 0)) as silent:
        cfg = write_yaml(tmp_path / "c.yaml", proxy_config(f"http://127.0.0.1:{silent.getsockname()[1]}"))
        proc = subprocess.Popen([*CLI, "replay", str(golden), "--candidate", "candidate-m", "--config", str(cfg)],
                                cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        conn, _ = silent.accept()  # a call is under way
        with conn:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err)
    started = ("WARNING modelcanary.shadow: provider sim has no api_key_env", "replay: answered 0/3 cases")
    assert quiet("\n".join(line for line in err.splitlines() if not line.startswith(started))), err
    assert "replay:" not in out  # no verdict line, not even "nothing confidently worse"


# ---- a reader of stdout that leaves early (`| head`) -----------------------------------------------------


@pytest.mark.parametrize("unbuffered", ["1", ""])
@pytest.mark.parametrize("command", [["check-config", "{config}"], ["dashboards", "build", "--out", "{tmp}"]])
def test_a_reader_that_stops_reading_ends_the_command_with_141_and_nothing_on_stderr(config, tmp_path, command,
                                                                                      unbuffered):
    """Python buffers stdout on a pipe unless PYTHONUNBUFFERED is set (as the Docker image does): either
    way the broken pipe is neither `--out`'s fault nor an 'Exception ignored' at exit (120)."""
    import os

    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    proc = subprocess.Popen([*CLI, *(a.format(config=config, tmp=tmp_path / "out") for a in command)], cwd=ROOT,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()  # before the command can have written anything
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, (proc.returncode, err)
    assert err == ""


# ---- the exit codes README's table gives ----------------------------------------------------------------


def run(capsys, args: list[str]) -> int:
    """`modelcanary ARGS` in this process: its exit code (argparse's usage errors included)."""
    from modelcanary.compose import main

    try:
        return main(args)
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        capsys.readouterr()


golden = pytest.fixture(one_case_golden_set)


def test_each_kind_of_failure_has_its_documented_exit_code(capsys, config, golden, tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"
    missing = str(tmp_path / "missing.yaml")
    table = {
        0: [["check-config", str(config)], ["dataset", "stats", str(golden)]],
        1: [["check-config", missing], ["check-config", str(tmp_path)],           # the config has problems
            ["serve", "--config", missing], ["collect", "--config", str(tmp_path)], ["control", "--config", missing],
            ["simulate", "--config", missing],
            ["status", "--url", nowhere], ["promote", "support-bot", "--url", nowhere],  # not reachable
            ["report", "support-bot", "--url", nowhere],
            ["capture", "--config", str(config), "--url", nowhere, "--out", str(tmp_path / "g.jsonl")]],
        2: [["serve", "--config", str(config), "--port", "99999"], ["status"], ["nosuch"],  # usage
            ["status", "--url", "notaurl"], ["dashboards", "push", "--grafana-url", "ftp://x"],  # nothing asked
            ["capture", "--config", missing, "--out", str(tmp_path / "g.jsonl")],
            ["replay", str(golden), "--candidate", "candidate-m", "--config", missing],
            ["replay", str(golden), "--candidate", "no-such-model", "--config", str(config)],
            ["replay", str(golden), "--candidate", "candidate-m", "--config", str(config), "--against-report",
             nowhere],
            ["dataset", "stats", missing]],
    }
    got = {code: [args for args in commands if run(capsys, args) != code] for code, commands in table.items()}
    assert got == {0: [], 1: [], 2: []}


def test_serve_and_simulate_that_cannot_listen_exit_3(capsys, config):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        assert run(capsys, ["serve", "--config", str(config), "--port", port]) == 3
        assert run(capsys, ["simulate", "--config", str(ROOT / "examples" / "simulator.yaml"), "--port", port]) == 3
