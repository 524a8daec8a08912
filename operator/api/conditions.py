"""Conditions (metav1.Condition) from what the operator observes; pure functions only.

`Validated`, `ModelReady`, `WorkloadReady`, `ServiceReady`, and with autoscaling `MetricsAvailable`
and `ScalingReady` roll up into `Ready`; `SLOMet` is informational. A condition that does not
apply is removed rather than set False.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"
ROLLUP_ORDER = ("Validated", "ModelReady", "WorkloadReady", "ServiceReady", "MetricsAvailable", "ScalingReady")
# Reasons that wait on the user or the admin, not on time: Ready reports them before anything that
# is still in progress (a pod that cannot be scheduled before the model "loading" in no pod).
NEEDS_ACTION = frozenset(
    {"InvalidSpec", "ChildRejected", "CrashLoop", "FailedToLoad", "InsufficientCapacity", "ProgressDeadlineExceeded",
     "ReplicaFailure"}
)  # fmt: skip
IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")
CONFIG_ERRORS = ("CreateContainerConfigError", "CreateContainerError")  # e.g. a missing Secret or key
INFORMATIONAL = ("SLOMet", "RoutingReady")


@dataclass(frozen=True)
class Cond:
    type: str
    status: str
    reason: str
    message: str = ""


@dataclass(frozen=True)
class PodFailure:
    reason: str  # CrashLoop | FailedToLoad
    message: str
    exit_code: int | None


@dataclass
class Observed:
    """What the cluster looks like for one InferenceService."""

    desired_replicas: int
    deployment: Mapping[str, Any] | None = None
    pods: Sequence[Mapping[str, Any]] = ()
    service_exists: bool = False
    url: str = ""
    autoscaling: bool = False
    metrics: Cond | None = None  # MetricsAvailable, from the autoscaler
    scaling: Cond | None = None  # ScalingReady, from the autoscaler
    slo: Cond | None = None  # SLOMet, from the autoscaler
    rejected: str = ""  # why the API server refused a rendered child
    extra: list[Cond] = field(default_factory=list)


# ---- pods -----------------------------------------------------------------------------------


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    for cond in pod.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == TRUE
    return False


def unschedulable_message(pod: Mapping[str, Any]) -> str | None:
    status = pod.get("status", {})
    if status.get("phase") != "Pending":
        return None
    for cond in status.get("conditions", []) or []:
        scheduled = cond.get("type") == "PodScheduled" and cond.get("status") == FALSE
        if scheduled and cond.get("reason") == "Unschedulable":
            return cond.get("message") or "no node fits the pod"
    return None


def pod_failure(pod: Mapping[str, Any]) -> PodFailure | None:
    """A crash loop or a failed model load of the engine container or of an init container (the
    model download), with its exit code."""
    status = pod.get("status", {})
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        container = f"container {cs.get('name', '?')}"
        state, last = cs.get("state", {}) or {}, cs.get("lastState", {}) or {}
        terminated = state.get("terminated") or last.get("terminated") or {}
        code = terminated.get("exitCode")
        waiting = state.get("waiting") or {}
        detail = terminated.get("message") or terminated.get("reason") or ""
        suffix = f": {detail.strip()[-300:]}" if detail else ""
        logs = f"kubectl logs {_name(pod)} -c {cs.get('name', '?')}"
        if waiting.get("reason") == "CrashLoopBackOff":
            return PodFailure(
                "CrashLoop",
                f"{container} of pod {_name(pod)} is crash-looping (exit code {code}, "
                f"{cs.get('restartCount', 0)} restarts){suffix}; see {logs} --previous",
                code,
            )
        if code not in (None, 0) and not cs.get("ready"):
            return PodFailure(
                "FailedToLoad",
                f"{container} of pod {_name(pod)} exited with code {code} before becoming ready{suffix}; see {logs}",
                code,
            )
        if waiting.get("reason") in IMAGE_ERRORS + CONFIG_ERRORS:
            detail = waiting.get("message") or waiting["reason"]
            return PodFailure("FailedToLoad", f"{container} of pod {_name(pod)}: {detail}", None)
    return None


def _name(pod: Mapping[str, Any]) -> str:
    return str(pod.get("metadata", {}).get("name", "?"))


# ---- individual conditions ------------------------------------------------------------------


def validated(problems: Sequence[str]) -> Cond:
    if problems:
        return Cond("Validated", FALSE, "InvalidSpec", "; ".join(problems))
    return Cond("Validated", TRUE, "Valid", "the spec is valid")


def model_ready(obs: Observed) -> Cond | None:
    if obs.desired_replicas == 0:
        return None
    ready = [p for p in obs.pods if is_pod_ready(p)]
    if ready:
        return Cond("ModelReady", TRUE, "Loaded", f"the model is loaded in {len(ready)} pod(s)")
    failures = [f for f in (pod_failure(p) for p in obs.pods) if f is not None]
    if failures:
        crash = [f for f in failures if f.reason == "CrashLoop"]
        first = (crash or failures)[0]
        return Cond("ModelReady", FALSE, first.reason, first.message)
    running = [p for p in obs.pods if p.get("status", {}).get("phase") == "Running"]
    if running:
        return Cond("ModelReady", FALSE, "Loading", f"the engine is loading the model in {len(running)} pod(s)")
    return Cond("ModelReady", FALSE, "Loading", "waiting for engine pods to start")


def workload_ready(obs: Observed) -> Cond:
    if obs.rejected:
        return Cond("WorkloadReady", FALSE, "ChildRejected", obs.rejected)
    if obs.deployment is None:
        return Cond("WorkloadReady", FALSE, "Creating", "the Deployment does not exist yet")
    status = obs.deployment.get("status", {}) or {}
    ready = int(status.get("readyReplicas") or 0)
    unschedulable = [m for m in (unschedulable_message(p) for p in obs.pods) if m]
    if unschedulable and ready < obs.desired_replicas:
        return Cond(
            "WorkloadReady",
            FALSE,
            "InsufficientCapacity",
            f"{len(unschedulable)} pod(s) cannot be scheduled: {unschedulable[0]} "
            "(add GPU nodes, or lower resources / replicas)",
        )
    for cond in status.get("conditions", []) or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Cond("WorkloadReady", FALSE, "ProgressDeadlineExceeded", cond.get("message", ""))
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == TRUE:  # pods refused: quota, policy
            return Cond("WorkloadReady", FALSE, "ReplicaFailure", cond.get("message") or cond.get("reason", ""))
    if ready >= obs.desired_replicas:
        return Cond("WorkloadReady", TRUE, "Available", f"{ready}/{obs.desired_replicas} replicas ready")
    return Cond("WorkloadReady", FALSE, "Progressing", f"{ready}/{obs.desired_replicas} replicas ready")


def service_ready(obs: Observed) -> Cond:
    if not obs.service_exists:
        return Cond("ServiceReady", FALSE, "Creating", "the Service does not exist yet")
    if obs.desired_replicas > 0 and not any(is_pod_ready(p) for p in obs.pods):
        return Cond("ServiceReady", FALSE, "NoReadyEndpoints", "no engine pod is ready to take requests")
    return Cond("ServiceReady", TRUE, "Serving", f"serving at {obs.url}" if obs.url else "serving")


def rollup(conds: Iterable[Cond]) -> Cond:
    """Ready: the first condition that is not True, in ROLLUP_ORDER, those that need action first."""
    by_type = {c.type: c for c in conds}
    ordered = [by_type[t] for t in ROLLUP_ORDER if t in by_type and by_type[t].status != TRUE]
    ordered.sort(key=lambda c: c.status != FALSE or c.reason not in NEEDS_ACTION)  # stable: keeps the order
    if ordered:
        cond = ordered[0]
        reason = cond.reason if cond.status == FALSE else f"{cond.type}Unknown"
        return Cond("Ready", FALSE, reason, f"{cond.type}: {cond.message}")
    return Cond("Ready", TRUE, "Ready", "the service is ready")


def compute(obs: Observed, problems: Sequence[str]) -> list[Cond]:
    """Every applicable condition for an observed state, the roll-up last."""
    valid = validated(problems)
    conds: list[Cond] = [valid]
    if valid.status == TRUE and obs.rejected:  # nothing else can be judged until the spec is fixed
        conds.append(workload_ready(obs))
    elif valid.status == TRUE:
        conds += [c for c in (model_ready(obs), workload_ready(obs), service_ready(obs)) if c is not None]
        if obs.autoscaling:
            conds.append(obs.metrics or Cond("MetricsAvailable", UNKNOWN, "Pending", "no scrape yet"))
            conds.append(obs.scaling or Cond("ScalingReady", UNKNOWN, "Pending", "no decision yet"))
            if obs.slo is not None:
                conds.append(obs.slo)
    conds += obs.extra
    conds.append(rollup(conds))
    return conds


# ---- metav1.Condition lists -----------------------------------------------------------------


def merge(
    existing: Sequence[Mapping[str, Any]],
    conds: Iterable[Cond],
    now: str,
    generation: int | None,
    keep: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """New condition list: lastTransitionTime kept when status is unchanged; types not given and
    not in `keep` are removed (they no longer apply)."""
    old = {c.get("type"): c for c in existing}
    out: list[dict[str, Any]] = []
    seen = set()
    for cond in conds:
        seen.add(cond.type)
        prev = old.get(cond.type)
        transition = prev.get("lastTransitionTime") if prev and prev.get("status") == cond.status else None
        item = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message[:32768],
            "lastTransitionTime": transition or now,
        }
        if generation is not None:
            item["observedGeneration"] = generation
        out.append(item)
    out += [dict(c) for t, c in old.items() if t in set(keep) and t not in seen]
    return out


def find(conditions: Sequence[Mapping[str, Any]], ctype: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == ctype), None)
