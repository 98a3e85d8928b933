"""A restarted controller resumes its judge's evidence, not only the phase and step.

`modelcanary control` on a real broker (Tansu) is fed outcomes and evaluations, killed with SIGKILL and
started again: the first report of the new process already counts what the old one had counted (read
back from the topics since the rollout began, up to the group's commits, into the windows the latest
rollout state lists), and records delivered twice count once."""

from __future__ import annotations

import asyncio
import copy
import signal
import time
import uuid
from pathlib import Path

import pytest

from service.bus.kafka import KafkaBus, read_topic
from service.config import KafkaConfig, SpoolConfig
from service.judge.evidence import RouteEvidence
from service.records import Agreement, CandidateResult, EvaluationRecord, OutcomeEvent, Repro, RolloutState
from tests.fixtures.servers import free_port, proxy_config, write_yaml
from tests.judge_traffic import evaluation, make_config, outcome

ROUTE = "support-bot"


# ---- units: deduplication and the rollout history ------------------------------------------------------


def test_evidence_counts_a_record_delivered_twice_once():
    cfg = make_config()
    rc = cfg.routes["bot"]
    state = RolloutState(route="bot", stable="stable-m", candidate="candidate-m", phase="canary",
                         canary_weight=0.1, step_index=0, since=time.time() - 10)
    ev = RouteEvidence("bot", rc, "stable-m", "candidate-m")
    ev.sync(state)
    o = outcome("canary", "chat", True)
    e = evaluation("chat", True)
    assert ev.add_outcome(o) and ev.add_evaluation(e)
    assert not ev.add_outcome(o.model_copy())  # the same record again
    again = e.model_copy(update={"ts": e.ts + 1})  # a shadow worker evaluated the request again
    assert not ev.add_evaluation(again)
    assert ev.duplicates == 2
    assert ev.current.candidate_requests == 1 and ev.current.shadow_records == 1
    fb = outcome("canary", "chat", True)
    fb.kind, fb.outcome, fb.success = "feedback", None, True
    fb.request_id = fb.session_id_hash = "5e55" * 4  # feedback by session: its id is the session's hash
    later = fb.model_copy(update={"ts": fb.ts + 5})  # the same id, another task
    assert ev.add_outcome(fb) and ev.add_outcome(later) and not ev.add_outcome(fb.model_copy())
    assert ev.totals(("live", "candidate"), "overall").fb_n == 2


def test_the_latest_state_lists_the_windows_of_its_rollout():
    from service.records import LastDecision
    from service.rollout.book import RolloutBook

    cfg = make_config()
    book = RolloutBook(cfg)
    first = book.get("bot")
    book.decide("bot", LastDecision(decision="hold", reasons=["wait"]))          # a verdict: same window
    book.decide("bot", LastDecision(decision="step", reasons=["ok"]))            # shadow -> canary 0
    book.operate("bot", "pause")
    book.operate("bot", "resume")
    latest = book.get("bot")
    assert [w[:2] for w in latest.windows] == [("shadow", -1), ("canary", 0), ("paused", 0), ("canary", 0)]
    assert latest.windows[0][2] == first.since and latest.windows[-1][2] == latest.since
    # a new controller opens the same evidence windows from that one state
    ev = RouteEvidence("bot", cfg.routes["bot"], "stable-m", "candidate-m")
    for phase, step, since in latest.windows:
        ev.sync(latest.model_copy(update={"phase": phase, "step_index": step, "since": since}))
    ev.sync(latest)
    assert len(ev.windows) == 4


# ---- end to end: kill -9 and restart ------------------------------------------------------------------


def _report(bootstrap: str, prefix: str) -> tuple[dict, dict]:
    """The latest report, from the reports topic (the rollouts topic carries states only)."""
    reports = [r for r in read_topic(bootstrap, f"{prefix}.reports", timeout_s=10) if r.get("route") == ROUTE]
    latest = max(reports, key=lambda r: r.get("ts", 0)) if reports else {}
    return latest, latest.get("report") or {}


def _counts(report: dict) -> tuple[int, int, int]:
    """(live stable n, live candidate n, shadow samples in the current window) from a controller report."""
    overall = (report.get("live") or {}).get("segments", {}).get("overall", {})
    return (overall.get("stable", {}).get("n", 0), overall.get("candidate", {}).get("n", 0),
            (report.get("judge") or {}).get("step_samples", 0))


def _wait_report(bootstrap: str, prefix: str, pred, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    report: dict = {}
    while time.monotonic() < deadline:
        _, report = _report(bootstrap, prefix)
        if report and pred(report):
            return report
        time.sleep(0.3)
    raise AssertionError(f"no such report within {timeout_s}s; last: {_counts(report)}")


def _publish(bootstrap: str, prefix: str, spool: Path, records: list) -> None:
    async def run() -> None:
        bus = KafkaBus(KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=3, linger_ms=5),
                       SpoolConfig(dir=str(spool)), request_timeout_s=2.0)
        await bus.start()
        try:
            for r in records:
                bus.publish("evaluations" if isinstance(r, EvaluationRecord) else "outcomes", r)
            assert await bus.flush(10)
        finally:
            await bus.close()

    asyncio.run(run())


def _outcome(tag: str, i: int, role: str) -> OutcomeEvent:
    return OutcomeEvent(request_id=f"{tag}-{role}-{i}", ts=time.time(), route=ROUTE,
                        model="candidate-m" if role == "canary" else "stable-m", role=role, segment="chat",
                        outcome="completed", latency_s=0.1, cost_usd=0.001)


def _evaluation(tag: str, i: int) -> EvaluationRecord:
    return EvaluationRecord(
        request_id=f"{tag}-shadow-{i}", ts=time.time(), route=ROUTE, segment="chat", stable_model="stable-m",
        candidate_model="candidate-m", candidate=CandidateResult(outcome="completed", latency_s=0.2, cost_usd=0.001),
        agreement=Agreement(candidate_vs_stable=True, stable_vs_stable=True),
        repro=Repro(modelcanary_version="test", config_version="test"), stable_latency_s=0.2, stable_cost_usd=0.001)


@pytest.mark.timeout(240)
def test_restarted_controller_continues_its_evidence(kafka_broker, servers, tmp_path):
    bootstrap, prefix, tag = kafka_broker.bootstrap, "resume" + uuid.uuid4().hex[:8], "r"
    cfg = proxy_config("http://127.0.0.1:9", rollout={
        "steps": [10, 50], "mode": "advisory", "min_step_seconds": 0,
        "min_shadow_samples": 100_000, "min_samples_per_step": 100_000})  # the judge holds: n only grows
    cfg["events"] = {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix,
                                                   "partitions": 3, "linger_ms": 5},
                     "spool": {"dir": str(tmp_path / "control-spool")}}
    port = free_port()
    cfg["control"] = {"metrics_port": port, "interval_s": 0.5, "report_interval_s": 0.5}
    path = write_yaml(tmp_path / "control.yaml", copy.deepcopy(cfg))
    health = f"http://127.0.0.1:{port}/healthz"
    control = servers.process(["control", "--config", str(path)], "control", ready_url=health)
    _wait_report(bootstrap, prefix, lambda r: True, 30)  # the controller judged once: its rollout began

    records = ([_outcome(tag, i, "stable") for i in range(150)] + [_outcome(tag, i, "canary") for i in range(120)]
               + [_evaluation(tag, i) for i in range(40)])
    _publish(bootstrap, prefix, tmp_path / "feed-spool", records)
    before = _wait_report(bootstrap, prefix, lambda r: _counts(r) == (150, 120, 40), 60)
    time.sleep(1.5)  # the controller commits right after it ingests; give it a moment past the report
    control.signal(signal.SIGKILL)
    control.proc.wait(10)
    assert _counts(before) == (150, 120, 40)

    restarted_at = time.time()
    control2 = servers.process(["control", "--config", str(path)], "control-2", ready_url=health)
    first = _wait_report(bootstrap, prefix, lambda r: r.get("generated_at", 0) > restarted_at, 60)
    # its very first report counts what the killed controller had counted: not from 0
    assert _counts(first) == (150, 120, 40), (_counts(first), control2.output()[-3000:])
    assert "evidence rebuilt from" in control2.output()

    # records delivered again (a spool replay, a shadow worker's re-evaluation) count once; new ones count
    again = records[:20] + records[-5:] + [_outcome(tag, i, "canary") for i in range(120, 150)]
    _publish(bootstrap, prefix, tmp_path / "feed-spool", again)
    after = _wait_report(bootstrap, prefix, lambda r: _counts(r)[1] >= 150, 60)
    time.sleep(6.0)  # one more report interval: nothing else arrives
    _, latest = _report(bootstrap, prefix)
    assert _counts(after) == _counts(latest) == (150, 150, 40)
    assert control2.stop() == 0
