"""One autoscaler tick for one InferenceService: scrape, window, decide, scale, record."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import aiohttp

from superinfer.operator.api import conditions
from superinfer.operator.api.conditions import FALSE, Cond
from superinfer.operator.api.inference_service import MAX_SLO_CLASSES, InferenceServiceSpec
from superinfer.operator.api.validation import validate
from superinfer.operator.autoscaling import pod_metrics, prometheus_window
from superinfer.operator.autoscaling.decision import Decision, Memory, Observation, Params, decide, window_classes
from superinfer.operator.autoscaling.latency_model import LatencyModel
from superinfer.operator.autoscaling.pod_metrics import WindowStats
from superinfer.operator.controller import events
from superinfer.operator.controller.kube_client import ApiError
from superinfer.operator.controller.reconcile import ISVC
from superinfer.operator.controller.state import Scaler, State, pod_metrics_url
from superinfer.operator.controller.timestamps import now_iso, parse_iso

HISTORY = 10
NO_PROMETHEUS = (
    "autoscaling.metricsSource is Prometheus but the operator has no Prometheus configured "
    "(chart value operator.prometheus.url, flag --prometheus-url)"
)


async def scrape_pods(
    pods: list[Mapping[str, Any]], scaler: Scaler, now: float, timeout: float, model_name: str, log: logging.Logger
) -> bool:
    """Scrape every ready pod into the window; True when all of them answered."""
    urls = {p["metadata"]["name"]: pod_metrics_url(p) for p in pods}
    async with aiohttp.ClientSession() as session:

        async def one(pod: str, url: str | None) -> bool:
            if url is None:
                return False
            try:
                text = await pod_metrics.fetch(session, url, timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.info("scrape of %s failed: %s", url, exc)
                return False
            scaler.window.add(pod, pod_metrics.parse(text, now, model_name))
            return True

        results = await asyncio.gather(*(one(pod, url) for pod, url in urls.items()))
    scaler.window.forget_missing(urls)
    return all(results) and bool(results)


def observation(spec: InferenceServiceSpec, pods: list[Mapping[str, Any]], stats: Any, fresh: bool, now: float):
    live = [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")]
    ready = [p for p in live if conditions.is_pod_ready(p)]
    unschedulable = [p for p in live if conditions.unschedulable_message(p)]
    return Observation(
        now=now,
        replicas=spec.replicas,  # as written (rule 1 of decide() brings it within bounds)
        ready=len(ready),
        pending=len(live) - len(ready),
        unschedulable=len(unschedulable),
        stats=stats,
        fresh=fresh,
    )


def class_status(stats: WindowStats, params: Params) -> list[dict[str, Any]]:
    """status.slo.classes: each class's p90s beside the targets the autoscaler holds them to."""
    attainment = {name: c.attainment for name, c in stats.classes.items()}
    out = []
    for c in window_classes(stats, params)[: MAX_SLO_CLASSES + 1]:
        entry = {
            "name": c.name,
            "requests": int(c.requests),
            "attainment": _round(attainment.get(c.name, stats.attainment), 4),
            "ttftMs": _round(c.ttft_p90_ms),
            "tbtMs": _round(c.tbt_p90_ms),
            "ttftTargetMs": _round(c.targets.ttft_ms, 3),
            "tbtTargetMs": _round(c.targets.tbt_ms, 3),
        }
        out.append({k: v for k, v in entry.items() if v is not None})
    return out


def record(
    scaler: Scaler, decision: Decision, now: float, current: int, stats: WindowStats | None, params: Params
) -> None:
    stamp = now_iso(now)
    entry = {
        "time": stamp,
        "action": decision.action,
        "reason": decision.reason,
        "message": decision.message[:1024],
        "fromReplicas": current,
        "toReplicas": decision.target,
        "applied": decision.apply,
    }
    history = list(scaler.status.get("history", []))
    if decision.action != "Hold":
        history = [*history, entry][-HISTORY:]
    scaler.status = {"lastDecision": entry, "history": history, **memory_status(decision.memory, scaler.model)}
    scaler.metrics, scaler.scaling, scaler.slo = decision.metrics, decision.scaling, decision.slo
    scaler.memory = decision.memory
    scaler.desired = decision.target
    if stats is not None:
        scaler.slo_status = {
            k: v
            for k, v in {
                "ttftMs": _round(stats.ttft_p90_ms),
                "tbtMs": _round(stats.tbt_p90_ms),
                "attainment": _round(stats.attainment, 4),
                "requests": int(stats.requests),
                "classes": class_status(stats, params),
                "evaluatedAt": stamp,
            }.items()
            if v is not None
        }


async def write_scale(state: State, ns: str, name: str, expected: int, target: int) -> str:
    """Set spec.replicas through /scale, only if it still is `expected` (resourceVersion precondition);
    the reason it was not written, or "" when it was."""
    try:
        scale = await state.kube.get(ISVC, ns, name, sub="scale")
        if scale is None:
            return "the InferenceService is gone"
        current = (scale.get("spec") or {}).get("replicas", InferenceServiceSpec.model_fields["replicas"].default)
        if current != expected:
            return f"spec.replicas changed to {current} while deciding; not writing {target}"
        version = scale.get("metadata", {}).get("resourceVersion")
        await state.kube.patch(
            ISVC, ns, name, {"metadata": {"resourceVersion": version}, "spec": {"replicas": target}}, sub="scale"
        )
    except ApiError as exc:
        if exc.status == 409:
            return f"another writer changed the InferenceService while scaling to {target}; retrying next tick"
        return f"writing {target} replicas through /scale failed: {exc}"
    return ""


def unapplied(decision: Decision, failure: str, before: Memory, replicas: int) -> Decision:
    """The decision as it stands when its /scale write did not happen: not applied, no cooldown."""
    memory = replace(decision.memory, last_scale_at=before.last_scale_at, applied_replicas=replicas)
    scaling = Cond("ScalingReady", FALSE, "ScaleWriteFailed", failure)
    return replace(decision, apply=False, memory=memory, scaling=scaling, message=f"{decision.message} ({failure})")


def memory_status(memory: Memory, model: LatencyModel) -> dict[str, Any]:
    """What the autoscaler must not forget across operator restarts, as status.autoscaler fields."""
    out: dict[str, Any] = {"startedAt": now_iso(memory.started_at)}
    if memory.last_scale_at is not None:
        out["lastScaleTime"] = now_iso(memory.last_scale_at)
    if memory.healthy_since is not None:
        out["healthySince"] = now_iso(memory.healthy_since)
    if memory.applied_replicas is not None:
        out["appliedReplicas"] = memory.applied_replicas
    if memory.external_write_at is not None:
        out["externalWriteTime"] = now_iso(memory.external_write_at)
    if model.points:
        out["latencySamples"] = [{"batch": round(b, 3), "tbtSeconds": round(s, 6)} for b, s in model.points]
    return out


def restore(scaler: Scaler, saved: Mapping[str, Any]) -> None:
    """Reload history, cooldown, stabilization and the latency model from status.autoscaler."""
    if not saved:
        return

    def when(key: str) -> float | None:
        return parse_iso(saved[key]) if saved.get(key) else None

    scaler.memory = Memory(
        started_at=when("startedAt") or scaler.memory.started_at,
        last_scale_at=when("lastScaleTime"),
        healthy_since=when("healthySince"),
        applied_replicas=saved.get("appliedReplicas"),
        external_write_at=when("externalWriteTime"),
    )
    for sample in saved.get("latencySamples") or []:
        scaler.model.observe(float(sample["batch"]), float(sample["tbtSeconds"]))
    scaler.status = {k: v for k, v in saved.items() if k in ("lastDecision", "history")}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


async def tick(state: State, owner: Mapping[str, Any], log: logging.Logger) -> Decision | None:
    """Evaluate (when intervalSeconds have passed) and act; None when it was not yet time."""
    meta = owner["metadata"]
    ns, name = meta["namespace"], meta["name"]
    outcome = validate(name, owner.get("spec") or {})
    spec = outcome.spec
    if not outcome.ok or spec is None or not spec.autoscaling.enabled:  # Validated=False: no scaling
        return None
    params = Params.from_spec(spec)
    now = state.config.clock()
    scaler = state.scaler((ns, name), params.window_seconds)
    if scaler.status == {}:  # first tick since the operator started: continue from what status remembers
        restore(scaler, (owner.get("status") or {}).get("autoscaler") or {})
    if scaler.last_eval and now - scaler.last_eval < params.interval_seconds - 0.5:
        return None
    scaler.last_eval = now
    pods = await state.pods(ns, name)
    ready = [p for p in pods if conditions.is_pod_ready(p) and not p["metadata"].get("deletionTimestamp")]
    served = spec.served_model_name(name)
    metrics_error = ""
    if spec.autoscaling.metrics_source == "Prometheus":
        source = state.config.prometheus
        stats = None
        if source is None:
            metrics_error = NO_PROMETHEUS
        else:
            async with aiohttp.ClientSession() as session:
                stats = await prometheus_window.window(
                    session, source, ns, name, params.window_seconds, state.config.scrape_timeout
                )
            if stats is None:
                metrics_error = (
                    f"Prometheus at {source.url} has no engine series for this service (or cannot be reached)"
                )
        all_ok = stats is not None
    else:
        all_ok = await scrape_pods(ready, scaler, now, state.config.scrape_timeout, served, log)
        stats = scaler.window.stats(now, fresh_seconds=params.interval_seconds * 2 + state.config.scrape_timeout)
    if stats is not None and stats.running > 0 and stats.tbt_mean_ms:
        scaler.model.observe(stats.running / max(len(ready), 1), stats.tbt_mean_ms / 1000)
    obs = replace(observation(spec, pods, stats, all_ok, now), metrics_error=metrics_error)
    decision = decide(obs, params, scaler.memory, scaler.model)
    if decision.apply:
        failure = await write_scale(state, ns, name, obs.replicas, decision.target)
        if failure:
            log.warning("autoscaler %s/%s: %s", ns, name, failure)
            decision = unapplied(decision, failure, scaler.memory, obs.replicas)
    record(scaler, decision, now, obs.replicas, stats, params)
    state.metrics.desired_replicas.labels(ns, name).set(decision.target)
    if stats is not None and stats.attainment is not None:
        state.metrics.slo_attainment.labels(ns, name).set(stats.attainment)
    if decision.action != "Hold":
        direction = "up" if decision.action == "ScaleUp" else "down"
        state.metrics.decisions.labels(ns, name, direction, decision.reason).inc()
    if decision.apply:
        message = f"{obs.replicas} → {decision.target}: {decision.message}"
        await events.post(state.kube, owner, decision.action, message, now)
    elif decision.action != "Hold":
        await events.post(state.kube, owner, "ScaleRecommended", f"Advisory: {decision.message}", now)
    log.debug("autoscaler %s/%s: %s %s", ns, name, decision.action, decision.reason)
    return decision
