"""A service that cannot start says why in one line and exits 3 (README "Exit codes"): `control` on a
metrics port it cannot have names `control.metrics_port`; `serve` holds its address from its startup
check on, and a startup that fails is no clean exit."""

from __future__ import annotations

import errno
import socket

import pytest

from service.proxy.app import Runtime
from tests.fixtures.servers import free_port, proxy_config, write_yaml


def run(capsys, args: list[str]) -> tuple[int | BaseException, str]:
    """(exit code, or what ended the command instead; stderr) of `modelcanary ARGS` in this process."""
    from modelcanary.compose import main

    capsys.readouterr()
    try:
        code: int | BaseException = main(args)
    except BaseException as e:  # noqa: BLE001 - a traceback or uvicorn's own exit is what is asserted against
        code = e
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["control", "collect"])
def test_a_service_on_a_metrics_port_in_use_names_the_field_and_exits_3(capsys, tmp_path, command):
    cfg = proxy_config("http://127.0.0.1:9")
    cfg["events"] = {"backend": "kafka", "spool": {"dir": str(tmp_path / "spool")},
                     "kafka": {"bootstrap_servers": f"127.0.0.1:{free_port()}"}}
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        cfg["server"] = {"host": "127.0.0.1"}
        cfg[command] = {"metrics_port": port}
        code, err = run(capsys, [command, "--config", str(write_yaml(tmp_path / "c.yaml", cfg))])
    assert err.strip() == f"error: cannot listen on server.host 127.0.0.1, {command}.metrics_port {port}: " \
                          "Address already in use"
    assert code == 3


@pytest.fixture
def serve_config(tmp_path):
    cfg = proxy_config("http://127.0.0.1:9")
    cfg["state_dir"] = str(tmp_path / "state")
    cfg["server"] = {"host": "127.0.0.1", "port": free_port()}
    return cfg, write_yaml(tmp_path / "serve.yaml", cfg)


def test_a_process_racing_for_the_port_while_serve_starts_cannot_take_it(capsys, monkeypatch, serve_config):
    """Two `serve` on one port started together both passed the check (a bound, not yet listening
    socket); the one whose app started later died with an OSError traceback."""
    cfg, path = serve_config
    raced: list[object] = []

    async def racing_start(self: Runtime) -> None:  # another process, while this one's app starts
        with socket.socket() as racer:
            racer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                racer.bind(("127.0.0.1", cfg["server"]["port"]))
                racer.listen()
                raced.append("the racer took the port")
            except OSError as e:
                raced.append(e.errno)
        raise RuntimeError("the test ends the startup here")

    monkeypatch.setattr(Runtime, "start", racing_start)
    code, _ = run(capsys, ["serve", "--config", str(path)])
    assert raced == [errno.EADDRINUSE], code
    assert code == 3


def test_a_serve_whose_startup_fails_says_so_last_and_exits_3(capsys, monkeypatch, serve_config):
    async def failing_start(self: Runtime) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Runtime, "start", failing_start)
    code, err = run(capsys, ["serve", "--config", str(serve_config[1])])
    assert "No space left on device" in err
    assert err.strip().splitlines()[-1] == "error: the proxy did not start: its startup failed (the lines above " \
                                           "say why)"
    assert code == 3
