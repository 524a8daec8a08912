"""The InferenceService API (serving.superinfer.dev/v1alpha1): the single source of its schema.

`openapi_schema.py` turns these models into the CRD's structural openAPIV3Schema (and the chart's
values.schema.json); the class-level `rules` become CEL validations there and pydantic checks here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, WithJsonSchema

from superinfer.engine.contract import (
    DEFAULT_SLO_CLASS,
    DEFAULT_TBT_SLO_MS,
    DEFAULT_TTFT_SLO_MS,
    SLO_CLASS_NAME_PATTERN,
)
from superinfer.operator.api import quantity
from superinfer.operator.api.cel_rules import KubeModel, Rule

URI_SCHEMES = ("hf", "pvc", "preset", "dummy")
URI_PATTERN = r"^(hf|pvc|preset|dummy)://[^ ]+$"
PVC_URI_PATTERN = r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^ ]+$"


def _check_quantity(value: int | str) -> int | str:
    quantity.parse(value)  # raises ValueError with an example of the right form
    return value


# A Kubernetes quantity: an integer or a string such as "64Gi" (int-or-string in the CRD).
Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string", "pattern": quantity.PATTERN}],
        }
    ),
]
IntOrPercent = Annotated[
    int | str,
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^[0-9]+%$"}],
        }
    ),
]
# Free-form Kubernetes objects (affinity, tolerations, pod template overrides): kept as they are.
FreeObject = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


def _sub(cls: type[KubeModel]) -> Any:
    """A nested section that is always present (defaulted to {} by the API server too)."""
    return Field(default_factory=cls, json_schema_extra={"default": {}})


class SecretKeyRef(KubeModel):
    name: str = Field(min_length=1)
    """Name of a Secret in the InferenceService's namespace."""
    key: str = "token"
    """Key in the Secret holding the value."""


class ModelCache(KubeModel):
    pvc_name: str = Field(min_length=1)
    """A PersistentVolumeClaim where model files are cached (mounted at /models)."""
    sub_path: str = ""
    """Sub-directory of the claim to mount."""


class ModelSpec(KubeModel):
    uri: str
    """Where the weights come from: hf://org/name (downloaded once into model.cache, or into each
    pod), pvc://<claim>/<path> (a folder on a claim), preset://tiny (built-in demo model), or
    dummy://<preset> (random weights of a real shape)."""
    name: str | None = None
    """The model name clients send in requests (default: the InferenceService's name)."""
    revision: str = ""
    """A Hugging Face revision (branch, tag or commit; pin a commit for reproducible rollouts)."""
    credentials_secret_ref: SecretKeyRef | None = None
    """Secret with the Hugging Face token used to download the model (gated or private repos)."""
    cache: ModelCache | None = None

    rules = (
        Rule(
            cel=f"self.uri.matches('{URI_PATTERN}')",
            message="model.uri must start with one of hf://, pvc://, preset://, dummy:// "
            "(for example preset://tiny or hf://meta-llama/Llama-3.1-8B-Instruct)",
            check=lambda m: re.match(URI_PATTERN, m.uri) is not None,
            field_path=".uri",
        ),
        Rule(
            cel=f"!self.uri.startsWith('pvc://') || self.uri.matches('{PVC_URI_PATTERN}')",
            message="a pvc:// model uri needs a claim and a path: pvc://<claim>/<path/to/model>",
            check=lambda m: not m.uri.startswith("pvc://") or re.match(PVC_URI_PATTERN, m.uri) is not None,
            field_path=".uri",
        ),
    )


class EnvVar(KubeModel):
    model_config = KubeModel.model_config | {"alias_generator": None}
    name: str = Field(min_length=1)
    value: str | None = None
    valueFrom: FreeObject | None = None


class RotarySpec(KubeModel):
    """RotaSched's Virtual Lag Time (VLT) weights: requests are served largest VLT first."""

    alpha: float = Field(default=3.0, ge=0)
    """Weight of TBT lag (a rotated-out request waiting for its next token) against TTFT lag."""
    beta_f: float = Field(default=0.5, ge=0)
    """A waiting request starts lagging after betaF x its TTFT SLO."""
    beta_b: float = Field(default=0.0, ge=0)
    """A rotated-out request starts lagging after betaB x its TBT SLO."""
    transfer_budget_blocks: int = Field(default=2400, ge=1)
    """KV blocks that may move each scheduler step, in both directions together."""


class EngineSpec(KubeModel):
    image: str | None = None
    """Engine image (default: the image the operator was installed with)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    args: list[str] = Field(default_factory=list)
    """Extra `superinfer serve` flags, appended after the rendered ones."""
    api_key_secret_ref: SecretKeyRef | None = None
    """Secret with the API key clients must send (Authorization: Bearer <key>) on /v1 routes; the
    engine reads it from its environment, so it never appears in the resource or the pod's args."""
    env: list[EnvVar] = Field(default_factory=list)
    dtype: str | None = None
    max_model_len: int = Field(default=8192, gt=0)
    max_num_seqs: int = Field(default=256, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    policy: Literal["fcfs", "rotary", "watermark"] = "rotary"
    """Scheduling policy: rotary (RotaSched, default), fcfs (vLLM-like) or watermark."""
    rotary: RotarySpec = _sub(RotarySpec)


class SLOClassSpec(KubeModel):
    ttft_ms: float = Field(gt=0)
    """Time-to-first-token target of the class in milliseconds."""
    tbt_ms: float = Field(gt=0)
    """Time-between-tokens target of the class in milliseconds (judged on each request's p99 gap)."""
    priority: int = 0
    """Higher is more important (default 0)."""


MAX_SLO_CLASSES = 16


class SLOSpec(KubeModel):
    ttft_ms: float = Field(default=DEFAULT_TTFT_SLO_MS, gt=0)
    """Time-to-first-token target in milliseconds (requests that pick no SLO class)."""
    tbt_ms: float = Field(default=DEFAULT_TBT_SLO_MS, gt=0)
    """Time-between-tokens target in milliseconds (a request meets it when its p99 gap between tokens does)."""
    classes: dict[str, SLOClassSpec] | None = Field(default=None, max_length=MAX_SLO_CLASSES)
    """Named SLO classes that requests pick with "slo_class" in the body or the x-slo-class header, e.g.
    {interactive: {ttftMs: 500, tbtMs: 100, priority: 1}}. They replace the engine's built-in classes
    (interactive: 500/100 ms, priority 1; batch: 30000/1000 ms); unset keeps those."""
    attainment_target: float = Field(default=0.95, gt=0, le=1)
    """Share of requests that must meet both targets."""
    window_seconds: int = Field(default=120, ge=10)
    """Window over which attainment and latency quantiles are computed."""

    rules = (
        Rule(
            cel=f"!has(self.classes) || self.classes.all(k, k.matches('{SLO_CLASS_NAME_PATTERN}'))",
            message="slo.classes names must be lowercase identifiers (a letter, then up to 62 letters, digits "
            "or _), such as interactive or batch",
            check=lambda s: s.classes is None or all(re.match(SLO_CLASS_NAME_PATTERN, k) for k in s.classes),
            field_path=".classes",
        ),
        Rule(
            cel=f"!has(self.classes) || !('{DEFAULT_SLO_CLASS}' in self.classes)",
            message=f"slo.classes must not define {DEFAULT_SLO_CLASS!r}: it is the class of requests that pick "
            "none, set by slo.ttftMs and slo.tbtMs",
            check=lambda s: s.classes is None or DEFAULT_SLO_CLASS not in s.classes,
            field_path=".classes",
        ),
    )


class CPUOffload(KubeModel):
    size: Quantity
    """Host memory per pod for the rotary CPU KV tier, e.g. 64Gi (must fit in resources.memory)."""


class KVCacheSpec(KubeModel):
    cpu_offload: CPUOffload | None = None
    """The rotary CPU KV tier's size; unset, the engine sizes it from the memory the pod has left."""
    duplex: Literal["full", "half", "serial"] = "full"
    """How KV copies run beside the model step: full (both directions at once), half (one direction
    at a time), serial (before the step, not overlapped: the ablation baseline)."""
    write_through: bool = True
    """Copy full KV blocks to the CPU tier as they fill, so a rotation copies only the last block."""


class ResourcesSpec(KubeModel):
    gpus: int = Field(default=1, ge=0)
    """nvidia.com/gpu per pod (0 runs the engine on CPU)."""
    cpu: Quantity = "8"
    memory: Quantity = "96Gi"


class SchedulingSpec(KubeModel):
    gpu_product: str = ""
    """Node label nvidia.com/gpu.product to require, e.g. NVIDIA-GH200-480GB (GH200 implies arm64)."""
    arch: Literal["", "amd64", "arm64"] = ""
    """kubernetes.io/arch to require (empty: implied by gpuProduct, else any)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[FreeObject] = Field(default_factory=list)
    affinity: FreeObject = Field(default_factory=dict)
    priority_class_name: str = ""
    runtime_class_name: str = ""

    rules = (
        Rule(
            cel="!(self.gpuProduct.contains('GH200') && self.arch == 'amd64')",
            message="GH200 nodes are arm64: set scheduling.arch to arm64 or leave it empty",
            check=lambda s: not ("GH200" in s.gpu_product and s.arch == "amd64"),
            field_path=".arch",
        ),
    )


class ScaleUpSpec(KubeModel):
    max_step_percent: int = Field(default=100, ge=1, le=100)
    """Largest scale-up step in percent of current replicas (100 = at most doubling)."""
    cooldown_seconds: int = Field(default=60, ge=0)


class ScaleDownSpec(KubeModel):
    stabilization_seconds: int = Field(default=300, ge=0)
    """How long the SLO must hold before one replica is removed."""
    sensitivity: float = Field(default=0.8, gt=0, le=1)
    """Survivors must be predicted under sensitivity x SLO to scale down."""


class CapacityProfile(KubeModel):
    """What one replica sustains, from `superinfer simulate --max-rate` (or a load test): the
    autoscaler sizes scale-ups with it and checks scale-downs against it, and ignores it (saying so
    in the decision) where the measured metrics show it is wrong."""

    max_rate_per_replica: float = Field(gt=0)
    """Requests per second one replica serves within the SLOs at the attainment target."""
    source: str = ""
    """Where the figure comes from (e.g. the simulate command line), for whoever reads the spec."""


class AutoscalingSpec(KubeModel):
    enabled: bool = False
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=4, ge=1)
    mode: Literal["Active", "Advisory"] = "Active"
    """Active scales through /scale; Advisory only records the decision."""
    interval_seconds: int = Field(default=15, ge=1)
    initial_delay_seconds: int = Field(default=120, ge=0)
    min_requests: int = Field(default=20, ge=1)
    """Finished requests needed in the window before attainment is trusted."""
    metrics_source: Literal["Pods", "Prometheus"] = "Pods"
    """Pods: the operator scrapes each engine pod. Prometheus: it queries the Prometheus that the
    cluster admin configured for the operator (chart value operator.prometheus.url), selecting this
    service's series by namespace and inferenceservice label."""
    scale_up: ScaleUpSpec = _sub(ScaleUpSpec)
    scale_down: ScaleDownSpec = _sub(ScaleDownSpec)
    capacity: CapacityProfile | None = None

    rules = (
        Rule(
            cel="self.minReplicas <= self.maxReplicas",
            message="autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
            check=lambda a: a.min_replicas <= a.max_replicas,
            field_path=".minReplicas",
        ),
    )


class RolloutSpec(KubeModel):
    max_surge: IntOrPercent = 1
    max_unavailable: IntOrPercent = 0


class DrainSpec(KubeModel):
    pre_stop_seconds: int = Field(default=15, ge=0)
    """Seconds a terminating pod keeps serving while endpoints drop it."""
    shutdown_timeout_seconds: int = Field(default=45, ge=0)
    """Seconds the engine gets to finish in-flight requests after SIGTERM."""


class MonitoringSpec(KubeModel):
    pod_monitor: bool = True
    """Create a PodMonitor (when the Prometheus Operator's API exists)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on the PodMonitor (to match a Prometheus's podMonitorSelector)."""


class EndpointPickerRef(KubeModel):
    name: str = ""
    """Service of the endpoint picker (EPP) that the Gateway asks which pod takes a request
    (default: <name>-epp)."""
    port: int = Field(default=9002, ge=1, le=65535)
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """What the Gateway does when the picker does not answer: route anyway (FailOpen) or refuse."""


class InferencePoolSpec(KubeModel):
    enabled: bool = False
    """Render a Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1) over
    this service's engine pods, for an HTTPRoute to target; the engine then also exports the vLLM
    metric names that the stock endpoint picker reads."""
    endpoint_picker: EndpointPickerRef = _sub(EndpointPickerRef)


class RoutingSpec(KubeModel):
    inference_pool: InferencePoolSpec = _sub(InferencePoolSpec)


class InferenceServiceSpec(KubeModel):
    model: ModelSpec
    engine: EngineSpec = _sub(EngineSpec)
    slo: SLOSpec = _sub(SLOSpec)
    kv_cache: KVCacheSpec = _sub(KVCacheSpec)
    resources: ResourcesSpec = _sub(ResourcesSpec)
    scheduling: SchedulingSpec = _sub(SchedulingSpec)
    replicas: int = Field(default=1, ge=0)
    """Replica count, also served on the /scale subresource (kubectl scale, HPA, KEDA). With
    autoscaling enabled the SLO autoscaler writes it, kept within [minReplicas, maxReplicas]."""
    autoscaling: AutoscalingSpec = _sub(AutoscalingSpec)
    rollout: RolloutSpec = _sub(RolloutSpec)
    drain: DrainSpec = _sub(DrainSpec)
    monitoring: MonitoringSpec = _sub(MonitoringSpec)
    routing: RoutingSpec = _sub(RoutingSpec)
    template: FreeObject = Field(default_factory=dict)
    """PodSpec fields merged last over the rendered pod spec (escape hatch)."""

    def served_model_name(self, resource_name: str) -> str:
        return self.model.name or resource_name

    def effective_replicas(self) -> int:
        """Replicas the Deployment should have now: spec.replicas, within the autoscaler's bounds."""
        if not self.autoscaling.enabled:
            return self.replicas
        return max(self.autoscaling.min_replicas, min(self.autoscaling.max_replicas, self.replicas))

    def grace_period_seconds(self) -> int:
        return self.drain.pre_stop_seconds + self.drain.shutdown_timeout_seconds + 5


# ---- status ---------------------------------------------------------------------------------


class Condition(KubeModel):
    """A metav1.Condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class ModelFailure(KubeModel):
    reason: str
    message: str = ""
    exit_code: int | None = None
    time: str | None = None


class ModelStatus(KubeModel):
    state: Literal["Pending", "Loading", "Loaded", "FailedToLoad", "CrashLoop"] = "Pending"
    last_failure: ModelFailure | None = None


class SLOClassStatus(KubeModel):
    name: str
    requests: int | None = None
    """Finished requests of the class in the window."""
    attainment: float | None = None
    ttft_ms: float | None = None
    """Observed TTFT p90 of the class over the window, milliseconds."""
    tbt_ms: float | None = None
    """Observed TBT p90 of the class over the window, milliseconds."""
    ttft_target_ms: float | None = None
    """The class's TTFT target that the autoscaler holds its p90 to (the engine's, else the spec's)."""
    tbt_target_ms: float | None = None
    """The class's TBT target that the autoscaler holds its p90 to."""


class SLOStatus(KubeModel):
    ttft_ms: float | None = None
    """Observed TTFT quantile (p90) over the window and all SLO classes together, milliseconds."""
    tbt_ms: float | None = None
    """Observed TBT quantile (p90) over the window and all SLO classes together, milliseconds."""
    attainment: float | None = None
    requests: int | None = None
    classes: list[SLOClassStatus] | None = Field(default=None, max_length=MAX_SLO_CLASSES + 1)
    """Each SLO class with traffic in the window: its p90s and the targets the autoscaler compares them with."""
    evaluated_at: str | None = None


class ScalingDecision(KubeModel):
    time: str
    action: Literal["ScaleUp", "ScaleDown", "Hold"]
    reason: str
    message: str = ""
    from_replicas: int
    to_replicas: int
    applied: bool = False


class LatencySample(KubeModel):
    batch: float
    """Running requests per replica."""
    tbt_seconds: float
    """Mean time between tokens at that batch."""


class AutoscalerStatus(KubeModel):
    """The autoscaler's decisions and its memory: it resumes from here after an operator restart."""

    last_decision: ScalingDecision | None = None
    last_scale_time: str | None = None
    healthy_since: str | None = None
    history: list[ScalingDecision] = Field(default_factory=list, max_length=10)
    started_at: str | None = None
    """When the autoscaler first saw this service (initialDelaySeconds counts from here)."""
    applied_replicas: int | None = None
    """spec.replicas as the autoscaler last wrote it; a different value means another writer."""
    external_write_time: str | None = None
    """When another writer (kubectl scale, HPA, KEDA) last changed spec.replicas."""
    latency_samples: list[LatencySample] = Field(default_factory=list, max_length=64)
    """(batch, TBT) points of the latency model used to predict consolidation."""


class InferenceServiceStatus(KubeModel):
    observed_generation: int | None = None
    replicas: int | None = None
    ready_replicas: int | None = None
    desired_replicas: int | None = None
    selector: str | None = None
    url: str | None = None
    model: ModelStatus | None = None
    slo: SLOStatus | None = None
    autoscaler: AutoscalerStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)


class InferenceService(KubeModel):
    """The whole object, for validating example manifests end to end."""

    model_config = KubeModel.model_config | {"extra": "ignore"}
    api_version: Literal["serving.superinfer.dev/v1alpha1"]
    kind: Literal["InferenceService"]
    metadata: FreeObject = Field(default_factory=dict)
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None
