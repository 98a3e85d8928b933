"""The Helm chart (issue 6), rendered by the real Helm v4 engine from helm-python-sdk.

Every rendered document is checked against the Kubernetes 1.31 schemas (kubernetes-validate,
strict) or, for the Prometheus Operator and Argo Rollouts kinds, against CRD schemas vendored
under tests/data/crds. The rendered config must pass `modelcanary check-config`, the rendered
PrometheusRule must pass `promtool check rules`, and the chart's copies of the dashboards and
rules must be byte-identical to their sources in dashboards/.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from tests.fixtures.prometheus import PROMTOOL_BIN
from tests.fixtures.require import require

require("helm")  # the whole module renders with it
import helm_python  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "modelcanary"
CRDS = Path(__file__).resolve().parent / "data" / "crds"
KUBE_VERSION = "1.31"
RELEASE, NAMESPACE = "mc", "llm"
DASHBOARD_UIDS = ("modelcanary-rollout", "modelcanary-shadow", "modelcanary-health")
CONFIG_PATH = "/etc/modelcanary/modelcanary.yaml"

EVERYTHING = {
    "existingSecret": "llm-provider-keys",
    "notify": {"existingSecret": "slack-webhook"},
    "kafka": {  # mutual TLS, no SASL
        "bootstrapServers": "kafka.data.svc:9093",
        "tls": {"enabled": True, "existingSecret": "kafka-client-tls", "certKey": "user.crt", "keyKey": "user.key"},
    },
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    },
    "grafana": {"dashboards": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}},
    "argoRollouts": {"analysisTemplate": {"enabled": True, "route": "example", "count": 5, "initialDelay": "1m"}},
    "proxy": {
        "autoscaling": {"enabled": True, "maxReplicas": 6, "targetMemoryUtilizationPercentage": 80},
        "preStopSleepSeconds": 5,
    },
    "networkPolicy": {
        "enabled": True,
        "proxyFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}],
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "egress": [{"ports": [{"port": 443, "protocol": "TCP"}, {"port": 9093, "protocol": "TCP"}]}],
    },
}

KAFKA_SASL = {
    "existingSecret": "llm-provider-keys",
    "kafka": {
        "bootstrapServers": "kafka-0.kafka.data.svc:9093,kafka-1.kafka.data.svc:9093",
        "sasl": {"enabled": True, "mechanism": "SCRAM-SHA-512", "existingSecret": "kafka-modelcanary-user"},
        "tls": {"enabled": True, "existingSecret": "kafka-cluster-ca", "caKey": "ca.crt"},
    },
}

SCENARIOS = {"default": {}, "everything": EVERYTHING, "kafka-sasl": KAFKA_SASL}

# Prometheus Operator fields newer than the vendored @kubernetes-models/prometheus-operator@4.0.0 schema.
NEWER_RULE_FIELDS = {"keep_firing_for": {"type": "string"}}
NEWER_GROUP_FIELDS = {
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "limit": {"type": "integer"},
    "query_offset": {"type": "string"},
}


# ---------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def chart():
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, values: dict) -> dict[str, str]:
    return chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)


def documents(rendered: dict[str, str]) -> list[dict]:
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, dict[str, str]]:
    return {name: render(chart, values) for name, values in SCENARIOS.items()}


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    found = [
        d for d in by_kind(docs, kind)
        if component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def config_text(docs: list[dict]) -> str:
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if "modelcanary.yaml" in d.get("data", {})]
    return cm["data"]["modelcanary.yaml"]


def rendered_config(docs: list[dict]) -> dict:
    return yaml.safe_load(config_text(docs))


def _strict(schema):
    """Reject unknown fields, as `kubectl apply` does with server-side field validation."""
    if isinstance(schema, dict):
        if schema.get("properties") and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def _crd_validators() -> dict[tuple[str, str], jsonschema.Draft202012Validator]:
    defs_file = (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema" / f"v{KUBE_VERSION}.0-local-strict" / "_definitions.json"
    )
    defs = json.loads(defs_file.read_text())
    registry = Registry().with_resources([
        (defs["$id"], Resource.from_contents(defs)),
        # The @kubernetes-models schemas point at ObjectMeta by its OpenAPI name.
        ("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta", Resource.from_contents({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$ref": f"{defs['$id']}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
        })),
    ])
    validators = {}
    for path in sorted(CRDS.glob("*.json")):
        schema = json.loads(path.read_text())
        api_version = schema["properties"]["apiVersion"]["enum"][0]
        kind = schema["properties"]["kind"]["enum"][0]
        if kind == "PrometheusRule":
            group = schema["properties"]["spec"]["properties"]["groups"]["items"]
            group["properties"].update(NEWER_GROUP_FIELDS)
            group["properties"]["rules"]["items"]["properties"].update(NEWER_RULE_FIELDS)
        validators[(api_version, kind)] = jsonschema.Draft202012Validator(_strict(schema), registry=registry)
    return validators


@pytest.fixture(scope="module")
def crd_validators():
    validators = _crd_validators()
    assert set(k for _, k in validators) == {"ServiceMonitor", "PrometheusRule", "AnalysisTemplate"}
    return validators


def check_config(path: Path, pod_env: dict[str, str] | None = None) -> None:
    """The real `modelcanary check-config FILE`, with the variables the chart gives the pods."""
    exe = Path(sys.executable).with_name("modelcanary")
    exe = str(exe) if exe.exists() else shutil.which("modelcanary")
    assert exe, "the modelcanary console script is not installed (pip install -e .)"
    proc = subprocess.run([exe, "check-config", str(path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(pod_env or {})})
    assert proc.returncode == 0, f"check-config failed:\n{proc.stdout}\n{proc.stderr}"


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_document_validates(rendered, crd_validators, scenario):
    docs = documents(rendered[scenario])
    assert docs
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"]["namespace"] == NAMESPACE, where
        key = (doc["apiVersion"], doc["kind"])
        if key in crd_validators:
            errors = sorted(crd_validators[key].iter_errors(doc), key=lambda e: list(e.path))
            assert not errors, f"{where}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
        else:
            try:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")


def test_default_render_has_the_three_components(rendered):
    docs = documents(rendered["default"])
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted([
        ("ConfigMap", "mc-modelcanary"),
        ("Deployment", "mc-modelcanary-controller"),
        ("Deployment", "mc-modelcanary-proxy"),
        ("Deployment", "mc-modelcanary-workers"),
        ("PodDisruptionBudget", "mc-modelcanary-controller"),
        ("PodDisruptionBudget", "mc-modelcanary-proxy"),
        ("Service", "mc-modelcanary-controller-metrics"),
        ("Service", "mc-modelcanary-proxy"),
        ("Service", "mc-modelcanary-workers-metrics"),
        ("ServiceAccount", "mc-modelcanary"),
    ])
    commands = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]["spec"]["containers"][0]["args"]
        for d in by_kind(docs, "Deployment")
    }
    assert commands == {
        "proxy": ["serve", "--config", CONFIG_PATH, "--host", "0.0.0.0", "--port", "8080"],
        "workers": ["collect", "--config", CONFIG_PATH],
        "controller": ["control", "--config", CONFIG_PATH],
    }


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_workloads_are_wired_and_locked_down(rendered, scenario):
    docs = documents(rendered[scenario])
    config = rendered_config(docs)
    services = {d["metadata"]["name"]: d for d in by_kind(docs, "Service")}
    for deploy in by_kind(docs, "Deployment"):
        component = deploy["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = deploy["spec"]["template"]
        assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        (container,) = spec["containers"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts[CONFIG_PATH] == "config"
        assert volumes["config"]["configMap"]["name"] == "mc-modelcanary"
        # Every path the service writes to lives on an emptyDir (the root filesystem is read-only).
        for writable in (config["events"]["spool"]["dir"], config["state_dir"], "/tmp"):
            mount = max((m for m in mounts if writable == m or writable.startswith(m + "/")), key=len)
            assert "emptyDir" in volumes[mounts[mount]], (component, writable)
        env_names = {e["name"] for e in container.get("env", [])}
        security = config["events"]["kafka"].get("security") or {}
        for key, value in security.items():
            if key.endswith("_env"):
                assert value in env_names, (component, key)
            if key.endswith("file"):
                mount = max((m for m in mounts if value.startswith(m + "/")), key=len)
                assert "secret" in volumes[mounts[mount]], (component, key)
        if scenario != "default":
            assert {"secretRef": {"name": "llm-provider-keys"}} in container["envFrom"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if component == "proxy":
            assert ports == {"http": 8080}
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert spec["terminationGracePeriodSeconds"] > config["server"]["drain_seconds"]
            assert services["mc-modelcanary-proxy"]["spec"]["ports"][0]["targetPort"] == "http"
        else:
            port = config["collect" if component == "workers" else "control"]["metrics_port"]
            assert ports == {"metrics": port}
            assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
            svc = services[f"mc-modelcanary-{component}-metrics"]
            assert svc["spec"]["clusterIP"] == "None"
            assert svc["spec"]["ports"][0]["port"] == port
            assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
        if component == "controller":
            # two controllers: one leads, one stands by; an update starts a standby before it stops one
            assert deploy["spec"]["replicas"] == 2
            assert deploy["spec"]["strategy"] == {"type": "RollingUpdate",
                                                  "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
            assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


def test_controllers_have_a_disruption_budget_and_topics_a_retention(rendered):
    docs = documents(rendered["default"])
    pdbs = {d["metadata"]["name"]: d for d in by_kind(docs, "PodDisruptionBudget")}
    controllers = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "mc-modelcanary-controller")
    pdb = pdbs["mc-modelcanary-controller"]["spec"]
    assert pdb["maxUnavailable"] == 1  # a node drain never takes both controllers
    assert pdb["selector"]["matchLabels"] == controllers["spec"]["selector"]["matchLabels"]
    assert rendered_config(docs)["events"]["kafka"]["retention_hours"] == {
        "outcomes": 168, "traffic": 24, "evaluations": 168}


def test_controller_replicas_and_budget_follow_the_values(chart):
    docs = documents(render(chart, {"controller": {"replicas": 3, "podDisruptionBudget": {
        "maxUnavailable": None, "minAvailable": 2}}}))
    (controllers,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "mc-modelcanary-controller"]
    assert controllers["spec"]["replicas"] == 3
    (pdb,) = [d for d in by_kind(docs, "PodDisruptionBudget") if d["metadata"]["name"] == "mc-modelcanary-controller"]
    assert pdb["spec"] == {"minAvailable": 2, "selector": pdb["spec"]["selector"]}
    docs = documents(render(chart, {"controller": {"replicas": 1, "podDisruptionBudget": {"enabled": False}}}))
    assert [d["metadata"]["name"] for d in by_kind(docs, "PodDisruptionBudget")] == ["mc-modelcanary-proxy"]
    # 0 is a value (no voluntary eviction at all), not "unset"
    docs = documents(render(chart, {component: {"podDisruptionBudget": {"maxUnavailable": 0}}
                                    for component in ("proxy", "controller")}))
    assert [d["spec"]["maxUnavailable"] for d in by_kind(docs, "PodDisruptionBudget")] == [0, 0]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_rendered_config_passes_check_config(rendered, scenario, tmp_path):
    docs = documents(rendered[scenario])
    config = rendered_config(docs)
    assert config["events"]["backend"] == "kafka"
    assert config["events"]["kafka"]["bootstrap_servers"] == (
        SCENARIOS[scenario].get("kafka", {}).get("bootstrapServers", "kafka:9092")
    )
    path = tmp_path / "modelcanary.yaml"
    path.write_text(config_text(docs))
    # the pods get their secrets' variables from the cluster: set to stand-ins here
    check_config(path, {e["name"]: "stand-in" for d in docs if d.get("kind") == "Deployment"
                        for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env") or ()})


def test_own_config_replaces_the_example(chart, tmp_path):
    """The documented way to drop the example: null its entries next to your own."""
    values = {"config": {
        "providers": {"openai": None, "sim": {"base_url": "http://sim.llm.svc:9001/v1", "api_key_env": "SIM_KEY"}},
        "models": {
            "example-stable": None, "example-candidate": None,
            "stable-m": {"provider": "sim", "name": "good-model"},
            "candidate-m": {"provider": "sim", "name": "new-model"},
        },
        "routes": {"example": None, "support-bot": {
            "stable": "stable-m", "candidate": "candidate-m", "task_types": ["billing", "search"],
            "rollout": {"steps": [5, 50], "on_inconclusive": "rollback"},
        }},
    }}
    out = render(chart, values)
    config = rendered_config(documents(out))
    assert set(config["providers"]) == {"sim"} and set(config["models"]) == {"stable-m", "candidate-m"}
    assert set(config["routes"]) == {"support-bot"}
    path = tmp_path / "modelcanary.yaml"
    path.write_text(config_text(documents(out)))
    check_config(path)
    notes = out["modelcanary/templates/NOTES.txt"]
    assert 'model="support-bot"' in notes and "example config" not in notes


def test_kafka_sasl_and_tls_come_from_secrets(rendered, monkeypatch):
    docs = documents(rendered["kafka-sasl"])
    security = rendered_config(docs)["events"]["kafka"]["security"]
    assert security == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username_env": "MODELCANARY_KAFKA_SASL_USERNAME",
        "sasl_plain_password_env": "MODELCANARY_KAFKA_SASL_PASSWORD",
        "ssl_cafile": "/etc/modelcanary/kafka-tls/ca.crt",
        "ssl_check_hostname": True,
    }
    for deploy in by_kind(docs, "Deployment"):
        spec = deploy["spec"]["template"]["spec"]
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in spec["containers"][0]["env"]}
        assert env["MODELCANARY_KAFKA_SASL_USERNAME"] == {"name": "kafka-modelcanary-user", "key": "username"}
        assert env["MODELCANARY_KAFKA_SASL_PASSWORD"] == {"name": "kafka-modelcanary-user", "key": "password"}
        assert {"name": "kafka-tls", "secret": {"secretName": "kafka-cluster-ca"}} in spec["volumes"]
    # Secrets are referenced by name, never rendered.
    assert not by_kind(docs, "Secret")
    # The Kafka bus reads the credentials from the environment the pods get.
    from service.bus.kafka import client_security
    from service.config import KafkaSecurity

    monkeypatch.setenv("MODELCANARY_KAFKA_SASL_USERNAME", "modelcanary")
    monkeypatch.setenv("MODELCANARY_KAFKA_SASL_PASSWORD", "s3cret")
    assert client_security(KafkaSecurity.model_validate(security)) == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "modelcanary",
        "sasl_plain_password": "s3cret",
        "ssl_cafile": "/etc/modelcanary/kafka-tls/ca.crt",
        "ssl_check_hostname": True,
    }


def test_the_charts_kafka_keys_win_over_the_users_in_either_form(chart, tmp_path):
    """The user's `<key>_env` (or `<key>`) for a setting the chart owns is replaced by the chart's, never
    left beside it (check-config refuses both forms at once, so every pod would exit)."""
    import copy

    values = copy.deepcopy(KAFKA_SASL)
    values["config"] = {**values.get("config", {}), "events": {"kafka": {"security": {
        "ssl_cafile_env": "MY_CA", "sasl_plain_username": "bob", "ssl_ciphers": "HIGH"}}}}
    docs = documents(render(chart, values))
    security = rendered_config(docs)["events"]["kafka"]["security"]
    assert security["ssl_cafile"] == "/etc/modelcanary/kafka-tls/ca.crt" and "ssl_cafile_env" not in security
    assert security["sasl_plain_username_env"] == "MODELCANARY_KAFKA_SASL_USERNAME"
    assert "sasl_plain_username" not in security
    assert security["ssl_ciphers"] == "HIGH"  # what the chart does not own stays the user's
    path = tmp_path / "modelcanary.yaml"
    path.write_text(config_text(docs))
    check_config(path, {"MODELCANARY_KAFKA_SASL_USERNAME": "u", "MODELCANARY_KAFKA_SASL_PASSWORD": "p"})


def test_the_webhook_url_comes_from_a_secret(chart, tmp_path, monkeypatch):
    """A Slack-style webhook URL (its path is the secret) reaches the pods that notify (proxies: operator
    actions; controllers: the judge's) from the Secret, and only its variable's name is in the ConfigMap."""
    values = {"notify": {"existingSecret": "slack-webhook", "urlKey": "webhook-url"},
              "config": {"notify": {"webhook_url_env": "MY_OWN_VARIABLE"}}}  # the chart's wins
    docs = documents(render(chart, values))
    assert rendered_config(docs)["notify"] == {"webhook_url_env": "MODELCANARY_WEBHOOK_URL"}
    given = {"name": "MODELCANARY_WEBHOOK_URL",
             "valueFrom": {"secretKeyRef": {"name": "slack-webhook", "key": "webhook-url"}}}
    for component, gets_it in (("proxy", True), ("controller", True), ("workers", False)):
        container = one(docs, "Deployment", component)["spec"]["template"]["spec"]["containers"][0]
        assert (given in (container.get("env") or [])) is gets_it, component
    assert not by_kind(docs, "Secret")
    path = tmp_path / "modelcanary.yaml"
    path.write_text(config_text(docs))
    url = "https://hooks.slack.com/services/T0/B0/XX"
    check_config(path, {"MODELCANARY_WEBHOOK_URL": url})
    from service.config import load_config
    from service.rollout.notify import configured_url

    monkeypatch.setenv("MODELCANARY_WEBHOOK_URL", url)
    assert configured_url(load_config(path).notify) == url


def test_everything_enabled(rendered):
    docs = documents(rendered["everything"])
    proxy = one(docs, "Deployment", "proxy")
    assert "replicas" not in proxy["spec"]  # the HPA owns it
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": proxy["metadata"]["name"]}
    assert proxy["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]

    services = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in by_kind(docs, "Service")}
    monitors = by_kind(docs, "ServiceMonitor")
    assert sorted(m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors) == [
        "controller", "proxy", "workers"]
    for monitor in monitors:
        component = monitor["metadata"]["labels"]["app.kubernetes.io/component"]
        svc = services[component]
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        # the controller's leader gauge keeps its own `instance` label (host:pid), as the docs query it
        assert endpoint.get("honorLabels", False) == (component == "controller")
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}

    dashboards = by_kind(docs, "ConfigMap")
    dashboards = [d for d in dashboards if d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert sorted(k for d in dashboards for k in d["data"]) == sorted(f"{uid}.json" for uid in DASHBOARD_UIDS)
    for cm in dashboards:
        ((filename, body),) = cm["data"].items()
        assert body.rstrip("\n") == (CHART / "files" / "dashboards" / filename).read_text().rstrip("\n")
        assert json.loads(body)["uid"] == filename.removesuffix(".json")
        assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}

    analysis = one(docs, "AnalysisTemplate")
    (metric,) = analysis["spec"]["metrics"]
    assert metric["successCondition"] == "result.healthy == true"
    assert metric["provider"]["web"]["url"] == f"http://mc-modelcanary-proxy.{NAMESPACE}.svc:8080/analysis/{{{{args.route}}}}"
    assert analysis["spec"]["args"] == [{"name": "route", "value": "example"}]

    policies = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in by_kind(docs, "NetworkPolicy")}
    assert sorted(policies) == ["controller", "proxy", "workers"]
    assert policies["proxy"]["spec"]["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert len(policies["proxy"]["spec"]["ingress"][0]["from"]) == 2
    assert policies["workers"]["spec"]["ingress"][0]["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert {"port": 53, "protocol": "UDP"} in policies["controller"]["spec"]["egress"][0]["ports"]

    assert rendered_config(docs)["events"]["kafka"]["security"] == {
        "security_protocol": "SSL",
        "ssl_cafile": "/etc/modelcanary/kafka-tls/ca.crt",
        "ssl_certfile": "/etc/modelcanary/kafka-tls/user.crt",
        "ssl_keyfile": "/etc/modelcanary/kafka-tls/user.key",
        "ssl_check_hostname": True,
    }


@pytest.mark.requires("promtool")
def test_prometheus_rule_passes_promtool(rendered, tmp_path):
    promtool = PROMTOOL_BIN
    rule = one(documents(rendered["everything"]), "PrometheusRule")
    source = yaml.safe_load((CHART / "files" / "prometheus" / "rules.yaml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@pytest.mark.parametrize("values", [{}, EVERYTHING, KAFKA_SASL], ids=list(SCENARIOS))
def test_lint_reports_no_errors(values):
    report = helm_python.lint(CHART, copy.deepcopy(values), namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize(("values", "expected"), [
    ({"proxy": {"replicas": "3"}}, "/proxy/replicas"),
    ({"workers": {"replicas": "2"}}, "/workers/replicas"),
    ({"replicaCount": 2}, "replicaCount"),
    ({"proxy": {"replica": 2}}, "replica"),
    ({"controller": {"replicas": 0}}, "/controller/replicas"),
    ({"config": {"events": {"kafka": {"retention_hours": {"rollouts": 1}}}}}, "retention_hours"),
    ({"config": {"state_dir": "/data"}}, "/config/state_dir"),
    ({"config": {"events": {"backend": "memory"}}}, "/config/events/backend"),
    ({"config": {"events": {"kafka": {"bootstrap_servers": "x:9092"}}}}, "bootstrap_servers"),
    ({"kafka": {"bootstrapServers": "kafka"}}, "/kafka/bootstrapServers"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
])
def test_schema_rejects_bad_values(chart, values, expected):
    with pytest.raises(helm_python.HelmValuesError) as err:
        render(chart, values)
    assert expected in str(err.value)


@pytest.mark.parametrize(("values", "expected"), [
    ({"kafka": {"sasl": {"enabled": True}}}, "kafka.sasl.existingSecret is required"),
    ({"kafka": {"tls": {"enabled": True}}}, "kafka.tls.existingSecret is required"),
    ({"proxy": {"terminationGracePeriodSeconds": 20}}, "must be larger than config.server.drain_seconds"),
    ({"proxy": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 3}}}, "larger than maxReplicas"),
    ({"config": {"events": {"kafka": {"security": {"sasl_plain_password": "hunter2"}}}}},
     "config.events.kafka.security.sasl_plain_password would put a secret in the ConfigMap"),
    ({"config": {"events": {"kafka": {"security": {"ssl_password": "hunter2"}}}}},
     "config.events.kafka.security.ssl_password would put a secret in the ConfigMap"),
    ({"config": {"notify": {"webhook_url": "https://hooks.slack.com/services/T0/B0/XX"}}},
     "config.notify.webhook_url would put a secret in the ConfigMap: give it from a Secret with "
     "notify.existingSecret"),
])
def test_render_refuses_unsafe_values(chart, values, expected):
    with pytest.raises(helm_python.HelmError) as err:
        render(chart, values)
    assert expected in str(err.value)


def test_packaged_chart_carries_its_files(tmp_path):
    archive = helm_python.package(CHART, destination=tmp_path)
    with helm_python.Chart.load(archive) as packaged:
        docs = documents(render(packaged, EVERYTHING))
    assert len(by_kind(docs, "PrometheusRule")) == 1
    assert len([d for d in by_kind(docs, "ConfigMap") if "grafana_dashboard" in d["metadata"]["labels"]]) == 3


def test_chart_files_are_byte_identical_to_dashboards_sources():
    """`modelcanary dashboards build` writes dashboards/ and the chart's files/ from one source."""
    sources = {
        "dashboards": ROOT / "dashboards" / "json",
        "prometheus": ROOT / "dashboards" / "prometheus",
    }
    files = sorted(p for p in (CHART / "files").rglob("*") if p.is_file())
    assert files, "helm/modelcanary/files is empty: run `modelcanary dashboards build`"
    stale = []
    for path in files:
        rel = path.relative_to(CHART / "files")
        source = sources[rel.parts[0]].joinpath(*rel.parts[1:])
        if not source.is_file() or source.read_bytes() != path.read_bytes():
            stale.append(f"{rel} != {source.relative_to(ROOT)}")
    assert not stale, "run `modelcanary dashboards build`: " + ", ".join(stale)
    chart_files = {p.relative_to(CHART / "files").as_posix() for p in files}
    expected = {f"dashboards/{uid}.json" for uid in DASHBOARD_UIDS} | {"prometheus/rules.yaml"}
    expected |= {f"dashboards/{p.name}" for p in sources["dashboards"].glob("*.json")}
    assert expected <= chart_files, f"missing from the chart: {sorted(expected - chart_files)}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_notes_render(rendered, scenario):
    notes = rendered[scenario]["modelcanary/templates/NOTES.txt"]
    assert f"http://mc-modelcanary-proxy.{NAMESPACE}.svc:8080/v1" in notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/mc-modelcanary-proxy 8080:8080" in notes
    assert "{{" not in notes and "<no value>" not in notes
    if scenario == "everything":
        assert "grafana_dashboard=1" in notes and "AnalysisTemplate mc-modelcanary" in notes
    else:
        assert "grafana.dashboards.enabled=true" in notes


def test_notes_warn_about_idle_workers(chart):
    notes = render(chart, {"workers": {"replicas": 8}})["modelcanary/templates/NOTES.txt"]
    assert "workers.replicas (8) exceeds the topic partitions (6" in notes


def test_dockerfile_builds_a_non_root_image():
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"(?im)^FROM\s+", text)[1:]
    assert len(stages) >= 2, "multi-stage build expected"
    assert all(s.startswith("python:3.11-slim") for s in stages)
    assert re.search(r"(?m)^RUN .*pip wheel ", stages[0])
    final = stages[-1]
    assert not re.search(r"(?i)\b(gcc|build-essential|apt-get install)\b", final), "no build tools in the final image"
    assert re.search(r"--no-index", final)
    assert re.search(r"(?m)^USER 10001(:10001)?\s*$", final)
    assert re.search(r'(?m)^ENTRYPOINT \["modelcanary"\]\s*$', final)
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
