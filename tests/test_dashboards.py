"""Dashboards as code: committed JSON is fresh, well formed, SDK-valid, and every query is valid PromQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard

from dashboards import build
from dashboards.panels import or_zero
from dashboards.queries import annotation_queries, default_variables, panel_queries, substitute

ROOT = Path(__file__).resolve().parents[1]
JSON_DIR = ROOT / "dashboards" / "json"
CHART_FILES = ROOT / "helm" / "modelcanary" / "files"
UIDS = ["modelcanary-rollout", "modelcanary-shadow", "modelcanary-health"]
STALE = "stale: run `modelcanary dashboards build` (or `make dashboards`) and commit the result"


@pytest.fixture(scope="module")
def models() -> dict[str, dict]:
    return build.build_all()


def committed(uid: str) -> dict:
    return json.loads((JSON_DIR / f"{uid}.json").read_text())


def test_fixed_uids(models):
    assert list(models) == UIDS
    for uid, model in models.items():
        assert model["uid"] == uid
        assert model["title"].startswith("modelcanary / ")


def test_committed_json_is_fresh(models):
    assert sorted(p.name for p in JSON_DIR.glob("*.json")) == sorted(f"{uid}.json" for uid in UIDS)
    for uid, model in models.items():
        assert (JSON_DIR / f"{uid}.json").read_text() == build.render(model), f"{uid}: {STALE}"


def test_generation_is_deterministic(tmp_path):
    build.write(tmp_path / "a", chart_dir=tmp_path / "chart-a")
    build.write(tmp_path / "b", chart_dir=tmp_path / "chart-b")
    for uid in UIDS:
        a = (tmp_path / "a" / "json" / f"{uid}.json").read_bytes()
        assert a == (tmp_path / "b" / "json" / f"{uid}.json").read_bytes()
        assert a == (tmp_path / "chart-a" / "files" / "dashboards" / f"{uid}.json").read_bytes()
        assert a.endswith(b"}\n") and b'\n  "uid": ' in a
    assert (tmp_path / "chart-a" / "files" / "prometheus" / "rules.yaml").read_bytes() == build.RULES_FILE.read_bytes()


def test_a_build_into_a_directory_writes_only_there(tmp_path):
    """`modelcanary dashboards build --out DIR` leaves the installed package's chart alone."""
    out = tmp_path / "out"
    written = build.write(out)
    assert written and all(out in p.parents for p in written), written


def test_chart_copies_are_identical():
    for uid in UIDS:
        chart_copy = CHART_FILES / "dashboards" / f"{uid}.json"
        assert chart_copy.is_file(), f"{chart_copy} missing: {STALE}"
        assert chart_copy.read_bytes() == (JSON_DIR / f"{uid}.json").read_bytes(), f"{chart_copy}: {STALE}"
    rules_copy = CHART_FILES / "prometheus" / "rules.yaml"
    assert rules_copy.read_bytes() == build.RULES_FILE.read_bytes(), f"{rules_copy}: {STALE}"


@pytest.mark.parametrize("uid", UIDS)
def test_variables(uid):
    variables = {v["name"]: v for v in committed(uid)["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    route = variables["route"]
    assert route["type"] == "query"
    assert route["query"] == "label_values(modelcanary_requests_total, route)"
    assert route["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


@pytest.mark.parametrize("uid", UIDS)
def test_every_panel_has_a_prometheus_query(uid):
    model = committed(uid)
    panels = [p for p in model["panels"] if p["type"] != "row"]
    assert len(panels) >= 4
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        targets = panel.get("targets") or []
        assert targets, f"{panel['title']} has no targets"
        for t in targets:
            assert t["expr"].strip(), f"{panel['title']} has an empty expr"
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert len({t["refId"] for t in targets}) == len(targets)
    for q in panel_queries(model):
        if "route" in q.expr and "modelcanary_" in q.expr and "{" in q.expr:
            assert 'route=~"$route"' in q.expr, q


def test_issue_panels_are_there(models):
    exprs = {uid: " ".join(q.expr for q in panel_queries(m)) for uid, m in models.items()}
    rollout = exprs["modelcanary-rollout"]
    for metric in ("modelcanary_requests_total", "modelcanary_client_retries_total",
                   "modelcanary_request_duration_seconds_bucket", "modelcanary_time_to_first_token_seconds_bucket",
                   "modelcanary_failures_total", "modelcanary_tokens_total", "modelcanary_cost_usd_total",
                   "modelcanary_rollout_canary_weight_ratio", "modelcanary_rollout_phase",
                   "modelcanary_rollout_decisions_total"):
        assert metric in rollout, metric
    assert "sum by (role, cause)" in rollout and "sum by (role, blame)" in rollout
    assert "sum by (segment, role)" in rollout
    # the routing table: which model serves each segment now, and each segment's own weight and phase
    assert "sum by (segment, model, role)" in rollout
    assert "modelcanary_rollout_segment_weight_ratio" in rollout and "modelcanary_rollout_segment_phase" in rollout
    assert [n for n, _ in annotation_queries(models["modelcanary-rollout"])] == [
        "decision: step", "decision: promote", "decision: rollback"]
    shadow = exprs["modelcanary-shadow"]
    for metric in ("modelcanary_shadow_agreement_total", "modelcanary_shadow_evaluations_total",
                   "modelcanary_shadow_dropped_total", "modelcanary_shadow_requests_total",
                   "modelcanary_shadow_similarity_sum", "modelcanary_shadow_similarity_bucket",
                   "modelcanary_shadow_judge_total"):
        assert metric in shadow, metric
    health = exprs["modelcanary-health"]
    for metric in ("modelcanary_requests_total", "modelcanary_in_flight_requests", "modelcanary_upstream_retries_total",
                   "modelcanary_events_published_total", "modelcanary_events_spooled",
                   "modelcanary_events_dropped_total", "modelcanary_consumer_lag", "process_cpu_seconds_total",
                   "process_resident_memory_bytes"):
        assert metric in health, metric


@pytest.mark.parametrize("uid", UIDS)
def test_round_trips_through_the_sdk_models(uid):
    register_default_plugins()
    original = committed(uid)
    decoded = Dashboard.from_json(original)
    assert decoded.uid == uid
    assert all(type(t).__module__.endswith(".prometheus") for p in decoded.panels if p.type_val != "row"
               for t in p.targets)
    again = json.loads(json.dumps(decoded, cls=JSONEncoder))
    assert again == original


def test_substitute():
    v = default_variables("support-bot")
    assert substitute('rate(x{route=~"$route"}[$__rate_interval]) ${route} $__range $other', v) == \
        'rate(x{route=~"support-bot"}[1m]) support-bot 5m $other'


@pytest.mark.requires("prometheus")
def test_every_expression_is_valid_promql(models, prometheus_factory):
    """Syntax and types, against a real Prometheus (data comes in the end-to-end test)."""
    prom = prometheus_factory([], scrape_self=True)
    variables = default_variables("support-bot")
    checked = 0
    for model in models.values():
        exprs = [q.expr for q in panel_queries(model)] + [e for _, e in annotation_queries(model)]
        for expr in exprs:
            concrete = substitute(expr, variables)
            assert "$" not in concrete, concrete
            prom.query(concrete)   # raises PrometheusError on a bad expression
            checked += 1
    assert checked >= 30
    # The fallbacks make drop panels non-empty before the first drop...
    assert prom.query(substitute(
        next(q.expr for q in panel_queries(models["modelcanary-shadow"]) if "dropped" in q.expr), variables))
    # ...and vanish as soon as the real series exist.
    prom.wait_for("up")
    assert [r["metric"] for r in prom.query(or_zero("sum by (job) (up)", "job"))] == [{"job": "prometheus"}]
    assert [r["metric"] for r in prom.query(or_zero('sum by (job) (up{job="none-yet"})', "job"))] == [{"job": "none"}]


def test_provisioning_files():
    import yaml

    prov = ROOT / "dashboards" / "provisioning"
    dash = yaml.safe_load((prov / "dashboards" / "modelcanary.yaml").read_text())
    assert dash["apiVersion"] == 1 and dash["providers"][0]["type"] == "file"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
