"""Prometheus rules: promtool check + unit tests (real binaries), and a real server loads them."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.prometheus import PROMTOOL_BIN

RULES_DIR = Path(__file__).resolve().parents[1] / "dashboards" / "prometheus"
RULES = RULES_DIR / "rules.yaml"
RULES_TEST = RULES_DIR / "rules_test.yaml"

pytestmark = pytest.mark.requires("promtool")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL_BIN, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_check_rules():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_test_rules():
    result = promtool("test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_required_rules_exist():
    names = {r.get("record") or r.get("alert") for r in rules()}
    assert {
        "modelcanary:completion_ratio:rate5m",
        "modelcanary:client_retry_ratio:rate5m",
        "modelcanary:model_failure_ratio:rate5m",
        "modelcanary:latency_p95_seconds:rate5m",
        "ModelcanaryCandidateCompletionBelowStable",
        "ModelcanaryShadowDropped",
        "ModelcanaryEventsDropped",
        "ModelcanarySpoolGrowing",
        "ModelcanaryConsumerLagHigh",
        "ModelcanaryProxyErrors",
    } <= names
    candidate = next(r for r in rules() if r.get("alert") == "ModelcanaryCandidateCompletionBelowStable")
    assert candidate["for"] == "5m"


def test_every_alert_tested_firing_and_not_firing_and_every_record_tested():
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    firing, quiet, recorded = set(), set(), set()
    for case in tests:
        for t in case.get("alert_rule_test", []):
            (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
        for t in case.get("promql_expr_test", []):
            recorded.add(t["expr"].split("{")[0])
    alerts = {r["alert"] for r in rules() if "alert" in r}
    records = {r["record"] for r in rules() if "record" in r}
    assert alerts - firing == set(), "alerts without a firing test"
    assert alerts - quiet == set(), "alerts without a not-firing test"
    assert records - recorded == set(), "recording rules without a test"


@pytest.mark.requires("prometheus")
def test_real_prometheus_loads_and_evaluates_the_rules(prometheus_factory):
    """The fixture itself, minimally: Prometheus scraping itself, with our rules loaded."""
    prom = prometheus_factory([], rule_files=[RULES], scrape_self=True)
    targets = prom.wait_targets_up(timeout=30)
    assert [t["labels"]["job"] for t in targets] == ["prometheus"]
    up = prom.wait_for('up{job="prometheus"} == 1', timeout=30)
    assert up[0]["value"][1] == "1"
    assert prom.query("prometheus_build_info")
    groups = {g["name"]: g for g in prom.rules()}
    assert set(groups) == {"modelcanary.recording", "modelcanary.alerts"}
    loaded = [r for g in groups.values() for r in g["rules"]]
    assert len(loaded) == len(rules())
    # After an evaluation round every rule is healthy (valid PromQL against a live server).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        loaded = [r for g in prom.rules() for r in g["rules"]]
        if all(r.get("lastEvaluation", "").startswith("20") and r["health"] == "ok" for r in loaded):
            break
        time.sleep(0.5)
    assert [(r["name"], r["health"], r.get("lastError")) for r in loaded if r["health"] != "ok"] == []
