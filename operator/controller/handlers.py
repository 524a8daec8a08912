"""Kopf wiring: which events run which reconciliation (the logic: reconcile.py, scaling_tick.py).

No handler needs a finalizer: children carry owner references, so the cluster's garbage collector
deletes them with their InferenceService, and nothing blocks deleting one after `helm uninstall`.
The autoscaler is one loop over the services that enable it rather than a Kopf timer (a timer would
put a finalizer on each of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from superinfer.operator.api import names
from superinfer.operator.controller import scaling_tick
from superinfer.operator.controller.kube_client import (
    DEPLOYMENTS,
    INFERENCEPOOLS,
    PDBS,
    PODMONITORS,
    PODS,
    SERVICES,
    Kube,
)
from superinfer.operator.controller.reconcile import resync
from superinfer.operator.controller.state import Config, State, index_name

RESOURCE = (names.GROUP, names.VERSION, names.PLURAL)
CHILD_RESOURCES = (DEPLOYMENTS, SERVICES, PDBS, PODMONITORS, INFERENCEPOOLS, PODS)
# Children and engine pods, selected by the API server (not filtered after a cluster-wide watch),
# indexed by owner so that a reconciliation reads them from memory instead of GET/LIST per event.
CHILD_SELECTOR = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY},{names.LABEL_SERVICE}"
log = logging.getLogger("superinfer.operator")


def configure(settings: kopf.OperatorSettings) -> None:
    """Branded persistence annotations; server-side label selectors on every child watch."""
    # Kopf removes this finalizer from resources that an older operator version put it on.
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    for res in CHILD_RESOURCES:
        settings.watching.label_selectors[res.group, res.plural] = CHILD_SELECTOR
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.batching.error_delays = [1, 2, 5, 10, 30, 60]


def _key(body: kopf.Body) -> tuple[str, str]:
    return body.metadata.namespace or "", body.metadata.name or ""


async def run_autoscalers(state: State) -> None:
    """Every timer interval, tick each autoscaled service (each evaluates at its own interval)."""
    while True:
        await asyncio.sleep(state.config.timer_interval)
        await asyncio.gather(*(autoscale(state, key) for key in list(state.autoscaled)))


async def autoscale(state: State, key: tuple[str, str]) -> None:
    body = state.autoscaled.get(key)
    if body is None:
        return
    try:
        decision = await scaling_tick.tick(state, body, log)
        if decision is not None:
            await resync(state, *key)  # status carries the decision; a /scale write changed the spec
    except Exception:  # one service's failure must not stop the others' autoscaling
        log.exception("autoscaler tick for %s/%s failed", *key)


def build_registry(config: Config) -> tuple[kopf.OperatorRegistry, State]:
    registry = kopf.OperatorRegistry()
    state = State(config=config, kube=Kube(config.login))
    background: set[asyncio.Task[None]] = set()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)
        background.add(asyncio.create_task(run_autoscalers(state), name="superinfer-autoscalers"))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await state.kube.close()

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await config.login()

    @kopf.on.probe(id="inferenceservices", registry=registry)
    def probe(**_: Any) -> int:
        return len(state.scalers)

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, registry=registry)
    async def reconcile(body: kopf.Body, **kwargs: Any) -> None:
        capture_indexes(state, kwargs)
        key = _key(body)
        try:
            rejected = await resync(state, *key)
        except Exception:
            state.metrics.reconcile_errors.labels(*key).inc()
            raise
        if rejected:  # status says what to fix; retrying the same spec cannot succeed
            state.metrics.reconcile_errors.labels(*key).inc()
            raise kopf.PermanentError(rejected)

    @kopf.on.event(*RESOURCE, registry=registry)
    async def track(event: kopf.RawEvent, body: kopf.Body, **kwargs: Any) -> None:
        capture_indexes(state, kwargs)
        key = _key(body)
        if event.get("type") == "DELETED":
            state.forget(key)
        elif (body.spec.get("autoscaling") or {}).get("enabled"):
            state.autoscaled[key] = body
        else:
            state.stop_autoscaling(key)

    async def child_event(body: kopf.Body, **kwargs: Any) -> None:
        capture_indexes(state, kwargs)
        owner = owner_key(body)
        if owner is not None:
            await resync(state, *owner)

    for res in CHILD_RESOURCES:
        group, version = res.group_version
        kopf.index(group, version, res.plural, id=index_name(res), registry=registry)(by_owner)
        kopf.on.event(group, version, res.plural, id=f"child-{res.plural}", registry=registry)(child_event)
    return registry, state


def owner_key(body: kopf.Body) -> tuple[str, str] | None:
    owner = (body.metadata.labels or {}).get(names.LABEL_SERVICE)
    return (body.metadata.namespace, owner) if owner and body.metadata.namespace else None


def by_owner(body: kopf.Body, **_: Any) -> dict[tuple[str, str], kopf.Body] | None:
    """Index function: children and engine pods by (namespace, owner name)."""
    key = owner_key(body)
    return {key: body} if key else None


def capture_indexes(state: State, kwargs: dict[str, Any]) -> None:
    """Kopf hands its live indexes only to handlers; keep them for the autoscaler loop and resync."""
    if state.indexes is None:
        state.indexes = {index_name(res): kwargs[index_name(res)] for res in CHILD_RESOURCES}
