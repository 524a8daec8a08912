"""Turning a raw InferenceService into a validated spec, or into messages a user can act on.

The schema and CEL catch most mistakes at `kubectl apply`; this catches the rest (checks that need
computation) and everything again when the CRD in the cluster is older than the operator.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from superinfer.engine import contract
from superinfer.operator.api import quantity
from superinfer.operator.api.inference_service import InferenceServiceSpec

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")
LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")  # [DNS-subdomain prefix/]name
EPP_SUFFIX = "-epp"  # the endpoint picker's default Service name: <name>-epp
# Flags the operator renders itself; setting them in engine.args would fight the spec.
RENDERED_FLAGS = (
    "--model",
    "--revision",
    "--download-dir",
    "--served-model-name",
    "--host",
    "--port",
    "--policy",
    "--device",
)
# Host memory the engine needs beyond the CPU KV tier (Python, tokenizer, pinned staging).
MEMORY_HEADROOM_GIB = 2.0


@dataclass
class Outcome:
    spec: InferenceServiceSpec | None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.spec is not None and not self.problems

    @property
    def message(self) -> str:
        return "; ".join(self.problems)


def validate(name: str, raw_spec: Mapping[str, Any]) -> Outcome:
    problems = check_name(name)
    try:
        spec = InferenceServiceSpec.model_validate(dict(raw_spec))
    except ValidationError as exc:
        return Outcome(None, problems + format_errors(exc))
    problems += semantic_problems(spec, name)
    return Outcome(spec, problems)


def check_name(name: str) -> list[str]:
    if len(name) > 63 or not DNS_1035.match(name):
        return [
            f"metadata.name {name!r} must be a DNS-1035 label (lowercase letters, digits and '-', "
            "starting with a letter, at most 63 characters): it names the Service"
        ]
    return []


def format_errors(exc: ValidationError) -> list[str]:
    out = []
    for error in exc.errors():
        where = ".".join(str(part) for part in ("spec", *error["loc"]))
        message = error["msg"].removeprefix("Value error, ")
        out.append(f"{where}: {message}")
    return out


def _is_zero(value: int | str) -> bool:
    return str(value).removesuffix("%") == "0"


def semantic_problems(spec: InferenceServiceSpec, name: str = "") -> list[str]:
    problems: list[str] = []
    if _is_zero(spec.rollout.max_surge) and _is_zero(spec.rollout.max_unavailable):
        problems.append("rollout.maxSurge and rollout.maxUnavailable cannot both be 0: a rollout could never start")
    if spec.scheduling.gpu_product and not LABEL_VALUE.match(spec.scheduling.gpu_product):
        problems.append(
            f"scheduling.gpuProduct {spec.scheduling.gpu_product!r} is not a label value (at most 63 letters, "
            "digits, '-', '_' or '.', starting and ending with a letter or digit)"
        )
    for key, value in spec.monitoring.labels.items():
        if not LABEL_KEY.match(key) or not LABEL_VALUE.match(value):
            problems.append(f"monitoring.labels has {key}: {value!r}, which is not a valid label")
    pool = spec.routing.inference_pool
    if pool.enabled and not pool.endpoint_picker.name and len(name) + len(EPP_SUFFIX) > 63:
        problems.append(
            f"routing.inferencePool.endpointPicker.name is needed: the default, {name}{EPP_SUFFIX}, is longer than "
            "a Service name may be (63)"
        )
    offload = spec.kv_cache.cpu_offload
    if offload is not None:
        need = quantity.gib(offload.size) + MEMORY_HEADROOM_GIB
        have = quantity.gib(spec.resources.memory)
        if have < need:
            problems.append(
                f"resources.memory ({spec.resources.memory}) must cover kvCache.cpuOffload.size "
                f"({offload.size}) plus {MEMORY_HEADROOM_GIB:g}Gi for the engine: raise resources.memory "
                f"to at least {need:g}Gi or lower the offload size"
            )
        if spec.engine.policy == "fcfs":
            problems.append("kvCache.cpuOffload needs engine.policy rotary or watermark (fcfs recomputes)")
    if spec.scheduling.gpu_product and spec.resources.gpus == 0:
        problems.append("scheduling.gpuProduct is set but resources.gpus is 0: request at least one GPU")
    for arg in spec.engine.args:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        if flag == "--api-key":
            problems.append(
                "engine.args must not set --api-key: it would sit in plain text in the resource and the pod; "
                "put the key in a Secret and set engine.apiKeySecretRef"
            )
        elif flag in RENDERED_FLAGS:
            problems.append(f"engine.args must not set {flag}: the operator renders it from the spec")
        elif flag == "--slo-classes" and spec.slo.classes is not None:
            problems.append("engine.args must not set --slo-classes when slo.classes is set: keep one of them")
        elif flag not in contract.SERVE_FLAGS:
            problems.append(f"engine.args has {flag}, which `superinfer serve` does not accept")
    return problems
