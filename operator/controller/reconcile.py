"""One reconciliation: validate, render, adopt, apply children, observe, compute status.

`sync()` is what every trigger runs (the resource's own create/update/resume handlers, events of
its children and pods, the autoscaler timer); it is idempotent and serialised per resource.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import kopf

from superinfer.operator.api import names
from superinfer.operator.api.inference_service import InferenceServiceSpec
from superinfer.operator.api.validation import validate
from superinfer.operator.controller import conditions
from superinfer.operator.controller.apply import apply
from superinfer.operator.controller.conditions import Observed
from superinfer.operator.controller.kube_client import BY_KIND, DEPLOYMENTS, PODMONITORS, PODS, SERVICES, Res
from superinfer.operator.controller.render import Context, render, service_url
from superinfer.operator.controller.state import State

ISVC = Res(names.API_VERSION, names.PLURAL)
# Status fields that only some specs have; sync() nulls them when they do not apply.
CLEARABLE_STATUS = ("model", "desiredReplicas", "autoscaler", "slo")


def now_iso(clock_value: float) -> str:
    return datetime.datetime.fromtimestamp(clock_value, tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _owned_by(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner.get("metadata", {}).get("uid")
    refs = obj.get("metadata", {}).get("ownerReferences", []) or []
    return any(ref.get("uid") == uid for ref in refs)


async def apply_children(state: State, owner: Mapping[str, Any], spec: InferenceServiceSpec) -> None:
    meta = owner["metadata"]
    ctx = Context(meta["name"], meta["namespace"], state.config.default_image, await state.podmonitor_api())
    children = render(ctx, spec)
    kopf.adopt(children, owner=owner)  # owner reference, namespace, owner's labels
    for child in children:
        action = await apply(state.kube, child)
        if action != "unchanged":
            kopf.info(owner, reason=f"{child['kind']}{action.capitalize()}", message=f"{child['kind']} {action}")
    if ctx.podmonitor_api and not spec.monitoring.pod_monitor:
        existing = await state.kube.get(PODMONITORS, ctx.namespace, ctx.name)
        if existing is not None and _owned_by(existing, owner):
            await state.kube.delete(PODMONITORS, ctx.namespace, ctx.name)


async def observe(state: State, owner: Mapping[str, Any], spec: InferenceServiceSpec | None) -> Observed:
    meta = owner["metadata"]
    ns, name = meta["namespace"], meta["name"]
    deployment = await state.kube.get(DEPLOYMENTS, ns, name)
    if deployment is not None and not _owned_by(deployment, owner):
        deployment = None
    pods = await state.kube.list(PODS, ns, names.selector_labels(name))
    service = await state.kube.get(SERVICES, ns, name)
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


async def sync(state: State, owner: Mapping[str, Any]) -> dict[str, Any]:
    """Reconcile one InferenceService and return its whole new status."""
    meta = owner["metadata"]
    ns, name = meta["namespace"], meta["name"]
    old_status = owner.get("status") or {}
    outcome = validate(name, owner.get("spec") or {})
    spec = outcome.spec if outcome.ok else None
    if spec is not None:
        await apply_children(state, owner, spec)
    elif not _was_invalid(old_status, outcome.message):
        kopf.warn(owner, reason="InvalidSpec", message=outcome.message)
    obs = await observe(state, owner, spec)
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
        if scaler and spec.autoscaling.enabled:
            status["autoscaler"] = scaler.status
            if scaler.slo_status:
                status["slo"] = scaler.slo_status
        state.metrics.current_replicas.labels(ns, name).set(status["replicas"])
        state.metrics.ready_replicas.labels(ns, name).set(status["readyReplicas"])
        state.metrics.slo_target.labels(ns, name).set(spec.slo.attainment_target)
    out = {k: v for k, v in status.items() if v is not None}
    # Null what no longer applies (autoscaling turned off, spec now invalid): a merge patch removes it.
    return out | {k: None for k in CLEARABLE_STATUS if k not in out}


def _was_invalid(status: Mapping[str, Any], message: str) -> bool:
    cond = conditions.find(status.get("conditions") or [], "Validated")
    return bool(cond and cond.get("status") == conditions.FALSE and cond.get("message") == message)


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    old = old or {}
    return any(old.get(k) != v for k, v in new.items())


async def resync(state: State, namespace: str, name: str) -> None:
    """Re-run sync for a resource found by name (child and pod events); writes status via the API."""
    key = (namespace, name)
    async with state.locks[key]:
        owner = await state.kube.get(ISVC, namespace, name)
        if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
            return
        status = await sync(state, owner)
        if status_changed(owner.get("status"), status):
            await state.kube.patch(ISVC, namespace, name, {"status": status}, sub="status")


async def delete_children(state: State, owner: Mapping[str, Any]) -> list[str]:
    """Delete what we created (the API server's GC would too; emulators and orphans need this)."""
    meta = owner["metadata"]
    deleted = []
    for kind, res in BY_KIND.items():
        if res is PODMONITORS and not await state.podmonitor_api():
            continue
        child = await state.kube.get(res, meta["namespace"], meta["name"])
        if child is not None and _owned_by(child, owner):
            await state.kube.delete(res, meta["namespace"], meta["name"])
            deleted.append(kind)
    return deleted
