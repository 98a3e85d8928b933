"""The shadow latency pair of an identical candidate (A/A) is even, whatever the shadow path costs:
the candidate's call is paired with the stable model asked again by the same worker at the same time,
not with the live answer, and the two calls start in a random order. Before, an A/A rollout was
rolled back on latency ("share slower than stable p95 (shadow) +82.5 pts") whenever the worker's
calls were slower than live ones (a loaded machine), and against an upstream with one slot the
candidate always waited behind the stable asked again."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from tests.fixtures.servers import QuietHandler, http_server
from tests.test_estimated_usage import ENV, aa_config, admin, judgement, plain

pytestmark = pytest.mark.timeout(150)

LIVE_S = 0.01
SHADOW_S = 0.08   # shadow calls carry no client key: here they take 8× a live call's time
SLOT_S = 0.03     # the one-slot upstream's time per call


@contextmanager
def upstream(serial: bool) -> Iterator[tuple[str, list[float]]]:
    """An OpenAI-shaped upstream: with `serial`, one call at a time, each SLOT_S; else calls that carry
    a client's key (live ones) take LIVE_S and the others (the worker's) SHADOW_S. Its base URL, and
    when it answered each call."""
    answered: list[float] = []

    class Handler(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
            time.sleep(SLOT_S if serial else LIVE_S if self.headers.get("authorization") else SHADOW_S)
            out = plain(body)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            answered.append(time.monotonic())

    with http_server(Handler, serial=serial) as url:
        yield url + "/v1", answered


def latency_evidence(state: dict) -> dict | None:
    found = [e for e in judgement(state).get("evidence") or ()
             if e["metric"] == "latency_p95_exceedance" and e["segment"] == "overall"]
    return found[0] if found else None


@pytest.mark.parametrize("serial", [False, True], ids=["slower-shadow-path", "one-slot-upstream"])
def test_an_identical_candidate_is_not_slower_on_shadow_latency_pairs(servers, serial):
    # held in shadow: a step would start the evidence over while the test reads it
    rollout = {"steps": [50], "min_shadow_samples": 100000, "min_samples_per_step": 100000, "min_step_seconds": 0,
               "max_step_seconds": 3600}
    with upstream(serial) as (url, answered):
        proxy = servers.proxy({**aa_config(url, "m", rollout=rollout), "control": {"interval_s": 0.1}}, env=ENV)
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        deadline = time.monotonic() + 100
        state = admin(proxy.url, "/admin/rollouts/aa")
        while (evidence := latency_evidence(state)) is None or evidence["n"] < 40:
            assert time.monotonic() < deadline, "no 40 latency pairs in time"
            assert state["phase"] == "shadow", judgement(state)
            for i in range(10):
                calls = len(answered) + 3  # the live call, the candidate's and the stable's again
                client.chat.completions.create(model="aa", messages=[{"role": "user", "content": f"Order {i}?"}])
                given_up = time.monotonic() + 5  # then it was not shadowed: the phase check below says why
                while serial and len(answered) < calls and time.monotonic() < given_up:  # no call waits for another request's
                    time.sleep(0.002)
            state = admin(proxy.url, "/admin/rollouts/aa")
    assert state["phase"] == "shadow", judgement(state)
    assert evidence["verdict"] != "worse", evidence
    assert abs(evidence["effect"]) < 0.2, evidence  # before: +0.6 to +0.95
