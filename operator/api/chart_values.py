"""The Helm chart's values (charts/superinfer/values.yaml), the source of values.schema.json.

It reuses the InferenceService API models where the chart exposes the same things.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from superinfer.operator.api.cel_rules import KubeModel
from superinfer.operator.api.inference_service import FreeObject


class Image(KubeModel):
    repository: str = "ghcr.io/superinfer/superinfer"
    tag: str = ""
    """Defaults to the chart's appVersion."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class CRDs(KubeModel):
    install: bool = True
    """Install the InferenceService CRD with the chart (kept on uninstall: helm.sh/resource-policy keep)."""
    keep: bool = True


class KeyRef(KubeModel):
    name: str = Field(min_length=1)
    key: str = Field(min_length=1)


class PrometheusValues(KubeModel):
    url: str = ""
    """Prometheus (or Thanos/Mimir query frontend) for InferenceServices with autoscaling.metricsSource:
    Prometheus, e.g. http://prometheus-operated.monitoring:9090. Empty: only pod scraping."""
    bearer_token_secret: KeyRef | None = None
    """Secret in the release namespace holding a bearer token for it."""
    ca_config_map: KeyRef | None = None
    """ConfigMap in the release namespace holding the CA bundle of its TLS certificate."""
    insecure_skip_verify: bool = False


class OperatorValues(KubeModel):
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    watch_namespaces: list[str] = Field(default_factory=list)
    """Namespaces to watch (empty: all namespaces)."""
    pod_monitors: Literal["auto", "always", "never"] = "auto"
    """Create a PodMonitor per InferenceService: auto = when the monitoring API exists."""
    metrics_port: int = Field(default=8080, ge=1, le=65535)
    liveness_port: int = Field(default=8081, ge=1, le=65535)
    resources: FreeObject = Field(
        default_factory=lambda: {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[FreeObject] = Field(default_factory=list)
    affinity: FreeObject = Field(default_factory=dict)
    priority_class_name: str = ""
    prometheus: PrometheusValues = Field(default_factory=PrometheusValues)


class Engine(KubeModel):
    image: str = ""
    """Default engine image for InferenceServices that set none (default: the chart's image)."""


class Monitor(KubeModel):
    enabled: bool = False
    additional_labels: dict[str, str] = Field(default_factory=dict)
    interval: str = "15s"


class PrometheusRule(KubeModel):
    enabled: bool = False
    additional_labels: dict[str, str] = Field(default_factory=dict)
    attainment_target: float = Field(default=0.95, gt=0, lt=1)
    """SLO attainment target the burn-rate alerts protect (error budget = 1 - target)."""


class Monitoring(KubeModel):
    service_monitor: Monitor = Field(default_factory=Monitor)
    """A ServiceMonitor for the operator's own metrics."""
    engine_pod_monitor: Monitor = Field(default_factory=Monitor)
    """One PodMonitor for the engine pods of every InferenceService (instead of per-service ones)."""
    prometheus_rule: PrometheusRule = Field(default_factory=PrometheusRule)
    ignore_capability_check: bool = False
    """Render monitoring.coreos.com objects even when the API is not detected (helm template)."""


class Dashboards(KubeModel):
    enabled: bool = True
    namespace: str = ""
    """Namespace of the dashboard ConfigMaps (default: the release namespace)."""
    labels: dict[str, str] = Field(default_factory=lambda: {"grafana_dashboard": "1"})
    annotations: dict[str, str] = Field(default_factory=dict)


class ChartValues(KubeModel):
    global_: FreeObject = Field(default_factory=dict, alias="global")
    """Helm's global values (unused by this chart)."""
    image: Image = Field(default_factory=Image)
    image_pull_secrets: list[FreeObject] = Field(default_factory=list)
    name_override: str = ""
    crds: CRDs = Field(default_factory=CRDs)
    operator: OperatorValues = Field(default_factory=OperatorValues)
    engine: Engine = Field(default_factory=Engine)
    monitoring: Monitoring = Field(default_factory=Monitoring)
    dashboards: Dashboards = Field(default_factory=Dashboards)


def values_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12, as Helm 3.18+/4 accept) of the chart's values."""
    schema = ChartValues.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "superinfer chart values"
    return schema
