"""Security: admin token (constant-time compare, audit log without the token), client keys mapped to
routes (401/403, OpenAI-shaped), shadow redaction before a request leaves for Kafka, and one test that
plants unique secrets everywhere a secret can be given and scans every output for them."""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest

from service.bus.kafka import read_topic
from service.config import parse_config
from tests.faults.fault_proxy import FaultProxy
from tests.fixtures.servers import (
    CLI,
    ROOT,
    free_port,
    metric_value,
    proxy_config,
    scrape,
    sim_config,
    write_yaml,
)

pytestmark = pytest.mark.timeout(240)
ROUTE = "support-bot"


def http(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def openai_error(raw: bytes) -> dict:
    err = json.loads(raw)["error"]
    assert err["message"] and err["type"] and "code" in err and "param" in err, err
    return err


# ---- admin token ---------------------------------------------------------------------------------------


def test_admin_token_constant_time_and_audit_log_without_the_token(monkeypatch, caplog, tmp_path):
    import hmac

    from starlette.testclient import TestClient

    import service.admin.api
    from modelcanary.compose import create_app

    token = "adm-" + uuid.uuid4().hex
    monkeypatch.setenv("MODELCANARY_ADMIN_TOKEN", token)
    cfg = proxy_config("http://127.0.0.1:9")
    cfg["state_dir"] = str(tmp_path / "state")
    app = create_app(parse_config(cfg))
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(service.admin.api.hmac, "compare_digest", spy)
    client = TestClient(app)
    caplog.set_level(logging.INFO, logger="modelcanary.audit")

    r = client.get("/admin/rollouts")
    assert r.status_code == 401 and openai_error(r.content)["code"] == "missing_token"
    for wrong in ("Bearer nope", f"Bearer {token}x", f"Bearer {token[:-1]}", "Basic " + token, token):
        r = client.get("/admin/rollouts", headers={"Authorization": wrong})
        assert r.status_code == 403 and openai_error(r.content)["code"] == "invalid_token", wrong
    auth = {"Authorization": f"Bearer {token}"}
    assert client.get("/admin/rollouts", headers=auth).status_code == 200
    for action in ("promote", "pause", "resume", "rollback"):
        assert client.post(f"/admin/rollouts/{ROUTE}/{action}", headers=auth).status_code == 200, action
    # every comparison went through hmac.compare_digest (constant time), never ==
    assert len(calls) == 5 + 1 + 4 and all(b == token.encode() for _, b in calls)

    audit = [r for r in caplog.records if r.name == "modelcanary.audit"]
    text = "\n".join(r.getMessage() for r in audit)
    for action in ("promote", "pause", "resume", "rollback"):
        assert f"operator action={action} route={ROUTE}" in text
    assert text.count("refused admin call") == 6
    assert token not in text and token[:-1] not in text
    assert token not in caplog.text


# ---- client keys ---------------------------------------------------------------------------------------


def test_client_keys_map_keys_to_routes(servers, monkeypatch):
    alpha, beta = "ck-alpha-" + uuid.uuid4().hex, "ck-beta-" + uuid.uuid4().hex
    sim = servers.simulator()
    fault = FaultProxy("127.0.0.1", sim.port, capture_bytes=16 * 1024 * 1024).start()
    try:
        cfg = proxy_config(fault.url)
        cfg["routes"]["other-route"] = {"stable": "candidate-m"}
        cfg["server"] = {"client_keys_env": "MC_CLIENT_KEYS"}
        proxy = servers.proxy(cfg, env={"MC_CLIENT_KEYS": f"{alpha}={ROUTE};{beta}=*"})
        url = proxy.url + "/v1"
        msg = [{"role": "user", "content": "hi"}]

        with pytest.raises(openai.AuthenticationError) as e:  # the SDK needs some key: an unknown one
            openai.OpenAI(base_url=url, api_key="ck-unknown", max_retries=0).chat.completions.create(
                model=ROUTE, messages=msg)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        status, raw = http(url + "/chat/completions", "POST", json.dumps({"model": ROUTE, "messages": msg}).encode(),
                           {"Content-Type": "application/json"})
        assert status == 401 and openai_error(raw)["code"] == "invalid_api_key"

        a = openai.OpenAI(base_url=url, api_key=alpha, max_retries=0)
        b = openai.OpenAI(base_url=url, api_key=beta, max_retries=0)
        assert a.chat.completions.create(model=ROUTE, messages=msg).choices[0].message.content
        with pytest.raises(openai.PermissionDeniedError) as e:
            a.chat.completions.create(model="other-route", messages=msg)
        assert e.value.status_code == 403 and e.value.code == "model_not_allowed"
        with pytest.raises(openai.PermissionDeniedError):
            a.chat.completions.create(model="candidate-m", messages=msg)  # a model key directly: also a name
        with pytest.raises(openai.PermissionDeniedError):
            a.embeddings.create(model="other-route", input="x")  # pass-through endpoints too
        raw_b = b.chat.completions.with_raw_response.create(model="other-route", messages=msg)
        assert raw_b.status_code == 200
        b_request_id = raw_b.headers["x-request-id"]
        assert b.chat.completions.create(model=ROUTE, messages=msg, stream=False).choices

        # feedback needs a key too, and one allowed the request's route
        fb = json.dumps({"request_id": b_request_id, "success": True}).encode()
        status, raw = http(url + "/feedback", "POST", fb, {"Content-Type": "application/json"})
        assert status == 401 and openai_error(raw)["code"] == "invalid_api_key"
        status, raw = http(url + "/feedback", "POST", fb, {"Authorization": f"Bearer {alpha}"})
        assert status == 403, raw
        status, _ = http(url + "/feedback", "POST", fb, {"Authorization": f"Bearer {beta}"})
        assert status == 202
        # `x-api-key` (how Anthropic's clients send a key) is the same key, on every endpoint
        chat_body = json.dumps({"model": ROUTE, "messages": msg}).encode()
        for path, body in (("/chat/completions", chat_body), ("/chat/completions?via=asgi", chat_body),
                           ("/embeddings", json.dumps({"model": ROUTE, "input": "x"}).encode()), ("/feedback", fb)):
            status, raw = http(url + path, "POST", body, {"Content-Type": "application/json", "x-api-key": beta})
            assert status in (200, 202), (path, raw[:300])
            status, raw = http(url + path, "POST", body, {"Content-Type": "application/json", "x-api-key": "ck-no"})
            assert status == 401, (path, raw[:300])

        sent = bytes(fault.captured)
        assert sent.count(b"POST /v1/chat/completions") >= 3
        assert alpha.encode() not in sent and beta.encode() not in sent  # a proxy key never goes upstream
        log = proxy.output()
        assert alpha not in log and beta not in log
    finally:
        fault.stop()


# ---- redaction -----------------------------------------------------------------------------------------


def test_redaction_builtins_are_selected_explicitly():
    from service.bus.memory import MemoryBus
    from service.proxy.recorder import Recorder
    from service.proxy.sampler import ShadowSampler

    cfg = proxy_config("http://127.0.0.1:9")
    cfg["routes"]["both"] = {"stable": "stable-m", "shadow": {"redact": ["builtin:email", "builtin:phone"]}}
    cfg["routes"]["custom"] = {"stable": "stable-m", "shadow": {"redact": [r"acct-\d{6}"]}}
    config = parse_config(cfg)
    rec = Recorder(config, MemoryBus(), ShadowSampler(config), lambda route, segment: True)
    text = "mail ann.lee+x@example.co.uk or call +1 (415) 555-0100, account acct-123456"
    body = {"messages": [{"role": "user", "content": text}], "nested": {"list": [text]}}
    both = json.dumps(rec._redacted("both", body))
    assert "ann.lee" not in both and "555-0100" not in both and "acct-123456" in both
    custom = json.dumps(rec._redacted("custom", body))
    assert "acct-123456" not in custom and "ann.lee+x@example.co.uk" in custom  # no built-ins unless listed
    assert rec._redacted(ROUTE, body) is body  # nothing listed: untouched, no copy


# ---- the planted secrets end to end --------------------------------------------------------------------


class Hook:
    """A webhook receiver that answers 500 (so the controller logs the failure: with the URL?)."""

    def __init__(self) -> None:
        self.posts: list[bytes] = []
        self.called = threading.Event()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                hook.posts.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                hook.called.set()
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_planted_secrets_appear_in_no_output(kafka_broker, servers, tmp_path):
    from tests.test_tracing import Receiver

    tag = uuid.uuid4().hex
    secrets = {
        "client key": "sk-client-" + tag,
        "other header": "hdr-" + tag[::-1],
        "provider key": "sk-provider-" + uuid.uuid4().hex,
        "admin token": "adm-" + uuid.uuid4().hex,
        "config secret": "cfg-" + uuid.uuid4().hex,
    }
    pii = {"email": f"jane.{tag[:8]}@example.com", "phone": "+1 (415) 555-0199", "account": "acct-" + "734201"}
    receiver = Receiver()
    hook = Hook()
    prefix = "sec" + tag[:8]
    try:
        sim_cfg = sim_config()
        sim_cfg["api_key"] = secrets["provider key"]  # the simulator insists on the provider's key
        sim = servers.simulator(sim_cfg)
        cfg = proxy_config(sim.url, shadow={"sample_rate": 1.0, "max_per_minute": 100_000, "noise_floor": True,
                                            "redact": ["builtin:email", "builtin:phone", r"acct-\d{6}"]},
                           rollout={"steps": [50], "min_shadow_samples": 5, "min_samples_per_step": 5,
                                    "min_step_seconds": 0})
        cfg["providers"]["sim"]["api_key_env"] = "SIM_PROVIDER_KEY"
        cfg["server"] = {"client_keys_env": "MC_CLIENT_KEYS"}
        cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": kafka_broker.bootstrap,
                                                       "topic_prefix": prefix, "partitions": 2}}
        cfg["tracing"] = {"otlp_endpoint": receiver.url}
        cfg["notify"] = {"webhook_url": f"http://127.0.0.1:{hook.port}/hooks/{secrets['config secret']}"}
        env = {"SIM_PROVIDER_KEY": secrets["provider key"], "MODELCANARY_ADMIN_TOKEN": secrets["admin token"],
               "MC_CLIENT_KEYS": f"{secrets['client key']}=*"}
        proxy = servers.proxy(cfg, env=env)
        extra = copy.deepcopy(cfg)
        extra["events"]["spool"] = {"dir": str(tmp_path / "workers-spool")}
        collect_port, control_port = free_port(), free_port()
        extra["collect"] = {"concurrency": 4, "metrics_port": collect_port}
        extra["control"] = {"metrics_port": control_port, "interval_s": 0.5}
        extra["state_dir"] = str(tmp_path / "workers-state")
        path = write_yaml(tmp_path / "workers.yaml", extra)
        collect = servers.process(["collect", "--config", str(path)], "collect", env,
                                  f"http://127.0.0.1:{collect_port}/healthz")
        control = servers.process(["control", "--config", str(path)], "control", env,
                                  f"http://127.0.0.1:{control_port}/healthz")

        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=secrets["client key"], max_retries=0, timeout=20,
                               default_headers={"X-Api-Key": secrets["other header"],
                                                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
        text = f"I am {pii['email']}, phone {pii['phone']}, account {pii['account']}. What is my balance?"
        responses: list[str] = []

        def one(i: int) -> str:
            messages = [{"role": "user", "content": f"{text} ({i})"}]
            if i % 2:
                with client.chat.completions.with_streaming_response.create(
                        model=ROUTE, messages=messages, stream=True, stream_options={"include_usage": True}) as r:
                    body = "".join(r.iter_lines())
                    return f"{r.status_code} {dict(r.headers)} {body}"
            raw = client.chat.completions.with_raw_response.create(model=ROUTE, messages=messages)
            return f"{raw.status_code} {dict(raw.headers)} {raw.text}"

        with ThreadPoolExecutor(4) as pool:
            responses += list(pool.map(one, range(24)))
        # error paths write logs too: a bad client key, a bad admin token, an upstream that refuses the key
        responses.append(repr(http(proxy.url + "/v1/chat/completions", "POST", b"{}",
                                   {"Authorization": f"Bearer {secrets['client key']}-wrong"})))
        responses.append(repr(http(proxy.url + "/admin/rollouts", headers={
            "Authorization": f"Bearer {secrets['admin token']}-wrong"})))
        responses.append(repr(http(proxy.url + "/v1/feedback", "POST", json.dumps(
            {"session_id": "nope", "success": True}).encode(), {"Authorization": f"Bearer {secrets['client key']}"})))

        # shadow evaluations arrive (the collect process counts each before publishing it) ...
        collect_url = f"http://127.0.0.1:{collect_port}"
        deadline = time.monotonic() + 150
        while (metric_value(scrape(collect_url), "modelcanary_shadow_requests_total", route=ROUTE,
                                 model="candidate-m") < 24
               and time.monotonic() < deadline):
            time.sleep(0.5)
        evaluations: list[dict] = []
        while len({e["request_id"] for e in evaluations}) < 24 and time.monotonic() < deadline:
            evaluations = read_topic(kafka_broker.bootstrap, f"{prefix}.evaluations", timeout_s=5)
        assert len({e["request_id"] for e in evaluations}) >= 24
        # ... and the controller, once it leads, calls the webhook on a phase change: its own decision,
        # or, when the judge has not decided yet (it needs no particular speed here), an operator's
        # promote that it follows (a change made before any controller leads is nobody's to notify)
        control_url = f"http://127.0.0.1:{control_port}"
        while (metric_value(scrape(control_url), "modelcanary_controller_leader") < 1
               and time.monotonic() < deadline):
            time.sleep(0.2)
        assert metric_value(scrape(control_url), "modelcanary_controller_leader") == 1, "the controller never led"
        if not hook.called.is_set():
            promoted = http(proxy.url + f"/admin/rollouts/{ROUTE}/promote", "POST",
                            headers={"Authorization": f"Bearer {secrets['admin token']}"})
            assert promoted[0] in (200, 409), promoted  # 409: the controller ended the rollout meanwhile
        assert hook.called.wait(60), "the controller never called the webhook"

        # report and status, token given on the command line
        report = subprocess.run(CLI + ["report", ROUTE, "--url", proxy.url, "--token", secrets["admin token"],
                                       "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        status = subprocess.run(CLI + ["status", "--url", proxy.url, "--token", secrets["admin token"]],
                                capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert report.returncode == 0 and status.returncode == 0, (report.stderr, status.stderr)
        assert json.loads(report.stdout)

        spans = receiver.wait_spans(40, timeout=15)
        assert len(spans) >= 40  # live and shadow spans were exported

        outputs: dict[str, str] = {}
        for topic in ("outcomes", "traffic", "evaluations", "rollouts", "reports", "control"):
            records = read_topic(kafka_broker.bootstrap, f"{prefix}.{topic}", timeout_s=10)
            assert records, topic
            outputs[f"kafka {topic}"] = json.dumps(records)
        outputs["otlp"] = b"".join(receiver.raw).decode("latin-1")
        outputs["metrics proxy"] = scrape(proxy.url)
        outputs["metrics collect"] = scrape(f"http://127.0.0.1:{collect_port}")
        outputs["metrics control"] = scrape(f"http://127.0.0.1:{control_port}")
        outputs["report"] = report.stdout + report.stderr
        outputs["status"] = status.stdout + status.stderr
        outputs["responses"] = "\n".join(responses)
        outputs["webhook"] = b"".join(hook.posts).decode()
        control.stop()
        collect.stop()
        proxy.stop()
        for name, p in (("log proxy", proxy.log), ("log collect", collect.log), ("log control", control.log)):
            outputs[name] = Path(p).read_text(errors="replace")
        for f in tmp_path.rglob("*"):  # spool segments, state files
            if f.is_file() and f.suffix not in (".yaml", ".log"):
                outputs[f"file {f.relative_to(tmp_path)}"] = f.read_bytes().decode("latin-1")

        for name, secret in secrets.items():
            for where, text_out in outputs.items():
                assert secret not in text_out, f"{name} leaked into {where}"
        # redaction: the traffic topic (and so every shadow replay) never carries the PII ...
        for where in ("kafka traffic", "kafka evaluations"):
            for value in pii.values():
                assert value not in outputs[where], f"{value} not redacted in {where}"
        assert "[REDACTED]" in outputs["kafka traffic"]
        # ... while the live call went upstream as the client sent it
        assert metric_value(outputs["metrics proxy"], "modelcanary_requests_total", route=ROUTE,
                            outcome="completed") >= 24
    finally:
        receiver.close()
        hook.close()
