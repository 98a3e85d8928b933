"""The admin CLI against a running proxy (and against a server that is none): a token read from a file
with its line break works; `report` says how old the report is and, once the rollout has ended, that
its judgement is the last before the end; a 404 feedback is in the report's feedback section as on
/metrics; an answer of another shape is one line, not a traceback."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid

import pytest

from service.admin import cli
from tests.fixtures.servers import canned_upstream, metric_value, proxy_config, scrape

pytestmark = pytest.mark.timeout(120)
ROUTE = "support-bot"
TOKEN = "adm-" + uuid.uuid4().hex
STEPS = [10, 50]


def run(capsys, args: list[str]) -> tuple[int, str, str]:
    from modelcanary.compose import main

    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def proxy(servers):
    """A memory-mode proxy whose route has a candidate: the embedded controller reports on it at once."""
    return servers.proxy(proxy_config("http://127.0.0.1:9", rollout={"steps": STEPS}),
                         env={"MODELCANARY_ADMIN_TOKEN": TOKEN})


def report_after(url: str, since: float, timeout_s: float = 30.0) -> dict:
    """The route's first report generated after `since` (the embedded controller reports every few seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rep = cli.get_report(url, TOKEN, ROUTE)["report"]
        if rep and rep["generated_at"] > since:
            return rep
        assert time.monotonic() < deadline, f"no report after {since}: {rep}"
        time.sleep(0.2)


def test_a_token_read_from_a_file_with_its_line_break_works(proxy, capsys, monkeypatch):
    monkeypatch.setenv("MODELCANARY_ADMIN_TOKEN", TOKEN + "\r\n")  # TOKEN="$(cat file)" of a CRLF file
    code, out, err = run(capsys, ["promote", ROUTE, "--url", proxy.url])
    assert code == 0, err
    assert f"{ROUTE}: promote → phase canary, weight 10%" in out


def test_report_says_its_age_and_when_the_rollout_ended_that_its_judgement_was_the_last(proxy, capsys):
    report_after(proxy.url, 0)
    code, out, _ = run(capsys, ["report", ROUTE, "--url", proxy.url, "--token", TOKEN])
    assert code == 0
    assert "report generated " in out and "s ago, in phase shadow" in out, out
    assert "\njudge: hold" in out and "last before" not in out, out

    for _ in range(len(STEPS) + 1):
        assert cli.act(proxy.url, TOKEN, ROUTE, "promote") == 0
    code, out, _ = run(capsys, ["report", ROUTE, "--url", proxy.url, "--token", TOKEN])
    assert code == 0
    assert "the rollout has ended (promoted) since: the judgement below is the last before it ended" in out, out
    assert "\njudge (last before the rollout ended): hold" in out and "\njudge: " not in out, out


def test_feedback_on_an_unknown_request_is_in_the_reports_feedback_section(proxy):
    """README: unmatched feedback is counted on /metrics and in the report; in embedded mode the 404s too."""
    for i in range(3):
        req = urllib.request.Request(proxy.url + "/v1/feedback", method="POST",
                                     data=json.dumps({"request_id": f"nope-{i}", "success": False}).encode(),
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(req, timeout=10)
        assert answer.value.code == 404
    sent = time.time()
    assert metric_value(scrape(proxy.url), "modelcanary_feedback_unmatched_total", route="unknown") == 3
    feedback = report_after(proxy.url, sent)["feedback"]
    assert feedback["unmatched_unknown_route"] == 3, feedback


@pytest.mark.parametrize("answer", [b"[]", b"", b"not json", b'"rollouts"'])
@pytest.mark.parametrize("command", [["status"], ["status", ROUTE], ["report", ROUTE], ["promote", ROUTE],
                                     ["pause", ROUTE, "--segment", "json"]])
def test_a_server_that_is_no_admin_api_is_one_line(capsys, command, answer):
    with canned_upstream(answer) as (url, _):
        code, out, err = run(capsys, [*command, "--url", url, "--token", TOKEN])
    assert code == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"{url} is not a modelcanary admin API" in err, err


@pytest.mark.parametrize("answer", [b"{}", b'{"rollouts": [1, 2]}', b'{"segments": []}'])
@pytest.mark.parametrize("command", [["status"], ["pause", ROUTE, "--segment", "json"]])
def test_an_object_of_another_shape_is_one_line(capsys, command, answer):
    with canned_upstream(answer) as (url, _):
        code, out, err = run(capsys, [*command, "--url", url, "--token", TOKEN])
    assert code == 1, out
    assert err.startswith("error: ") and "is not a modelcanary admin API" in err, err
