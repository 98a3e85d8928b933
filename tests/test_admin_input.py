"""Admin API input: actions refuse a body and unknown query parameters before acting, numeric query
parameters refuse nan/inf, /analysis refuses an unknown gate, and an unset admin token variable
makes every admin call 403."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest
from starlette.testclient import TestClient

from modelcanary.compose import create_app
from service.config import parse_config
from tests.fixtures.servers import proxy_config

pytestmark = pytest.mark.timeout(120)
ROUTE = "support-bot"
TOKEN = "adm-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def client_for(tmp_path, monkeypatch, token: str | None = TOKEN, **route) -> TestClient:
    if token is None:
        monkeypatch.delenv("MODELCANARY_ADMIN_TOKEN", raising=False)
    else:
        monkeypatch.setenv("MODELCANARY_ADMIN_TOKEN", token)
    cfg = proxy_config("http://127.0.0.1:9", **route)
    cfg["state_dir"] = str(tmp_path / "state")
    return TestClient(create_app(parse_config(cfg)))


def error_of(response) -> dict:
    err = response.json()["error"]
    assert err["message"] and err["type"] and "code" in err and "param" in err, err
    return err


def phase(client: TestClient) -> dict:
    return client.get(f"/admin/rollouts/{ROUTE}", headers=AUTH).json()


# ---- actions take no body and only ?segment= -------------------------------------------------------------


@pytest.mark.parametrize("action", ["promote", "pause", "resume", "rollback"])
@pytest.mark.parametrize("body", [b"{not json", b'{"weight": 7}', b'{"segment": "json"}', b"[]", b'"x"'])
def test_action_with_a_body_is_refused_before_acting(tmp_path, monkeypatch, action, body):
    client = client_for(tmp_path, monkeypatch)
    before = phase(client)
    r = client.post(f"/admin/rollouts/{ROUTE}/{action}", content=body, headers=AUTH)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["code"] == "unexpected_body" and "takes no body" in err["message"]
    assert "?segment=" in err["message"]
    assert phase(client) == before


def test_action_with_an_empty_body_still_acts(tmp_path, monkeypatch):
    client = client_for(tmp_path, monkeypatch)
    r = client.post(f"/admin/rollouts/{ROUTE}/promote", headers=AUTH)
    assert r.status_code == 200 and r.json()["canary_weight"] > 0
    r = client.post(f"/admin/rollouts/{ROUTE}/pause", content=b"", headers=AUTH)
    assert r.status_code == 200 and r.json()["phase"] == "paused"
    r = client.post(f"/admin/rollouts/{ROUTE}/resume", content=b"{ }", headers=AUTH)  # a bare POST's `{}`
    assert r.status_code == 200 and r.json()["phase"] != "paused"


@pytest.mark.parametrize("query", ["segmnet=json", "weight=7", "segment=json&force=1", "dry_run"])
def test_action_with_an_unknown_query_parameter_is_refused(tmp_path, monkeypatch, query):
    client = client_for(tmp_path, monkeypatch)
    before = phase(client)
    r = client.post(f"/admin/rollouts/{ROUTE}/pause?{query}", headers=AUTH)
    assert r.status_code == 400, r.text
    err = error_of(r)
    name = next(p.split("=")[0] for p in query.split("&") if not p.startswith("segment="))
    assert err["message"] == f"unknown query parameter {name!r}; this endpoint takes: segment"
    assert err["param"] == name and err["code"] == "unknown_parameter"
    assert phase(client) == before


@pytest.mark.parametrize("query", ["segment=", "segment=json&segment=chat"])
def test_action_with_an_empty_or_repeated_segment_is_refused(tmp_path, monkeypatch, query):
    client = client_for(tmp_path, monkeypatch, rollout={"scope": "segment"})
    for seg in ("json", "chat"):
        assert client.post(f"/admin/rollouts/{ROUTE}/promote?segment={seg}", headers=AUTH).status_code == 200
    before = phase(client)
    r = client.post(f"/admin/rollouts/{ROUTE}/pause?{query}", headers=AUTH)
    assert r.status_code == 400 and error_of(r)["param"] == "segment", r.text
    assert phase(client) == before


def test_segment_in_body_or_misspelt_does_not_pause_every_segment(tmp_path, monkeypatch):
    client = client_for(tmp_path, monkeypatch, rollout={"scope": "segment"})
    for seg in ("json", "chat"):
        assert client.post(f"/admin/rollouts/{ROUTE}/promote?segment={seg}", headers=AUTH).status_code == 200
    assert client.post(f"/admin/rollouts/{ROUTE}/pause", content=b'{"segment":"json"}',
                       headers=AUTH | {"Content-Type": "application/json"}).status_code == 400
    assert client.post(f"/admin/rollouts/{ROUTE}/pause?segmnet=json", headers=AUTH).status_code == 400
    segments = phase(client)["segments"]
    assert segments["json"]["phase"] == segments["chat"]["phase"] == "canary"
    # the documented form pauses that segment only
    r = client.post(f"/admin/rollouts/{ROUTE}/pause?segment=json", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["segments"]["json"]["phase"] == "paused" and r.json()["segments"]["chat"]["phase"] == "canary"


def test_action_input_is_checked_on_a_running_proxy(servers):
    """The same through uvicorn: a malformed body is refused and nothing moves."""
    sim = servers.simulator()
    proxy = servers.proxy(proxy_config(sim.url), env={"MODELCANARY_ADMIN_TOKEN": TOKEN})

    def call(method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(proxy.url + path, data=body, method=method, headers=AUTH)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    before = call("GET", f"/admin/rollouts/{ROUTE}")[1]
    status, body = call("POST", f"/admin/rollouts/{ROUTE}/promote", b"{not json")
    assert status == 400 and body["error"]["code"] == "unexpected_body", body
    status, body = call("POST", f"/admin/rollouts/{ROUTE}/pause?segmnet=json", b"")
    assert status == 400 and body["error"]["param"] == "segmnet", body
    assert call("GET", f"/admin/rollouts/{ROUTE}")[1] == before
    status, body = call("POST", f"/admin/rollouts/{ROUTE}/promote", b"")
    assert status == 200 and body["canary_weight"] > 0


# ---- numeric query parameters are finite -----------------------------------------------------------------


@pytest.mark.parametrize("query", ["since=nan", "since=NaN", "since=inf", "since=-inf", "until=nan",
                                   "until=Infinity", "since=1e400", "since=abc"])
def test_traffic_refuses_non_finite_bounds(tmp_path, monkeypatch, query):
    client = client_for(tmp_path, monkeypatch)
    r = client.get(f"/admin/traffic?{query}", headers=AUTH)
    assert r.status_code == 400, r.text
    name = query.split("=")[0]
    err = error_of(r)
    assert err["param"] == name and err["code"] == "invalid_value"
    assert err["message"].startswith(f"{name} must be a unix time in seconds, got ")


def test_traffic_accepts_finite_bounds(tmp_path, monkeypatch):
    client = client_for(tmp_path, monkeypatch)
    r = client.get("/admin/traffic?since=0&until=1e12", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")


# ---- /analysis gate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("query", ["gate=Promote", "gate=promot", "gate=", "gate=healthy",
                                   "gate=promote&gate=x"])
def test_analysis_refuses_an_unknown_gate(tmp_path, monkeypatch, query):
    client = client_for(tmp_path, monkeypatch)
    r = client.get(f"/analysis/{ROUTE}?{query}")
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "gate" and "promote" in err["message"]


def test_analysis_gate_promote_and_no_gate(tmp_path, monkeypatch):
    client = client_for(tmp_path, monkeypatch)
    r = client.get(f"/analysis/{ROUTE}?gate=promote")
    assert r.status_code == 412 and r.json()["promote_ready"] is False  # in shadow: not ready
    r = client.get(f"/analysis/{ROUTE}")
    assert r.status_code == 200 and "healthy" in r.json()


# ---- admin token variable unset ----------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, ""])
def test_every_admin_call_is_403_when_the_token_variable_is_unset(tmp_path, monkeypatch, token):
    client = client_for(tmp_path, monkeypatch, token=token)
    calls = [("GET", "/admin/rollouts"), ("GET", f"/admin/rollouts/{ROUTE}"),
             ("GET", f"/admin/rollouts/{ROUTE}/report"), ("GET", "/admin/traffic"),
             ("POST", f"/admin/rollouts/{ROUTE}/promote"), ("POST", "/admin/reload")]
    for method, path in calls:
        for headers in ({}, {"Authorization": "Bearer anything"}, {"Authorization": ""}):
            r = client.request(method, path, headers=headers)
            assert r.status_code == 403, (method, path, headers, r.text)
            err = error_of(r)
            assert err["code"] == "admin_token_not_set"
            assert "MODELCANARY_ADMIN_TOKEN is not set" in err["message"] and "anything" not in err["message"]


def test_with_the_variable_set_no_header_is_still_401(tmp_path, monkeypatch):
    client = client_for(tmp_path, monkeypatch)
    r = client.get("/admin/rollouts")
    assert r.status_code == 401 and error_of(r)["code"] == "missing_token"
    r = client.get("/admin/rollouts", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403 and error_of(r)["code"] == "invalid_token"


@pytest.mark.parametrize("variable", [TOKEN + "\n", f"  {TOKEN}\r\n"], ids=["lf", "crlf"])  # ids: the same on every xdist worker
def test_a_token_variable_read_from_a_file_with_its_line_break_still_lets_the_operator_in(tmp_path, monkeypatch,
                                                                                          variable):
    """ADMIN_TOKEN="$(cat file)" keeps a CR; a secret mounted as a file ends in a newline."""
    client = client_for(tmp_path, monkeypatch, token=variable)
    assert client.get("/admin/rollouts", headers=AUTH).status_code == 200
    r = client.get("/admin/rollouts", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403 and error_of(r)["code"] == "invalid_token"


def test_a_token_variable_of_only_whitespace_is_unset(tmp_path, monkeypatch):
    client = client_for(tmp_path, monkeypatch, token=" \n")
    r = client.get("/admin/rollouts", headers={"Authorization": "Bearer "})
    assert r.status_code == 403 and error_of(r)["code"] == "admin_token_not_set"


# ---- route names with '/' ------------------------------------------------------------------------------

SLASHED = "acme/support-bot"


def slashed_config(tmp_path=None, extra: tuple[str, ...] = ("acme", "acme/report")) -> dict:
    """Routes `acme/support-bot` (an OpenAI-style model id, as clients name it), and `acme` and
    `acme/report`, whose names the API must never mistake for one another."""
    cfg = proxy_config("http://127.0.0.1:9")
    route = cfg["routes"].pop("support-bot")
    cfg["routes"] = {SLASHED: route, **{name: dict(route) for name in extra}}
    if tmp_path is not None:
        cfg["state_dir"] = str(tmp_path / "state")
    return cfg


def test_a_route_with_a_slash_in_its_name_is_addressed_by_every_endpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELCANARY_ADMIN_TOKEN", TOKEN)
    client = TestClient(create_app(parse_config(slashed_config(tmp_path))))

    def get(path: str, **kw) -> dict:
        r = client.get(path, headers=AUTH, **kw)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()

    # the state and the report: %2F as the CLI sends it, or the '/' as is
    for path in ("/admin/rollouts/acme%2Fsupport-bot", "/admin/rollouts/acme/support-bot"):
        assert get(path)["route"] == SLASHED
        body = get(path + "/report")
        assert body["route"] == body["state"]["route"] == SLASHED
    # acme%2Freport is route acme/report; acme/report is route acme's report
    state = get("/admin/rollouts/acme%2Freport")
    assert state["route"] == "acme/report" and "state" not in state
    body = get("/admin/rollouts/acme/report")
    assert body["route"] == body["state"]["route"] == "acme"
    assert get("/admin/rollouts/acme%2Freport/report")["state"]["route"] == "acme/report"
    # an action acts on that route only
    r = client.post("/admin/rollouts/acme%2Fsupport-bot/pause", headers=AUTH)
    assert r.status_code == 200 and r.json()["route"] == SLASHED and r.json()["phase"] == "paused", r.text
    phases = {s["route"]: s["phase"] for s in get("/admin/rollouts")["rollouts"]}
    assert phases == {SLASHED: "paused", "acme": "shadow", "acme/report": "shadow"}
    r = client.post("/admin/rollouts/acme/support-bot/resume?segment=", headers=AUTH)  # input still checked
    assert r.status_code == 400 and error_of(r)["param"] == "segment"
    r = client.post("/admin/rollouts/acme/support-bot/resume", headers=AUTH)
    assert r.status_code == 200 and r.json()["route"] == SLASHED and r.json()["phase"] == "shadow", r.text
    # route acme/pause does not exist: POST to it is no pause of route acme
    r = client.post("/admin/rollouts/acme%2Fpause", headers=AUTH)
    assert r.status_code == 405, r.text
    r = client.post("/admin/rollouts/acme%2Fsupport-bot%2Fpause", headers=AUTH)
    assert r.status_code == 405, r.text
    r = client.post("/admin/rollouts/acme%2Fsupport-bot/promte", headers=AUTH)
    assert r.status_code == 404 and error_of(r)["code"] == "unknown_action"
    r = client.get("/admin/rollouts/acme%2Fsupport-bo", headers=AUTH)
    assert r.status_code == 404 and "'acme/support-bo'" in error_of(r)["message"]
    assert {s["route"]: s["phase"] for s in get("/admin/rollouts")["rollouts"]} == \
        {SLASHED: "shadow", "acme": "shadow", "acme/report": "shadow"}
    # the token is still required
    assert client.get("/admin/rollouts/acme%2Fsupport-bot").status_code == 401
    assert client.post("/admin/rollouts/acme%2Fsupport-bot/pause").status_code == 401
    # /analysis: the whole rest of the path is the route
    for path in ("/analysis/acme%2Fsupport-bot", "/analysis/acme/support-bot"):
        r = client.get(path)
        assert r.status_code == 200 and r.json()["route"] == SLASHED, r.text
        assert client.get(path, params={"gate": "promote"}).status_code == 412
    assert client.get("/analysis/acme/report").json()["route"] == "acme/report"
    # ordinary names keep their URLs
    assert get("/admin/rollouts/acme")["route"] == "acme"
    assert client.post("/admin/rollouts/acme/promote", headers=AUTH).json()["phase"] == "canary"


def test_the_cli_addresses_a_route_with_a_slash_on_a_running_proxy(servers, capsys):
    """Through uvicorn (its raw path keeps the %2F the CLI sends): status, report and an action on
    `acme/support-bot` reach that route; route `acme` is not touched."""
    from service.admin import cli

    proxy = servers.proxy(slashed_config(extra=("acme",)), env={"MODELCANARY_ADMIN_TOKEN": TOKEN})

    def call(method: str, path: str) -> tuple[int, dict]:
        req = urllib.request.Request(proxy.url + path, data=b"" if method == "POST" else None, method=method,
                                     headers=AUTH)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert cli.status(proxy.url, TOKEN, SLASHED) == 0
    assert SLASHED in capsys.readouterr().out
    assert cli.get_report(proxy.url, TOKEN, SLASHED)["state"]["route"] == SLASHED
    assert cli.act(proxy.url, TOKEN, SLASHED, "pause") == 0
    assert f"{SLASHED}: pause → phase paused" in capsys.readouterr().out
    assert call("GET", "/admin/rollouts/acme%2Fsupport-bot")[1]["phase"] == "paused"
    assert call("GET", "/admin/rollouts/acme")[1]["phase"] == "shadow"
    status, body = call("GET", "/admin/rollouts/acme%2Freport")  # route acme/report: none here
    assert status == 404 and "'acme/report'" in body["error"]["message"], body
    assert call("POST", "/admin/rollouts/acme%2Fpause")[0] == 405
    assert call("GET", "/admin/rollouts/acme")[1]["phase"] == "shadow"
    status, body = call("GET", "/analysis/acme%2Fsupport-bot")
    assert status == 200 and body["route"] == SLASHED and body["phase"] == "paused", body
    assert cli.act(proxy.url, TOKEN, SLASHED, "resume") == 0
    assert call("GET", "/admin/rollouts/acme%2Fsupport-bot")[1]["phase"] == "shadow"


def test_the_cli_never_drops_an_empty_segment_and_shows_what_the_traffic_gets(servers, capsys):
    """`--segment ""` (an unset shell variable) is the server's 400, not an action on every segment; a
    route without a candidate gets 0% of anything (it starts `promoted`: its stable is all there is)."""
    from service.admin import cli

    cfg = proxy_config("http://127.0.0.1:9", rollout={"scope": "segment"})
    cfg["routes"]["plain"] = {"stable": "stable-m"}
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": TOKEN})

    def segments() -> dict:
        req = urllib.request.Request(proxy.url + f"/admin/rollouts/{ROUTE}", headers=AUTH)
        with urllib.request.urlopen(req, timeout=10) as r:
            return {name: seg["phase"] for name, seg in json.loads(r.read())["segments"].items()}

    assert cli.act(proxy.url, TOKEN, ROUTE, "promote", segment="billing") == 0
    assert "segment billing: promote → phase canary, weight 1%, step 1 (candidate-m)" in capsys.readouterr().out
    before = segments()
    assert cli.act(proxy.url, TOKEN, ROUTE, "rollback", segment="") == 1
    assert "segment is empty" in capsys.readouterr().err
    assert segments() == before and "rolled_back" not in before.values()
    assert cli.act(proxy.url, TOKEN, ROUTE, "rollback", segment="search") == 0  # from shadow: no step taken
    assert "segment search: rollback → phase rolled_back, weight 0%, step –" in capsys.readouterr().out

    assert cli.status(proxy.url, TOKEN, "plain") == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "plain" in line)
    assert "promoted" in row and " 0% " in row and "100%" not in row, row
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
        exported = r.read().decode()
    assert 'modelcanary_rollout_canary_weight_ratio{route="plain"} 0.0' in exported
