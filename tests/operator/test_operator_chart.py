"""The Helm chart rendered with real Helm template semantics (helm-python-sdk, offline), and the
PromQL of its dashboards and rules checked against the metric names the engine really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from superinfer.engine import contract as c
from superinfer.engine.contract import exported_series_names
from superinfer.operator import generate
from superinfer.operator.api.chart_values import ChartValues
from superinfer.operator.main import parse_args, prometheus_source
from superinfer.operator.observability import dashboards, operator_metrics, promql

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "superinfer"
MONITORING_ON = {
    "monitoring": {
        "ignoreCapabilityCheck": True,
        "serviceMonitor": {"enabled": True, "additionalLabels": {"release": "prom"}},
        "enginePodMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True, "attainmentTarget": 0.99},
    }
}
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, values: dict | None = None) -> list[dict]:
    out = chart.render(values or {}, name="si", namespace="superinfer-system", is_install=True)
    return [doc for text in out.values() for doc in yaml.safe_load_all(text) if doc]


def kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def test_lint_passes():
    result = helm.lint(CHART, strict=False)
    assert result["errors"] == [], result


def test_default_render_validates(chart):
    docs = render(chart)
    assert kinds(docs) == sorted(
        ["CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
         "ServiceAccount", *["ConfigMap"] * 4]
    )  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)


def test_crd_template_matches_crds_folder_and_is_kept(chart):
    crd = next(d for d in render(chart) if d["kind"] == "CustomResourceDefinition")
    plain = yaml.safe_load((ROOT / generate.CRD_FILE).read_text())
    assert crd["spec"] == plain["spec"]
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert "CustomResourceDefinition" not in kinds(render(chart, {"crds": {"install": False}}))
    unkept = next(d for d in render(chart, {"crds": {"keep": False}}) if d["kind"] == "CustomResourceDefinition")
    assert "annotations" not in unkept["metadata"]


def test_monitoring_objects_need_the_api_or_the_override(chart):
    toggled = {"monitoring": {**MONITORING_ON["monitoring"], "ignoreCapabilityCheck": False}}
    assert not MONITORING_KINDS & set(kinds(render(chart, toggled)))  # no monitoring.coreos.com/v1 here
    docs = render(chart, MONITORING_ON)
    assert set(kinds(docs)) >= MONITORING_KINDS
    by_kind = {d["kind"]: d for d in docs}
    assert by_kind["ServiceMonitor"]["metadata"]["labels"]["release"] == "prom"
    # Operator series label the InferenceService's namespace; Prometheus must not overwrite it.
    assert by_kind["ServiceMonitor"]["spec"]["endpoints"][0]["honorLabels"] is True
    alerts = by_kind["PrometheusRule"]["spec"]["groups"][1]["rules"]
    fast = next(a for a in alerts if a["alert"] == "SuperInferSLOBurnRateFast")
    assert "(14.4 * 0.01)" in fast["expr"] and "__ERROR_BUDGET__" not in fast["expr"]
    for doc in docs:
        if doc["kind"] not in MONITORING_KINDS:
            kubernetes_validate.validate(doc, "1.33", strict=True)


def test_dashboards_are_labelled_configmaps_with_valid_json(chart):
    maps = [d for d in render(chart) if d["kind"] == "ConfigMap"]
    assert {m["metadata"]["name"] for m in maps} == {
        f"si-superinfer-dashboard-{n}" for n in ("slo-overview", "rotation", "throughput", "autoscaler")
    }
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        (content,) = m["data"].values()
        board = json.loads(content)
        assert board["panels"] and board["uid"].startswith("superinfer-")
    assert "ConfigMap" not in kinds(render(chart, {"dashboards": {"enabled": False}}))
    custom = render(chart, {"dashboards": {"namespace": "monitoring", "labels": {"grafana_dashboard": "yes"}}})
    assert {m["metadata"]["namespace"] for m in custom if m["kind"] == "ConfigMap"} == {"monitoring"}


def test_operator_deployment_is_hardened_and_probed(chart):
    docs = render(chart, {"operator": {"watchNamespaces": ["team-a", "team-b"]}, "image": {"tag": "v9"}})
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "ghcr.io/superinfer/superinfer:v9"
    assert c["command"] == ["python", "-m", "superinfer.operator"]
    assert "--namespace=team-a" in c["args"] and "--namespace=team-b" in c["args"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SUPERINFER_ENGINE_IMAGE"] == "ghcr.io/superinfer/superinfer:v9"
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert any("namespaces" in r["resources"] for r in role["rules"])  # needed only with namespaces


def test_rbac_is_least_privilege(chart):
    role = next(d for d in render(chart) if d["kind"] == "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "secrets" not in rule["resources"]
        assert "deletecollection" not in rule["verbs"]
        if "update" in rule["verbs"]:  # only what OwnerReferencesPermissionEnforcement asks for
            assert rule["resources"] == ["inferenceservices/finalizers"]
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"inferenceservices/status", "inferenceservices/scale", "inferenceservices/finalizers", "deployments",
            "pods", "events"} <= resources  # fmt: skip
    assert "namespaces" not in resources  # all-namespaces mode does not watch namespaces


def test_watching_namespaces_grants_roles_there_and_nothing_namespaced_cluster_wide(chart):
    docs = render(chart, {"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    cluster = next(d for d in docs if d["kind"] == "ClusterRole")
    assert {r for rule in cluster["rules"] for r in rule["resources"]} == {"customresourcedefinitions", "namespaces"}
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    default_rules = next(d for d in render(chart) if d["kind"] == "ClusterRole")["rules"]
    assert roles["team-a"]["rules"] == default_rules[1:]  # the same namespaced rules, now per namespace
    subject = bindings["team-b"]["subjects"][0]
    assert (subject["kind"], subject["namespace"]) == ("ServiceAccount", "superinfer-system")
    assert bindings["team-b"]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                             "name": roles["team-b"]["metadata"]["name"]}  # fmt: skip
    for doc in docs:
        if doc["kind"] in ("Role", "RoleBinding"):
            kubernetes_validate.validate(doc, "1.33", strict=True)


def test_values_yaml_equals_the_model_defaults():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert ChartValues.model_validate(values) == ChartValues()
    assert set(values) == set(ChartValues().model_dump(by_alias=True))


@pytest.mark.parametrize(
    "bad",
    [{"operator": {"podMonitors": "sometimes"}}, {"monitoring": {"prometheusRule": {"attainmentTarget": 2}}},
     {"crds": {"install": "yes"}}, {"operatr": {}}, {"operator": {"metricsPort": 0}},
     {"engine": {"slo": {"ttftMs": 100}}}],  # the last: no such knob (the CRD owns SLO defaults)
)  # fmt: skip
def test_values_schema_rejects_bad_values(chart, bad):
    with pytest.raises(helm.HelmError):
        chart.validate_schema(bad)
    chart.validate_schema({"operator": {"podMonitors": "never"}})


# ---- PromQL -----------------------------------------------------------------------------------

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, strings, ranges and grouping removed)."""
    text = re.sub(r"label_values\((.*),\s*\w+\)$", r"\1", expr)  # Grafana: label_values(series, label)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\w+", "", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        token, rest = match.group(0), text[match.end() :].lstrip()
        if rest.startswith("(") or token.lower() in KEYWORDS:
            continue  # a function or an operator keyword
        names.add(token)
    return names


def all_exprs(chart) -> list[str]:
    """Every expression as shipped: dashboards from the rendered ConfigMaps, rules from the rendered rule."""
    docs = render(chart, MONITORING_ON)
    boards = [json.loads(v) for d in docs if d["kind"] == "ConfigMap" for v in d["data"].values()]
    assert len(boards) == len(dashboards.all_dashboards())
    exprs = [e for board in boards for e in dashboards.exprs(board)]
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    exprs += [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    return exprs


def test_promql_extractor():
    expr = 'histogram_quantile(0.9, sum by (le, x) (rate(a_bucket{k="v", j=~"$ns"}[5m]))) / on(x) b and c{}'
    assert metric_names(expr) == {"a_bucket", "b", "c"}


def test_every_promql_expr_uses_only_exported_metric_names(chart):
    known = exported_series_names() | operator_metrics.exported_names()
    known |= {promql.recording_name(w) for w in promql.RULE_WINDOWS}
    known |= {"superinfer:ttft_seconds:p90_5m", "superinfer:tbt_seconds:p90_5m"}
    used: set[str] = set()
    for expr in all_exprs(chart):
        names = metric_names(expr)
        assert names, expr
        assert names <= known, f"{sorted(names - known)} in {expr}"
        used |= names
    # The dashboards really cover the engine: SLO counters, both latency histograms, stalls, rotation, swap, copies.
    for needed in ("superinfer_engine_slo_requests_total", "superinfer_engine_time_to_first_token_seconds_bucket",
                   "superinfer_engine_time_between_tokens_seconds_bucket", "superinfer_engine_requests_rotary",
                   "superinfer_engine_kv_swap_bytes_total", "superinfer_operator_desired_replicas",
                   "superinfer_engine_rotation_seconds_bucket", "superinfer_engine_kv_copy_queue_seconds_bucket",
                   "superinfer_engine_kv_copy_bandwidth_bytes_per_second_bucket",
                   "superinfer_engine_kv_copy_hidden_ratio_sum",
                   "superinfer_engine_kv_copy_hidden_ratio_count", "superinfer_engine_worst_gap_seconds_bucket",
                   "superinfer_engine_stalled_requests_total"):  # fmt: skip
        assert needed in used


def test_every_promql_grouping_label_is_an_exported_label(chart):
    engine = {
        label for labels in (*c.GAUGES.values(), *c.COUNTERS.values(), *c.HISTOGRAMS.values()) for label in labels
    }
    known = engine | set(c.SLO_TARGET_LABELS) | {"model_name", "le"} | {*operator_metrics.LABELS, "direction", "reason"}
    grouped: set[str] = set()
    for expr in all_exprs(chart):
        for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
            labels = {label.strip() for label in group.split(",") if label.strip()}
            assert labels <= known, f"{sorted(labels - known)} in {expr}"
            grouped |= labels
    assert c.SLO_CLASS_LABEL in grouped  # goodput, attainment and latency per SLO class


def test_operator_metric_names_match_what_prometheus_client_exports():
    from prometheus_client import generate_latest

    m = operator_metrics.OperatorMetrics()
    m.desired_replicas.labels("ns", "x").set(1)
    m.current_replicas.labels("ns", "x").set(1)
    m.ready_replicas.labels("ns", "x").set(1)
    m.slo_attainment.labels("ns", "x").set(1)
    m.slo_target.labels("ns", "x").set(1)
    m.decisions.labels("ns", "x", "up", "SLODistress").inc()
    m.reconcile_errors.labels("ns", "x").inc()
    text = generate_latest(m.registry).decode()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert exported == operator_metrics.exported_names()


def test_prometheus_for_the_autoscaler_is_configured_by_the_admin(chart):
    values = {"operator": {"prometheus": {"url": "https://prom.monitoring:9090", "insecureSkipVerify": False,
                                          "bearerTokenSecret": {"name": "prom", "key": "token"},
                                          "caConfigMap": {"name": "prom-ca", "key": "ca.crt"}}}}  # fmt: skip
    dep = next(d for d in render(chart, values) if d["kind"] == "Deployment")
    kubernetes_validate.validate(dep, "1.33", strict=True)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert "--prometheus-url=https://prom.monitoring:9090" in c["args"]
    assert "--prometheus-ca-file=/etc/superinfer/prometheus-ca/ca.crt" in c["args"]
    token = next(e for e in c["env"] if e["name"] == "PROMETHEUS_BEARER_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "prom", "key": "token"}
    assert {"name": "prometheus-ca", "configMap": {"name": "prom-ca"}} in pod["volumes"]
    source = prometheus_source(parse_args([a for a in c["args"] if a.startswith("--prometheus")]))
    assert source is not None and source.url == "https://prom.monitoring:9090"
    plain = next(d for d in render(chart) if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--prometheus") for a in plain["args"])
