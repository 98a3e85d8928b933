"""A config reload (POST /admin/reload or SIGHUP) that names a new candidate starts a new rollout."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import openai
import pytest
import yaml

from tests.fixtures.servers import metric_value, proxy_config, scrape, sim_config

TOKEN = "reload-test-token"


def call(proxy, method: str, path: str) -> tuple[int, dict]:
    req = urllib.request.Request(proxy.url + path, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def rewrite(proxy, **route_changes) -> None:
    cfg = yaml.safe_load(proxy.config_path.read_text())
    cfg["routes"]["support-bot"].update(route_changes)
    proxy.config_path.write_text(yaml.safe_dump(cfg))


def test_reload_starts_a_new_rollout_and_moves_the_shadow_workers(servers):
    models = sim_config()["models"]
    models["third-model"] = models["new-model"]
    sim = servers.simulator(sim_config(models))
    cfg = proxy_config(sim.url, shadow={"sample_rate": 1.0, "max_per_minute": 100000},
                       rollout={"mode": "advisory"})
    cfg["models"]["third-m"] = {"provider": "sim", "name": "third-model"}
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN})

    status, state = call(proxy, "POST", "/admin/rollouts/support-bot/promote")
    assert status == 200 and state["phase"] == "canary"
    version = state["version"]

    rewrite(proxy, candidate="third-m")
    status, body = call(proxy, "POST", "/admin/reload")
    assert status == 200 and body["new_rollouts"] == ["support-bot"]
    status, state = call(proxy, "GET", "/admin/rollouts/support-bot")
    assert state["phase"] == "shadow" and state["candidate"] == "third-m" and state["version"] > version

    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    for i in range(20):
        client.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": f"q {i}"}])
    deadline = time.monotonic() + 60  # the new shadow child process starts first
    while time.monotonic() < deadline and metric_value(scrape(proxy.url), "modelcanary_shadow_requests_total",
                                                         model="third-m") < 20:
        time.sleep(0.2)
    # every request sampled while the new child started waited for it: none lost
    assert metric_value(scrape(proxy.url), "modelcanary_shadow_requests_total", model="third-m") == 20

    # a broken file is refused with the field path; the running config stays
    rewrite(proxy, candidate="no-such-model")
    status, body = call(proxy, "POST", "/admin/reload")
    assert status == 400 and "routes.support-bot.candidate" in body["error"]["message"]
    assert call(proxy, "GET", "/admin/rollouts/support-bot")[1]["candidate"] == "third-m"

    # SIGHUP does the same as POST /admin/reload
    rewrite(proxy, candidate="candidate-m")
    proxy.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and call(proxy, "GET", "/admin/rollouts/support-bot")[1]["candidate"] != "candidate-m":
        time.sleep(0.1)
    state = call(proxy, "GET", "/admin/rollouts/support-bot")[1]
    assert state["candidate"] == "candidate-m" and state["phase"] == "shadow"
    assert proxy.proc.poll() is None


def write(proxy, change) -> None:
    cfg = yaml.safe_load(proxy.config_path.read_text())
    change(cfg)
    proxy.config_path.write_text(yaml.safe_dump(cfg))


def test_reload_refuses_what_serve_refuses_and_keeps_serving(servers, monkeypatch):
    """A client key variable that is unset (or a base_url whose port can't be) would lock every client
    out or break every call: the reload is refused with the field, as check-config and serve refuse it."""
    monkeypatch.delenv("MC_RELOAD_UNSET_KEYS", raising=False)
    sim = servers.simulator()
    proxy = servers.proxy(proxy_config(sim.url), env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)

    write(proxy, lambda cfg: cfg.setdefault("server", {}).update(client_keys_env="MC_RELOAD_UNSET_KEYS"))
    status, body = call(proxy, "POST", "/admin/reload")
    assert (status, body["error"]["code"]) == (400, "invalid_config"), body
    assert "server.client_keys_env: environment variable 'MC_RELOAD_UNSET_KEYS' is not set" in body["error"]["message"]
    client.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": "still served"}])

    write(proxy, lambda cfg: (cfg["server"].pop("client_keys_env"),
                              cfg["providers"]["sim"].update(base_url="http://127.0.0.1:99999/v1")))
    status, body = call(proxy, "POST", "/admin/reload")
    assert (status, body["error"]["code"]) == (400, "invalid_config"), body
    assert "providers.sim.base_url: must be an http(s) URL with a host and a valid port" in body["error"]["message"]
    client.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": "still served"}])

    # what is set up once, at start: refused, and nothing of that reload applied (not its new route either)
    def start_only(cfg: dict) -> None:
        cfg["providers"]["sim"]["base_url"] = sim.url + "/v1"
        cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": "127.0.0.1:9"}}
        cfg["state_dir"] = cfg["state_dir"] + "-moved"
        cfg["routes"]["new-route"] = {"stable": "stable-m"}

    write(proxy, start_only)
    status, body = call(proxy, "POST", "/admin/reload")
    assert (status, body["error"]["code"]) == (400, "invalid_config"), body
    for key in ("state_dir", "events"):
        assert f"{key}: changes only with a restart" in body["error"]["message"], body
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="new-route", messages=[{"role": "user", "content": "not yet"}])


def test_reload_applies_tracing_to_live_calls(servers):
    """tracing.capture_content switched off by a reload: the next live span carries no prompt."""
    from tests.test_tracing import Receiver, attrs

    receiver = Receiver()
    try:
        sim = servers.simulator()
        cfg = proxy_config(sim.url)
        cfg["tracing"] = {"otlp_endpoint": receiver.url, "capture_content": True}
        proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN, "OTEL_BSP_SCHEDULE_DELAY": "100"})
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)

        def live_span_of(prompt: str) -> dict:
            client.chat.completions.create(model="support-bot", messages=[{"role": "user", "content": prompt}])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                spans = [attrs(s) for s in receiver.spans()]
                mine = [a for a in spans if a.get("modelcanary.role") == "stable"]
                if len(mine) >= len(seen) + 1:
                    seen.append(mine[-1])
                    return mine[-1]
                time.sleep(0.05)
            raise AssertionError(f"no span for {prompt!r}")

        seen: list[dict] = []
        assert "BEFORE-RELOAD" in live_span_of("BEFORE-RELOAD")["gen_ai.input.messages"]
        write(proxy, lambda c: c["tracing"].update(capture_content=False))
        assert call(proxy, "POST", "/admin/reload")[0] == 200
        after = live_span_of("AFTER-RELOAD")
        assert "gen_ai.input.messages" not in after and "gen_ai.output.messages" not in after, after
    finally:
        receiver.close()


def test_a_reload_moves_or_stops_the_webhook_and_an_action_posts_once(servers):
    """Memory mode: the embedded controller posts to the webhook the config names now; an operator's
    action is one POST (the admin API leaves it to the controller)."""
    import http.server
    import threading

    posted: list[tuple[str, dict]] = []
    arrived = threading.Condition()

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with arrived:
                posted.append((self.path, body))
                arrived.notify_all()
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{hook.server_address[1]}"

    def posts_after(action: str, phase: str) -> list[str]:
        """The paths POSTed for `action`, which moves the route to `phase`: once its POST came, or 3 s
        passed without one."""
        assert call(proxy, "POST", f"/admin/rollouts/support-bot/{action}")[0] == 200
        with arrived:
            arrived.wait_for(lambda: any(b["to"] == phase for _, b in posted), timeout=3)
            mine = [path for path, b in posted if b["to"] == phase]
            posted.clear()
        return mine

    def notify(url: str | None) -> None:
        cfg = yaml.safe_load(proxy.config_path.read_text())
        cfg["notify"] = {"webhook_url": url}
        proxy.config_path.write_text(yaml.safe_dump(cfg))
        assert call(proxy, "POST", "/admin/reload")[0] == 200

    try:
        sim = servers.simulator()
        proxy = servers.proxy(proxy_config(sim.url) | {"notify": {"webhook_url": base + "/old"}},
                              env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
        assert posts_after("pause", "paused") == ["/old"]  # once
        notify(base + "/new")
        assert posts_after("resume", "shadow") == ["/new"]
        notify(None)
        assert posts_after("pause", "paused") == []
    finally:
        hook.shutdown()


def test_a_reload_that_changes_a_provider_lets_the_calls_under_way_finish(servers):
    """Only new calls go to the changed provider: streams and plain calls already under way end whole
    on their connections, never cut (and recorded as the provider's connection_error) nor sent again."""
    import concurrent.futures
    import copy

    from tests.fixtures.servers import SIM_MODEL

    slow = {**copy.deepcopy(SIM_MODEL), "latency_s": {"median": 1.5, "p95": 1.6}, "ttft_s": {"median": 0.1, "p95": 0.2}}
    sim = servers.simulator(sim_config({"good-model": slow, "new-model": slow}, time_scale=1.0))
    proxy = servers.proxy(proxy_config(sim.url), env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=20)
    messages = [{"role": "user", "content": "tell me something"}]

    def plain() -> str:
        return client.chat.completions.create(model="support-bot", messages=messages).choices[0].finish_reason

    def streamed() -> str:
        finish = None
        for chunk in client.chat.completions.create(model="support-bot", messages=messages, stream=True):
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        return finish

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        calls = [pool.submit(f) for f in (plain, plain, streamed, streamed)]
        deadline = time.monotonic() + 10
        while metric_value(scrape(proxy.url), "modelcanary_in_flight_requests", route="support-bot") < 4:
            assert time.monotonic() < deadline, "the calls never got under way"
            time.sleep(0.02)
        write(proxy, lambda cfg: cfg["providers"]["sim"].update(timeout_s=25))
        status, body = call(proxy, "POST", "/admin/reload")
        assert status == 200, body
        assert [c.result(timeout=20) for c in calls] == ["stop"] * 4
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_failures_total", model="stable-m") == 0
    assert metric_value(text, "modelcanary_upstream_retries_total") == 0
    assert plain() == "stop"  # and the changed provider serves what comes next


def test_with_several_workers_a_reload_is_sighup_to_serve_not_one_workers_api(servers, kafka_broker):
    """`serve --workers 2`: POST /admin/reload would reach only the worker that answers, so it is
    refused, saying what to do; SIGHUP to `serve` restarts every worker with the file."""
    import uuid

    cfg = proxy_config(servers.simulator().url)
    cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": kafka_broker.bootstrap,
                                                   "topic_prefix": "w" + uuid.uuid4().hex[:8]}}
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN}, args=["--workers", "2"])
    status, body = call(proxy, "POST", "/admin/reload")
    assert status == 409 and body["error"]["code"] == "several_workers" and "SIGHUP" in body["error"]["message"]

    write(proxy, lambda c: c["routes"]["support-bot"].update(candidate=None))
    proxy.signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    seen: set = set()
    while time.monotonic() < deadline:  # every worker answers from the new file once both restarted
        try:
            seen = {call(proxy, "GET", "/admin/rollouts/support-bot")[1].get("candidate", "?") for _ in range(8)}
        except OSError:  # a worker between its stop and its start
            seen = set()
        if seen == {None}:
            break
        time.sleep(0.5)
    assert seen == {None}
    assert proxy.proc.poll() is None


@pytest.mark.parametrize("command", ["control", "collect"])
def test_sighup_to_control_or_collect_says_to_restart_it_and_keeps_it_running(servers, fresh_kafka_broker, tmp_path,
                                                                             command):
    """They read their config at start only; a SIGHUP (what a reload of `serve` takes) must not kill
    them silently: it is logged, with what to do. A broker of its own: a member stopped while it joins
    its group leaves Tansu's group waiting for it, so the next tests' workers could not join."""
    kafka_broker = fresh_kafka_broker
    import uuid

    from tests.fixtures.servers import free_port, write_yaml

    cfg = proxy_config("http://127.0.0.1:9")
    port = free_port()
    cfg["events"] = {"backend": "kafka", "spool": {"dir": str(tmp_path / "spool")},
                     "kafka": {"bootstrap_servers": kafka_broker.bootstrap, "topic_prefix": "h" + uuid.uuid4().hex[:8]}}
    cfg[command] = {"metrics_port": port}
    path = write_yaml(tmp_path / f"{command}.yaml", cfg)
    proc = servers.process([command, "--config", str(path)], command, ready_url=f"http://127.0.0.1:{port}/healthz")
    proc.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "SIGHUP" not in proc.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "reads its config at start only; restart it" in proc.output()
    assert proc.proc.poll() is None
