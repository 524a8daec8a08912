"""One reconciliation: validate, render, adopt, apply children, observe, compute status.

`resync()` is what every trigger runs (the resource's own create/update/resume handlers, events of
its children and pods, the autoscaler): it reads the resource, runs `sync()` (idempotent) and is
the one writer of its status, serialised per resource, with the resourceVersion it read as a
precondition (a concurrent writer makes it read again and recompute, never overwrite).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from superinfer.operator.api import conditions, names
from superinfer.operator.api.conditions import Observed
from superinfer.operator.api.inference_service import InferenceServiceSpec
from superinfer.operator.api.validation import validate
from superinfer.operator.controller import events
from superinfer.operator.controller.apply import NotOurs, apply
from superinfer.operator.controller.kube_client import (
    BY_KIND,
    DEPLOYMENTS,
    INFERENCEPOOLS,
    PODMONITORS,
    SERVICES,
    ApiError,
    Res,
)
from superinfer.operator.controller.render import Context, render, service_url
from superinfer.operator.controller.state import State
from superinfer.operator.controller.timestamps import now_iso

ISVC = Res(names.API_VERSION, names.PLURAL)
# Status fields that only some specs have; sync() nulls them when they do not apply.
CLEARABLE_STATUS = ("model", "desiredReplicas", "autoscaler", "slo")
STATUS_WRITE_ATTEMPTS = 5


def _owned_by(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner.get("metadata", {}).get("uid")
    refs = obj.get("metadata", {}).get("ownerReferences", []) or []
    return any(ref.get("uid") == uid for ref in refs)


async def apply_children(state: State, owner: Mapping[str, Any], spec: InferenceServiceSpec) -> str:
    """Create or patch the children; what the API server refused to accept ("" when nothing)."""
    meta = owner["metadata"]
    ctx = Context(
        meta["name"],
        meta["namespace"],
        state.config.default_image,
        podmonitor_api=await state.podmonitor_api(),
        inferencepool_api=await state.served(INFERENCEPOOLS.api_version),
    )
    children = render(ctx, spec)
    kopf.adopt(children, owner=owner)  # owner reference, namespace, owner's labels
    for child in children:
        try:
            action = await apply(state.kube, child, await state.child(BY_KIND[child["kind"]], ctx.namespace, ctx.name))
        except NotOurs as exc:
            return str(exc)
        except ApiError as exc:
            if exc.status not in (400, 403, 422):  # invalid, or refused by RBAC, a quota or an admission policy
                raise
            return rejection(child["kind"], exc.status, exc.message)
        if action != "unchanged":
            reason = f"{child['kind']}{action.capitalize()}"
            await events.post(state.kube, owner, reason, f"{child['kind']} {action}", state.config.clock())
    for res, wanted, served in (
        # (--pod-monitors=never after a run that made some: those go too)
        (PODMONITORS, spec.monitoring.pod_monitor and ctx.podmonitor_api, await state.served(PODMONITORS.api_version)),
        (INFERENCEPOOLS, spec.routing.inference_pool.enabled, ctx.inferencepool_api),
    ):
        if served and not wanted:  # turned off: remove what we made before
            existing = await state.child(res, ctx.namespace, ctx.name)
            if existing is not None and _owned_by(existing, owner):
                await state.kube.delete(res, ctx.namespace, ctx.name)
    return ""


def rejection(kind: str, status: int, message: str) -> str:
    if status == 403:
        return (
            f"the API server forbade the rendered {kind}: {message}; an RBAC rule, a ResourceQuota or an "
            "admission policy refused it: ask the cluster's admin, or lower what the InferenceService asks for"
        )
    return (
        f"the API server rejected the rendered {kind}: {message}; fix the field it names in the "
        "InferenceService (often spec.template, spec.resources or spec.scheduling)"
    )


async def observe(state: State, owner: Mapping[str, Any], spec: InferenceServiceSpec | None) -> Observed:
    meta = owner["metadata"]
    ns, name = meta["namespace"], meta["name"]
    deployment = await state.child(DEPLOYMENTS, ns, name)
    if deployment is not None and not _owned_by(deployment, owner):
        deployment = None
    pods = await state.pods(ns, name)
    service = await state.child(SERVICES, ns, name)
    scaler = state.scalers.get((ns, name))
    autoscaling = spec is not None and spec.autoscaling.enabled
    return Observed(
        desired_replicas=spec.effective_replicas() if spec else 0,
        deployment=deployment,
        pods=[p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")],
        service_exists=service is not None,
        url=service_url(Context(name, ns)),
        autoscaling=autoscaling,
        metrics=scaler.metrics if scaler and autoscaling else None,
        scaling=scaler.scaling if scaler and autoscaling else None,
        slo=scaler.slo if scaler and autoscaling else None,
    )


def routing_condition(name: str, served: bool) -> conditions.Cond:
    """RoutingReady (informational: serving works without a Gateway)."""
    if not served:
        return conditions.Cond(
            "RoutingReady", conditions.FALSE, "InferencePoolAPIMissing",
            "routing.inferencePool is enabled but the cluster does not serve inference.networking.k8s.io/v1: "
            "install the Gateway API Inference Extension CRDs",
        )  # fmt: skip
    return conditions.Cond(
        "RoutingReady", conditions.TRUE, "InferencePool",
        f"InferencePool {name} selects the engine pods: point an HTTPRoute backendRef at it "
        "(group inference.networking.k8s.io, kind InferencePool)",
    )  # fmt: skip


def model_status(obs: Observed, conds: list[conditions.Cond], previous: Mapping[str, Any]) -> dict[str, Any]:
    by_type = {c.type: c for c in conds}
    model_cond = by_type.get("ModelReady")
    state = "Pending"
    if model_cond is not None:
        state = {"Loaded": "Loaded", "CrashLoop": "CrashLoop", "FailedToLoad": "FailedToLoad"}.get(
            model_cond.reason, "Loading"
        )
    out: dict[str, Any] = {"state": state}
    failures = [f for f in (conditions.pod_failure(p) for p in obs.pods) if f is not None]
    if failures:
        f = failures[0]
        out["lastFailure"] = {"reason": f.reason, "message": f.message, "exitCode": f.exit_code}
    elif previous.get("lastFailure"):
        out["lastFailure"] = dict(previous["lastFailure"])
    return out


async def sync(state: State, owner: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Reconcile one InferenceService: its whole new status, and why the API server rejected a
    child ("" when it accepted them all)."""
    meta = owner["metadata"]
    ns, name = meta["namespace"], meta["name"]
    old_status = owner.get("status") or {}
    outcome = validate(name, owner.get("spec") or {})
    spec = outcome.spec if outcome.ok else None
    rejected = ""
    if spec is not None:
        rejected = await apply_children(state, owner, spec)
        if rejected and rejected != _condition_message(old_status, "WorkloadReady"):
            await events.post(state.kube, owner, "ChildRejected", rejected, state.config.clock(), warning=True)
    elif _condition_message(old_status, "Validated") != outcome.message:
        await events.post(state.kube, owner, "InvalidSpec", outcome.message, state.config.clock(), warning=True)
    obs = await observe(state, owner, spec)
    obs.rejected = rejected
    if spec is not None and spec.routing.inference_pool.enabled:
        obs.extra.append(routing_condition(name, await state.served(INFERENCEPOOLS.api_version)))
    conds = conditions.compute(obs, outcome.problems if not outcome.ok else [])
    now = now_iso(state.config.clock())
    deployment_status = (obs.deployment or {}).get("status", {}) or {}
    status: dict[str, Any] = {
        "observedGeneration": meta.get("generation"),
        "replicas": int(deployment_status.get("replicas") or 0),
        "readyReplicas": int(deployment_status.get("readyReplicas") or 0),
        "selector": names.selector_string(name),
        "url": obs.url,
        "conditions": conditions.merge(old_status.get("conditions") or [], conds, now, meta.get("generation")),
    }
    if spec is not None:
        status["model"] = model_status(obs, conds, old_status.get("model") or {})
        scaler = state.scalers.get((ns, name))
        desired = scaler.desired if scaler and spec.autoscaling.enabled and scaler.desired else None
        status["desiredReplicas"] = desired or spec.effective_replicas()
        if scaler and scaler.status and spec.autoscaling.enabled:
            status["autoscaler"] = scaler.status
            if scaler.slo_status:
                status["slo"] = scaler.slo_status
        elif spec.autoscaling.enabled:  # not evaluated since the operator started: keep what it remembers
            status["autoscaler"] = old_status.get("autoscaler")
            status["slo"] = old_status.get("slo")
        state.metrics.current_replicas.labels(ns, name).set(status["replicas"])
        state.metrics.ready_replicas.labels(ns, name).set(status["readyReplicas"])
        state.metrics.slo_target.labels(ns, name).set(spec.slo.attainment_target)
    out = {k: v for k, v in status.items() if v is not None}
    # Null what no longer applies (autoscaling turned off, spec now invalid): a merge patch removes it.
    return out | {k: None for k in CLEARABLE_STATUS if k not in out}, rejected


def _condition_message(status: Mapping[str, Any], ctype: str) -> str | None:
    cond = conditions.find(status.get("conditions") or [], ctype)
    return cond.get("message") if cond and cond.get("status") == conditions.FALSE else None


def merge_patched(target: Any, patch: Any) -> Any:
    """`target` after a JSON merge patch (RFC 7386): nulls remove, objects merge key by key."""
    if not isinstance(patch, Mapping):
        return patch
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patched(out.get(key), value)
    return out


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing `new` as a merge patch would change `old` (a null for what is already
    absent changes nothing)."""
    old = old or {}
    return merge_patched(old, new) != old


async def resync(state: State, namespace: str, name: str) -> str:
    """Reconcile a resource found by name and write its status; why a child was rejected, or ""."""
    async with state.locks[(namespace, name)]:
        for _ in range(STATUS_WRITE_ATTEMPTS):
            owner = await state.kube.get(ISVC, namespace, name)
            if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
                return ""
            status, rejected = await sync(state, owner)
            if not status_changed(owner.get("status"), status):
                return rejected
            version = owner["metadata"].get("resourceVersion")
            try:
                await state.kube.patch(
                    ISVC, namespace, name, {"metadata": {"resourceVersion": version}, "status": status}, sub="status"
                )
                return rejected
            except ApiError as exc:
                if exc.status != 409:
                    raise
    raise kopf.TemporaryError(f"status of {namespace}/{name} kept changing under us; retrying", delay=2)
