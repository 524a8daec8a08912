"""render(): snapshots and the rules it must follow; rendered manifests pass kubernetes-validate."""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from superinfer.cli.main import build_parser
from superinfer.engine import contract
from superinfer.engine.config import EngineConfig
from superinfer.engine.flags import engine_config
from superinfer.engine.slo_classes import SLOClass
from superinfer.operator.api import names
from superinfer.operator.api.inference_service import InferenceServiceSpec
from superinfer.operator.controller.render import Context, engine_args, merge_overrides, model_argument, render

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("SUPERINFER_UPDATE_SNAPSHOTS") == "1"


def example(name: str) -> tuple[str, InferenceServiceSpec]:
    doc = yaml.safe_load((ROOT / "examples" / name).read_text())
    return doc["metadata"]["name"], InferenceServiceSpec.model_validate(doc["spec"])


def by_kind(children: list[dict]) -> dict[str, dict]:
    return {c["kind"]: c for c in children}


def engine(children: list[dict]) -> dict:
    return by_kind(children)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "llama3-8b-gh200.yaml"])
def test_snapshot(name):
    svc, spec = example(name)
    children = render(Context(svc, "prod", "registry.example/superinfer:1.2.3", podmonitor_api=True), spec)
    text = yaml.safe_dump_all(children, sort_keys=True)
    snap = SNAPSHOTS / name
    if UPDATE or not snap.exists():
        snap.parent.mkdir(exist_ok=True)
        snap.write_text(text)
    assert text == snap.read_text(), f"render changed; review and update with SUPERINFER_UPDATE_SNAPSHOTS=1 ({snap})"


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "llama3-8b-gh200.yaml"])
def test_rendered_manifests_validate(name):
    svc, spec = example(name)
    children = render(Context(svc, "prod", podmonitor_api=True), spec)
    assert [c["kind"] for c in children] == ["Deployment", "Service", "PodDisruptionBudget", "PodMonitor"]
    for child in children[:3]:
        kubernetes_validate.validate(child, "1.33", strict=True)
    monitor = children[3]["spec"]
    assert monitor["selector"]["matchLabels"] == names.selector_labels(svc)
    assert monitor["podMetricsEndpoints"][0]["path"] == contract.METRICS_PATH
    assert children[3]["metadata"]["labels"].items() >= spec.monitoring.labels.items()


def test_gh200_implies_arm64_gpu_product_and_toleration():
    _, spec = example("llama3-8b-gh200.yaml")
    pod = by_kind(render(Context("l", "ns"), spec))["Deployment"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {names.ARCH_LABEL: "arm64", names.GPU_PRODUCT_LABEL: "NVIDIA-GH200-480GB"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    res = pod["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    # Another product implies nothing about the architecture; an explicit arch wins.
    other = spec.model_copy(update={"scheduling": spec.scheduling.model_copy(update={"gpu_product": "NVIDIA-H100"})})
    assert (
        names.ARCH_LABEL
        not in by_kind(render(Context("l", "ns"), other))["Deployment"]["spec"]["template"]["spec"]["nodeSelector"]
    )


def test_cpu_service_requests_no_gpu_and_tolerates_nothing():
    _, spec = example("tiny-cpu.yaml")
    pod = by_kind(render(Context("t", "ns"), spec))["Deployment"]["spec"]["template"]["spec"]
    assert "tolerations" not in pod and "nodeSelector" not in pod
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["requests"]
    assert pod["containers"][0]["args"][pod["containers"][0]["args"].index("--device") + 1] == "cpu"


@pytest.mark.parametrize(("pre_stop", "shutdown"), [(15, 45), (0, 10), (30, 300)])
def test_grace_period_is_prestop_plus_shutdown_plus_5(pre_stop, shutdown):
    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": "preset://tiny"}, "drain": {"preStopSeconds": pre_stop, "shutdownTimeoutSeconds": shutdown}}
    )
    dep = by_kind(render(Context("t", "ns"), spec))["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == pre_stop + shutdown + 5
    pre_stop_hook = {"preStop": {"sleep": {"seconds": pre_stop}}} if pre_stop else None  # 0 s: invalid before 1.33
    assert pod["containers"][0].get("lifecycle") == pre_stop_hook


def test_probes_and_security():
    _, spec = example("tiny-cpu.yaml")
    pod = by_kind(render(Context("t", "ns"), spec))["Deployment"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["startupProbe"]["httpGet"]["path"] == contract.HEALTH_PATH
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1800  # 30 min to load
    assert c["readinessProbe"]["httpGet"]["path"] == contract.READY_PATH
    assert c["livenessProbe"]["httpGet"]["path"] == contract.HEALTH_PATH
    assert c["ports"][0]["containerPort"] == contract.DEFAULT_PORT
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # writable scratch on a read-only root


def test_engine_flags_follow_the_contract():
    _, spec = example("llama3-8b-gh200.yaml")
    args = engine_args(Context("llama3-8b", "ns"), spec)
    flags = [a for a in args if a.startswith("--")]
    assert set(flags) <= set(contract.SERVE_FLAGS)
    value = {flag: args[i + 1] for i, flag in enumerate(args) if flag.startswith("--")}
    assert value["--model"] == "hf://meta-llama/Llama-3.1-8B-Instruct"
    assert value["--served-model-name"] == "llama3-8b"
    assert value["--port"] == str(contract.DEFAULT_PORT)
    assert value["--cpu-kv-gib"] == "64"
    assert (value["--ttft-slo-ms"], value["--tbt-slo-ms"]) == ("5000", "100")
    assert value["--transfer-budget-blocks"] == "2400"


@pytest.mark.parametrize(
    ("uri", "arg"),
    [("preset://tiny", "tiny"), ("dummy://llama-3-8b", "llama-3-8b"), ("pvc://models/llama/8b", "/models/llama/8b"),
     ("hf://org/model", "hf://org/model")],
)  # fmt: skip
def test_model_argument(uri, arg):
    assert model_argument(uri) == arg


def test_revision_pins_the_hf_model_in_both_steps():
    assert model_argument("hf://org/model", "abc123") == "hf://org/model@abc123"
    assert model_argument("hf://org/model@v2", "abc123") == "hf://org/model@v2"  # the uri's own pin wins


def test_hf_models_download_once_in_an_init_container_into_the_shared_cache():
    _, spec = example("llama3-8b-gh200.yaml")
    pod = by_kind(render(Context("llama3-8b", "ns", "img:1"), spec))["Deployment"]["spec"]["template"]["spec"]
    [init] = pod["initContainers"]
    engine_container = pod["containers"][0]
    assert init["command"] == ["superinfer", "download"] and init["image"] == engine_container["image"]
    assert init["args"] == ["--model", "hf://meta-llama/Llama-3.1-8B-Instruct"]
    cache_mount = {"name": "models", "mountPath": "/models", "subPath": "hf"}
    assert cache_mount in init["volumeMounts"] and cache_mount in engine_container["volumeMounts"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert token in init["env"] and token not in engine_container["env"]  # only the download needs it
    env = {e["name"]: e.get("value") for e in engine_container["env"]}
    init_env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["HF_HOME"] == init_env["HF_HOME"] and env["HF_HUB_OFFLINE"] == "1"
    kubernetes_validate.validate(by_kind(render(Context("llama3-8b", "ns"), spec))["Deployment"], "1.33", strict=True)


def test_other_model_sources_have_no_download_step():
    for uri in ("preset://tiny", "dummy://llama-3-8b", "pvc://weights/llama"):
        spec = InferenceServiceSpec.model_validate({"model": {"uri": uri}})
        pod = by_kind(render(Context("t", "ns"), spec))["Deployment"]["spec"]["template"]["spec"]
        assert "initContainers" not in pod
        assert "HF_HUB_OFFLINE" not in {e["name"] for e in pod["containers"][0]["env"]}


def test_api_key_comes_from_a_secret_and_never_appears_in_args():
    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": "preset://tiny"}, "engine": {"apiKeySecretRef": {"name": "keys", "key": "engine"}}}
    )
    container = engine(render(Context("t", "ns"), spec))
    assert {"name": contract.API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "keys", "key": "engine"}}} in (
        container["env"]
    )
    assert not any("key" in arg.lower() for arg in container["args"])


def test_pvc_model_mounts_the_claim_read_only():
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "pvc://weights/llama"}})
    pod = by_kind(render(Context("t", "ns"), spec))["Deployment"]["spec"]["template"]["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights"}} in pod["volumes"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models")
    assert mount["readOnly"] is True


def test_template_overrides_merge_last_by_name():
    env = [{"name": "HOME", "value": "/work"}, {"name": "X", "value": "1"}]
    containers = [{"name": "engine", "env": env}, {"name": "sidecar", "image": "busybox"}]
    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": "preset://tiny"}, "template": {"hostIPC": True, "containers": containers}}
    )
    pod = by_kind(render(Context("t", "ns"), spec))["Deployment"]["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True
    assert [c["name"] for c in pod["containers"]] == ["engine", "sidecar"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["HOME"] == "/work" and env["X"] == "1" and "HF_HOME" in env
    assert pod["containers"][0]["args"][0] == "--model"  # untouched fields stay


def test_merge_overrides_is_pure():
    base = {"a": [{"name": "x", "v": 1}], "b": {"c": 1}}
    merge_overrides(base, {"a": [{"name": "x", "v": 2}], "b": {"d": 2}})
    assert base == {"a": [{"name": "x", "v": 1}], "b": {"c": 1}}


def test_replicas_and_podmonitor_toggles():
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "preset://tiny"}, "monitoring": {"podMonitor": False}})
    assert [c["kind"] for c in render(Context("t", "ns", podmonitor_api=True), spec)] == [
        "Deployment", "Service", "PodDisruptionBudget",
    ]  # fmt: skip
    auto = InferenceServiceSpec.model_validate(
        {"model": {"uri": "preset://tiny"}, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}
    )
    assert by_kind(render(Context("t", "ns"), auto))["Deployment"]["spec"]["replicas"] == 2


def serve_config(args: list[str]) -> EngineConfig:
    """What `superinfer serve` itself makes of rendered args (the real parser, no engine started)."""
    return engine_config(build_parser().parse_args(["serve", *args]))


def test_slo_classes_render_into_a_flag_the_engine_accepts():
    _, spec = example("llama3-8b-gh200.yaml")
    table = serve_config(engine_args(Context("llama3-8b", "ns"), spec)).slo_class_table()
    assert table == {
        "interactive": SLOClass(ttft_ms=500, tbt_ms=100, priority=1),
        "batch": SLOClass(ttft_ms=30000, tbt_ms=1000, priority=0),
        "default": SLOClass(ttft_ms=5000, tbt_ms=100, priority=0),
    }
    classes = {"fast": {"ttftMs": 250.5, "tbtMs": 40, "priority": -1}}
    custom = InferenceServiceSpec.model_validate({"model": {"uri": "preset://tiny"}, "slo": {"classes": classes}})
    args = engine_args(Context("t", "ns"), custom)
    assert args[args.index("--slo-classes") + 1] == '{"fast":{"ttft_ms":250.5,"tbt_ms":40,"priority":-1}}'
    assert serve_config(args).slo_class_table()["fast"] == SLOClass(ttft_ms=250.5, tbt_ms=40, priority=-1)


def test_no_classes_keep_the_engine_builtins_and_an_empty_map_clears_them():
    plain = InferenceServiceSpec.model_validate({"model": {"uri": "preset://tiny"}})
    args = engine_args(Context("t", "ns"), plain)
    assert "--slo-classes" not in args
    assert set(serve_config(args).slo_class_table()) == {"interactive", "batch", "default"}
    empty = InferenceServiceSpec.model_validate({"model": {"uri": "preset://tiny"}, "slo": {"classes": {}}})
    assert set(serve_config(engine_args(Context("t", "ns"), empty)).slo_class_table()) == {"default"}


def test_duplex_ablation_renders_into_flags_the_engine_accepts():
    plain = InferenceServiceSpec.model_validate({"model": {"uri": "preset://tiny"}})
    args = engine_args(Context("t", "ns"), plain)
    assert "--duplex" not in args and "--no-write-through" not in args  # the engine's defaults
    config = serve_config(args)
    assert (config.duplex, config.write_through) == ("full", True)
    kv = {"duplex": "serial", "writeThrough": False}
    ablation = InferenceServiceSpec.model_validate({"model": {"uri": "preset://tiny"}, "kvCache": kv})
    config = serve_config(engine_args(Context("t", "ns"), ablation))
    assert (config.duplex, config.write_through) == ("serial", False)


def test_routing_renders_an_inference_pool_over_the_engine_pods():
    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": "preset://tiny"}, "routing": {"inferencePool": {"enabled": True}}}
    )
    children = by_kind(render(Context("chat", "ns", inferencepool_api=True), spec))
    pool = children["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"] == names.selector_labels("chat")
    pod_labels = children["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": contract.DEFAULT_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "chat-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    args = engine(render(Context("chat", "ns"), spec))["args"]
    assert args[args.index("--metrics-compat") + 1] == "vllm"  # what the stock picker scrapes
    assert serve_config(args).metrics_compat == "vllm"
    assert "InferencePool" not in by_kind(render(Context("chat", "ns"), spec))  # no API, no pool


def test_several_gpus_run_one_model_with_tensor_parallelism():
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "dummy://llama-3-8b"}, "resources": {"gpus": 4}})
    args = engine_args(Context("big", "ns"), spec)
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert serve_config(args).tensor_parallel_size == 4
    own = InferenceServiceSpec.model_validate(
        {"model": {"uri": "dummy://llama-3-8b"}, "resources": {"gpus": 4}, "engine": {"args": ["-tp", "2"]}}
    )
    assert engine_args(Context("big", "ns"), own).count("-tp") == 1  # the user's own choice stands
    one = InferenceServiceSpec.model_validate({"model": {"uri": "dummy://llama-3-8b"}, "resources": {"gpus": 1}})
    assert "--tensor-parallel-size" not in engine_args(Context("big", "ns"), one)
