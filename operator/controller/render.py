"""Pure rendering: an InferenceService spec in, its child manifests out (plain dicts).

Nothing here talks to the API server; the handlers adopt and apply what these functions return.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from superinfer.engine import contract
from superinfer.operator.api import names, quantity
from superinfer.operator.api.inference_service import InferenceServiceSpec, SecretKeyRef, SLOClassSpec

SERVICE_PORT = 80
MODELS_MOUNT = "/models"
UID = 1000


@dataclass(frozen=True)
class Context:
    """What rendering needs besides the spec."""

    name: str
    namespace: str
    default_image: str = names.DEFAULT_ENGINE_IMAGE
    podmonitor_api: bool = False  # monitoring.coreos.com/v1 is served by the cluster
    inferencepool_api: bool = False  # inference.networking.k8s.io/v1 is served by the cluster


def render(ctx: Context, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """All children, in apply order."""
    children = [render_deployment(ctx, spec), render_service(ctx), render_pdb(ctx)]
    if ctx.podmonitor_api and spec.monitoring.pod_monitor:
        children.append(render_podmonitor(ctx, spec))
    if ctx.inferencepool_api and spec.routing.inference_pool.enabled:
        children.append(render_inferencepool(ctx, spec))
    return children


def _meta(ctx: Context, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": ctx.name,
        "namespace": ctx.namespace,
        "labels": {**names.child_labels(ctx.name), **(extra_labels or {})},
    }


# ---- engine command line --------------------------------------------------------------------


def model_argument(uri: str, revision: str = "") -> str:
    """What `superinfer serve --model` (and `superinfer download --model`) gets for a model URI."""
    scheme, _, rest = uri.partition("://")
    if scheme in ("preset", "dummy"):
        return rest
    if scheme == "pvc":
        _claim, _, path = rest.partition("/")
        return f"{MODELS_MOUNT}/{path}"
    # hf://org/name[@revision]: the init container downloads it into the HF cache under /models.
    return f"{uri}@{revision}" if revision and "@" not in rest else uri


def downloads(spec: InferenceServiceSpec) -> bool:
    """Whether pods fetch the model from the Hub before the engine starts."""
    return spec.model.uri.startswith("hf://")


def engine_args(ctx: Context, spec: InferenceServiceSpec) -> list[str]:
    engine, slo = spec.engine, spec.slo
    args = [
        "--model",
        model_argument(spec.model.uri, spec.model.revision),
        "--served-model-name",
        spec.served_model_name(ctx.name),
        "--host",
        "0.0.0.0",
        "--port",
        str(contract.DEFAULT_PORT),
        "--policy",
        engine.policy,
        "--ttft-slo-ms",
        _num(slo.ttft_ms),
        "--tbt-slo-ms",
        _num(slo.tbt_ms),
        "--max-model-len",
        str(engine.max_model_len),
        "--max-num-seqs",
        str(engine.max_num_seqs),
        "--shutdown-timeout-s",
        str(spec.drain.shutdown_timeout_seconds),
    ]
    if spec.resources.gpus > 0:
        args += ["--gpu-memory-utilization", _num(engine.gpu_memory_utilization)]
    else:
        args += ["--device", "cpu"]
    if spec.resources.gpus > 1 and not _sets(engine.args, "--tensor-parallel-size", "-tp"):
        args += ["--tensor-parallel-size", str(spec.resources.gpus)]  # one model across the pod's GPUs
    if engine.dtype:
        args += ["--dtype", engine.dtype]
    if engine.policy == "rotary":
        rotary = engine.rotary
        args += [
            "--rotary-alpha",
            _num(rotary.alpha),
            "--rotary-beta-f",
            _num(rotary.beta_f),
            "--rotary-beta-b",
            _num(rotary.beta_b),
            "--transfer-budget-blocks",
            str(rotary.transfer_budget_blocks),
        ]
    kv = spec.kv_cache
    if kv.cpu_offload is not None:
        args += ["--cpu-kv-gib", _num(round(quantity.gib(kv.cpu_offload.size), 3))]
    if kv.duplex != "full":
        args += ["--duplex", kv.duplex]
    if not kv.write_through:
        args += ["--no-write-through"]
    if slo.classes is not None:
        args += ["--slo-classes", slo_classes_flag(slo.classes)]
    if spec.routing.inference_pool.enabled and not _sets(engine.args, "--metrics-compat"):
        args += ["--metrics-compat", "vllm"]  # the names the stock endpoint picker scrapes
    return args + list(engine.args)


def _sets(args: list[str], *flags: str) -> bool:
    return any(arg.split("=", 1)[0] in flags for arg in args)


def slo_classes_flag(classes: Mapping[str, SLOClassSpec]) -> str:
    """The engine's --slo-classes JSON (snake_case fields, as `superinfer serve` reads them)."""
    engine_form = {
        name: {"ttft_ms": _json_num(c.ttft_ms), "tbt_ms": _json_num(c.tbt_ms), "priority": c.priority}
        for name, c in sorted(classes.items())
    }
    return json.dumps(engine_form, separators=(",", ":"))


def _json_num(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _from_secret(var: str, ref: SecretKeyRef) -> dict[str, Any]:
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def base_env() -> list[dict[str, Any]]:
    """What both the engine and the download step need: writable homes and the HF cache location."""
    return [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HOME", "value": f"{MODELS_MOUNT}/.hf"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def engine_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    env = [*base_env(), {"name": "TRITON_CACHE_DIR", "value": "/tmp/.triton"}]
    if downloads(spec):
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})  # the init container has downloaded it
    if spec.engine.api_key_secret_ref is not None:
        env.append(_from_secret(contract.API_KEY_ENV, spec.engine.api_key_secret_ref))
    return env + [item.model_dump(exclude_none=True) for item in spec.engine.env]


def download_container(ctx: Context, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The init container that puts an hf:// model into the HF cache on the models volume (once per
    claim when model.cache is set: replicas then find it there and download nothing)."""
    env = base_env()
    if spec.model.credentials_secret_ref is not None:
        env.append(_from_secret("HF_TOKEN", spec.model.credentials_secret_ref))
    container: dict[str, Any] = {
        "name": names.DOWNLOAD_CONTAINER_NAME,
        "image": spec.engine.image or ctx.default_image,
        "command": ["superinfer", "download"],
        "args": ["--model", model_argument(spec.model.uri, spec.model.revision)],
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "securityContext": container_security(),
        "volumeMounts": [*model_mounts(spec), {"name": "tmp", "mountPath": "/tmp"}],
    }
    if spec.engine.image_pull_policy:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    return container


def model_mounts(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    mount: dict[str, Any] = {"name": "models", "mountPath": MODELS_MOUNT}
    if spec.model.cache and spec.model.cache.sub_path:
        mount["subPath"] = spec.model.cache.sub_path
    if spec.model.uri.startswith("pvc://"):
        mount["readOnly"] = True
    return [mount]


# ---- pod ------------------------------------------------------------------------------------


def _http_get(path: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": names.PORT_NAME}}


def probes(spec: InferenceServiceSpec) -> dict[str, Any]:
    """Startup gets a long budget (large models load for minutes); liveness only after it."""
    return {
        "startupProbe": {**_http_get(contract.HEALTH_PATH), "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**_http_get(contract.READY_PATH), "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {
            **_http_get(contract.HEALTH_PATH),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def container_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, Any] = {"cpu": str(res.cpu), "memory": str(res.memory)}
    limits: dict[str, Any] = {"memory": str(res.memory)}
    if res.gpus > 0:
        requests[names.GPU_RESOURCE] = str(res.gpus)
        limits[names.GPU_RESOURCE] = str(res.gpus)
    return {"requests": requests, "limits": limits}


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
        "fsGroup": UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def engine_container(ctx: Context, spec: InferenceServiceSpec) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": names.CONTAINER_NAME,
        "image": spec.engine.image or ctx.default_image,
        "command": ["superinfer", "serve"],
        "args": engine_args(ctx, spec),
        "env": engine_env(spec),
        "ports": [{"name": names.PORT_NAME, "containerPort": contract.DEFAULT_PORT, "protocol": "TCP"}],
        "resources": container_resources(spec),
        **probes(spec),
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *model_mounts(spec),
        ],
    }
    if spec.drain.pre_stop_seconds:  # (a zero-second sleep is invalid before Kubernetes 1.33)
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": spec.drain.pre_stop_seconds}}}
    if spec.engine.image_pull_policy:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    return container


def volumes(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    models: dict[str, Any] = {"name": "models", "emptyDir": {}}
    claim = None
    if spec.model.uri.startswith("pvc://"):
        claim = spec.model.uri.removeprefix("pvc://").partition("/")[0]
    elif spec.model.cache is not None:
        claim = spec.model.cache.pvc_name
    if claim:
        models = {"name": "models", "persistentVolumeClaim": {"claimName": claim}}
    return [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
        models,
    ]


def placement(spec: InferenceServiceSpec) -> dict[str, Any]:
    """nodeSelector, tolerations and affinity; a GH200 product implies arm64."""
    sched = spec.scheduling
    selector: dict[str, str] = {}
    arch = sched.arch or ("arm64" if "GH200" in sched.gpu_product else "")
    if arch:
        selector[names.ARCH_LABEL] = arch
    if sched.gpu_product:
        selector[names.GPU_PRODUCT_LABEL] = sched.gpu_product
    selector.update(sched.node_selector)
    tolerations: list[dict[str, Any]] = []
    if spec.resources.gpus > 0:
        tolerations.append({"key": names.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    tolerations += [dict(t) for t in sched.tolerations if t not in tolerations]
    out: dict[str, Any] = {}
    if selector:
        out["nodeSelector"] = selector
    if tolerations:
        out["tolerations"] = tolerations
    if sched.affinity:
        out["affinity"] = copy.deepcopy(sched.affinity)
    if sched.priority_class_name:
        out["priorityClassName"] = sched.priority_class_name
    if sched.runtime_class_name:
        out["runtimeClassName"] = sched.runtime_class_name
    return out


def pod_spec(ctx: Context, spec: InferenceServiceSpec) -> dict[str, Any]:
    base = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.grace_period_seconds(),
        "securityContext": pod_security(),
        **placement(spec),
        **({"initContainers": [download_container(ctx, spec)]} if downloads(spec) else {}),
        "containers": [engine_container(ctx, spec)],
        "volumes": volumes(spec),
    }
    return merge_overrides(base, spec.template)


def merge_overrides(base: Any, override: Any) -> Any:
    """Deep-merge `template` overrides: dicts recursively, lists of named items by name."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge_overrides(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(override, list) and _named(base) and _named(override):
        out_list = [copy.deepcopy(item) for item in base]
        index = {item["name"]: i for i, item in enumerate(out_list)}
        for item in override:
            if item["name"] in index:
                out_list[index[item["name"]]] = merge_overrides(out_list[index[item["name"]]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(override)


def _named(items: list[Any]) -> bool:
    return all(isinstance(item, dict) and "name" in item for item in items)


# ---- children -------------------------------------------------------------------------------


def render_deployment(ctx: Context, spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ctx),
        "spec": {
            "replicas": spec.effective_replicas(),
            "selector": {"matchLabels": names.selector_labels(ctx.name)},
            "revisionHistoryLimit": 3,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": spec.rollout.max_unavailable,
                },
            },
            "template": {
                "metadata": {"labels": names.child_labels(ctx.name)},
                "spec": pod_spec(ctx, spec),
            },
        },
    }


def render_service(ctx: Context) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ctx),
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector_labels(ctx.name),
            "ports": [
                {"name": names.PORT_NAME, "port": SERVICE_PORT, "targetPort": names.PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def render_pdb(ctx: Context) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(ctx),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_labels(ctx.name)}},
    }


def render_podmonitor(ctx: Context, spec: InferenceServiceSpec) -> dict[str, Any]:
    label_source = "__meta_kubernetes_pod_label_" + _prom_label(names.LABEL_SERVICE)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(ctx, spec.monitoring.labels),
        "spec": {
            "selector": {"matchLabels": names.selector_labels(ctx.name)},
            "podMetricsEndpoints": [
                {
                    "port": names.METRICS_PORT_NAME,
                    "path": contract.METRICS_PATH,
                    "interval": "15s",
                    "relabelings": [{"sourceLabels": [label_source], "targetLabel": names.PROMETHEUS_SERVICE_LABEL}],
                }
            ],
        },
    }


def render_inferencepool(ctx: Context, spec: InferenceServiceSpec) -> dict[str, Any]:
    """A Gateway API Inference Extension pool over the engine pods, picked by the named EPP."""
    picker = spec.routing.inference_pool.endpoint_picker
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": _meta(ctx),
        "spec": {
            "selector": {"matchLabels": names.selector_labels(ctx.name)},
            "targetPorts": [{"number": contract.DEFAULT_PORT}],
            "endpointPickerRef": {
                "name": picker.name or f"{ctx.name}-epp",
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }


def _prom_label(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label)


def service_url(ctx: Context) -> str:
    return f"http://{ctx.name}.{ctx.namespace}.svc.cluster.local"
