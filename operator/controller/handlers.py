"""Kopf wiring: which events run which reconciliation (the logic: reconcile.py, autoscaling/tick.py)."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from superinfer.operator.api import names
from superinfer.operator.autoscaling import tick
from superinfer.operator.controller.kube_client import Kube
from superinfer.operator.controller.reconcile import delete_children, resync, status_changed, sync
from superinfer.operator.controller.state import Config, State

RESOURCE = (names.GROUP, names.VERSION, names.PLURAL)
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("monitoring.coreos.com", "v1", "podmonitors"),
)
OURS = {names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_SERVICE: kopf.PRESENT}


def configure(settings: kopf.OperatorSettings) -> None:
    """Branded persistence: finalizer, progress and diff-base annotations under our group."""
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.batching.error_delays = [1, 2, 5, 10, 30, 60]


def _autoscaling_enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def build_registry(config: Config) -> tuple[kopf.OperatorRegistry, State]:
    registry = kopf.OperatorRegistry()
    state = State(config=config, kube=Kube(config.login))

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
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
    async def reconcile(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        key = (body.metadata.namespace or "", body.metadata.name or "")
        async with state.locks[key]:
            try:
                status = await sync(state, body)
            except Exception:
                state.metrics.reconcile_errors.labels(*key).inc()
                raise
        if status_changed(body.get("status"), status):
            patch.status.update(status)

    @kopf.on.delete(*RESOURCE, registry=registry)
    async def delete(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        key = (body.metadata.namespace or "", body.metadata.name or "")
        async with state.locks[key]:  # no resync may write the owner while it is being released
            deleted = await delete_children(state, body)
        logger.info("deleted children: %s", ", ".join(deleted) or "none")
        state.forget(key)

    @kopf.timer(*RESOURCE, interval=config.timer_interval, when=_autoscaling_enabled, registry=registry)
    async def autoscaler(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        decision = await tick.tick(state, body, logger)
        if decision is not None:
            # Re-read the owner: a /scale write has just changed its spec, and `body` predates it
            # (syncing from `body` could set the Deployment back to the old replica count).
            await resync(state, body.metadata.namespace or "", body.metadata.name or "")

    async def child_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        owner = (body.metadata.labels or {}).get(names.LABEL_SERVICE)
        if owner and body.metadata.namespace:
            await resync(state, body.metadata.namespace, owner)

    for group, version, plural in CHILD_RESOURCES:
        kopf.on.event(group, version, plural, labels=OURS, id=f"child-{plural}", registry=registry)(child_event)
    kopf.on.event("", "v1", "pods", labels=OURS, id="engine-pods", registry=registry)(child_event)
    return registry, state
