"""`serve --workers N` in production: a worker that cannot start stops `serve` (exit 3), SIGTERM drains
every worker, SIGHUP restarts them with a file the supervisor checked first, and a worker that dies is
replaced without leaving its share of the metrics behind (README "Exit codes", "Operate a rollout")."""

from __future__ import annotations

import copy
import errno
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import pytest
import yaml

from tests.fixtures.servers import (
    CLI,
    ROOT,
    SIM_MODEL,
    Server,
    free_port,
    metric_value,
    proxy_config,
    scrape,
    sim_config,
    write_yaml,
)

pytestmark = pytest.mark.timeout(180)

TOKEN = "workers-token"
ANSWER_S = 2.0  # how long the simulator takes to finish a streamed answer


def failing_worker_app(*_: object) -> NoReturn:
    """A worker factory whose startup fails, as a full disk would make it."""
    raise OSError(errno.ENOSPC, "No space left on device")


class FailingWiring:
    """The composition root's wiring, but every worker's startup fails."""

    WORKER_FACTORY = "tests.test_serve_workers:failing_worker_app"


def slow_simulator(servers) -> Server:
    model = copy.deepcopy(SIM_MODEL)
    model["latency_s"] = {"median": ANSWER_S, "p95": ANSWER_S * 1.05}
    model["ttft_s"] = {"median": 0.05, "p95": 0.06}
    return servers.simulator(sim_config({"good-model": model, "new-model": copy.deepcopy(model)}, time_scale=1.0))


def kafka_config(sim_url: str, broker, drain_seconds: float = 30) -> dict:
    cfg = proxy_config(sim_url)
    cfg["server"] = {"drain_seconds": drain_seconds}
    cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": broker.bootstrap,
                                                   "topic_prefix": "sw" + uuid.uuid4().hex[:8]}}
    return cfg


def workers_of(proxy: Server) -> set[int]:
    """The pids of the worker processes (children of `serve` other than multiprocessing's tracker), read
    from /proc: `ps` cuts its lines at $COLUMNS and can drop the word that tells the tracker apart."""
    workers = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == proxy.proc.pid and b"resource_tracker" not in (stat.parent / "cmdline").read_bytes():
                workers.add(int(stat.parent.name))
        except (OSError, IndexError, ValueError):  # a process that ended while being read
            continue
    return workers


def until(check: Callable[[], object], timeout_s: float = 60, what: str = "") -> object:
    """Poll `check` until it returns something true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except OSError:  # a worker between its stop and its start
            pass
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def chat(port: int, stream: bool, i: int = 0) -> str:
    """One chat request; 'ok', or what the client saw instead."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "support-bot", "messages": [{"role": "user", "content": f"hello {i}"}], "stream": stream}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        data = response.read().decode()
    except (OSError, http.client.HTTPException) as e:
        return f"{type(e).__name__}"
    finally:
        conn.close()
    if response.status != 200:
        return f"{response.status} {data}"
    if not stream:
        return "ok"
    errors = [json.loads(line[6:])["error"]["code"] for line in data.splitlines() if line.startswith('data: {"error"')]
    if errors:
        return "error event " + errors[0]
    return "ok" if "data: [DONE]" in data else "stream cut"


def in_flight(proxy: Server) -> float:
    return metric_value(scrape(proxy.url), "modelcanary_in_flight_requests")


def send(pool: ThreadPoolExecutor, proxy: Server, n: int, stream: bool = True) -> list[Future[str]]:
    """`n` requests in flight on the workers, once every one of them is."""
    calls = [pool.submit(chat, proxy.port, stream, i) for i in range(n)]
    until(lambda: in_flight(proxy) >= n, 30, f"{n} requests in flight")
    return calls


def test_a_worker_whose_startup_fails_stops_serve_with_exit_3_and_one_clear_line(tmp_path):
    """Before: uvicorn's supervisor restarted a worker that failed in the app factory forever (exit 1,
    a traceback each time), and stopped with exit 0 on a failed lifespan startup."""
    cfg = proxy_config("http://127.0.0.1:9")
    cfg["events"] = {"backend": "kafka", "spool": {"dir": str(tmp_path / "spool")},
                     "kafka": {"bootstrap_servers": f"127.0.0.1:{free_port()}"}}
    path = write_yaml(tmp_path / "serve.yaml", cfg)
    code = ("import sys; from service import cli; from tests.test_serve_workers import FailingWiring; "
            f"sys.exit(cli.main(['serve', '--config', {str(path)!r}, '--port', '{free_port()}', '--workers', '2'], "
            "FailingWiring()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "No space left on device" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the proxy did not start: a worker's startup failed (the lines above say why)")


def test_a_prometheus_multiproc_dir_that_is_not_there_is_named_before_any_worker_starts(tmp_path):
    """Before: every worker died on its first metric, and was restarted forever."""
    cfg = proxy_config("http://127.0.0.1:9")
    cfg["events"] = {"backend": "kafka", "spool": {"dir": str(tmp_path / "spool")},
                     "kafka": {"bootstrap_servers": f"127.0.0.1:{free_port()}"}}
    path = write_yaml(tmp_path / "serve.yaml", cfg)
    missing = tmp_path / "no-such-dir"
    proc = subprocess.run(CLI + ["serve", "--config", str(path), "--port", str(free_port()), "--workers", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(missing)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (f"error: PROMETHEUS_MULTIPROC_DIR {missing}: no such directory (serve --workers N "
                                   "keeps every worker's metrics there)")


def test_sigterm_drains_every_worker_readyz_says_draining_and_streams_finish(servers, kafka_broker):
    """Before: the workers were plain uvicorn servers: /readyz refused connections instead of 503
    `draining`, and nothing said the drain had begun."""
    sim = slow_simulator(servers)
    proxy = servers.proxy(kafka_config(sim.url, kafka_broker, drain_seconds=30), args=["--workers", "2"])
    until(lambda: _readyz(proxy) == (200, {"status": "ready"}), 30, "ready")
    with ThreadPoolExecutor(8) as pool:
        calls = send(pool, proxy, 8)
        started = time.monotonic()
        proxy.signal(signal.SIGTERM)  # a worker not caught up with the rollouts yet says so until it drains
        until(lambda: _readyz(proxy) == (503, {"status": "draining"}), 10, "/readyz draining")
        assert [c.result() for c in calls] == ["ok"] * 8
    assert proxy.proc.wait(30) == 0
    assert time.monotonic() - started < ANSWER_S + 10
    assert proxy.output().count("draining: ") == 2, proxy.output()  # one line per worker


def test_streams_left_at_the_end_of_the_drain_are_cut_with_an_error_event(servers, kafka_broker):
    """Before: a worker's uvicorn cancelled them: the client's stream just stopped, mid-chunk."""
    sim = slow_simulator(servers)
    proxy = servers.proxy(kafka_config(sim.url, kafka_broker, drain_seconds=0.5), args=["--workers", "2"])
    with ThreadPoolExecutor(6) as pool:
        calls = send(pool, proxy, 6)
        proxy.signal(signal.SIGTERM)
        assert [c.result() for c in calls] == ["error event draining"] * 6
    assert proxy.proc.wait(30) == 0


def test_sighup_with_a_bad_file_keeps_every_worker_on_the_running_config(servers, kafka_broker):
    """Before: each new worker died on the file with a traceback; one that died later (here: SIGKILL)
    was restarted on the bad file again and again, the service one worker short."""
    proxy = servers.proxy(kafka_config(servers.simulator().url, kafka_broker), args=["--workers", "2"])
    before = until(lambda: len(workers_of(proxy)) == 2 and workers_of(proxy), 30, "two workers")
    path: Path = proxy.config_path  # type: ignore[attr-defined]
    path.write_text(path.read_text() + "routes: [oops\n")
    proxy.signal(signal.SIGHUP)
    until(lambda: "SIGHUP: config not reloaded" in proxy.output(), 30, "the refusal logged")
    assert workers_of(proxy) == before
    os.kill(min(before), signal.SIGKILL)
    after = until(lambda: len(w := workers_of(proxy) - {min(before)}) == 2 and w, 30, "a replacement worker")
    assert until(lambda: _readyz(proxy) == (200, {"status": "ready"}), 30, "ready")
    assert [chat(proxy.port, False, i) for i in range(6)] == ["ok"] * 6
    assert workers_of(proxy) == after  # nothing restarting in a loop
    assert "Traceback" not in proxy.output()
    refusal = [line for line in proxy.output().splitlines() if "SIGHUP" in line]
    assert len(refusal) == 1 and "line " in refusal[0], refusal  # where in the file


def test_sighup_restarts_every_worker_without_cutting_or_refusing_requests(servers, kafka_broker):
    """Requests in flight on a replaced worker finish on it; requests sent during the restart are
    served (a replaced worker stops taking connections, it does not answer them 503); the counters go
    on from where they were and in-flight returns to 0."""
    sim = slow_simulator(servers)
    proxy = servers.proxy(kafka_config(sim.url, kafka_broker), env={"MODELCANARY_ADMIN_TOKEN": TOKEN},
                          args=["--workers", "2"])
    old = until(lambda: len(workers_of(proxy)) == 2 and workers_of(proxy), 30, "two workers")
    path: Path = proxy.config_path  # type: ignore[attr-defined]
    cfg = yaml.safe_load(path.read_text())
    cfg["routes"]["support-bot"]["candidate"] = None
    write_yaml(path, cfg)
    with ThreadPoolExecutor(16) as pool:
        calls = send(pool, proxy, 6)
        proxy.signal(signal.SIGHUP)
        during: list[str] = []
        deadline = time.monotonic() + 60
        while workers_of(proxy) & old and time.monotonic() < deadline:  # until both old workers are gone
            during.append(chat(proxy.port, False, len(during)))
        assert not workers_of(proxy) & old, proxy.output()[-3000:]
        assert [c.result() for c in calls] == ["ok"] * 6
    assert during and set(during) == {"ok"}, during
    served = 6 + len(during)
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_requests_total", outcome="completed") == served
    assert metric_value(text, "modelcanary_in_flight_requests") == 0
    candidates = {_get(proxy, "/admin/rollouts/support-bot")[1].get("candidate", "?") for _ in range(8)}
    assert candidates == {None}


def test_a_killed_worker_is_replaced_and_its_in_flight_requests_leave_the_gauge(servers, kafka_broker):
    """Before: the killed worker's share of modelcanary_in_flight_requests stayed in /metrics for good."""
    sim = slow_simulator(servers)
    proxy = servers.proxy(kafka_config(sim.url, kafka_broker), args=["--workers", "2"])
    workers = until(lambda: len(workers_of(proxy)) == 2 and workers_of(proxy), 30, "two workers")
    with ThreadPoolExecutor(8) as pool:
        calls = send(pool, proxy, 8)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        results = [c.result() for c in calls]
    assert results.count("ok") < 8  # some were on the killed worker
    until(lambda: len(workers_of(proxy) - {victim}) == 2, 30, "a replacement worker")
    ok = results.count("ok")
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_in_flight_requests") == 0
    assert metric_value(text, "modelcanary_requests_total", outcome="completed") == ok
    assert [chat(proxy.port, False, i) for i in range(4)] == ["ok"] * 4
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_requests_total", outcome="completed") == ok + 4


def _get(proxy: Server, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        conn.request("GET", path, headers={"authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def _readyz(proxy: Server) -> tuple[int, dict]:
    return _get(proxy, "/readyz")

