"""Kubernetes Events about an InferenceService, posted through the operator's own API client.

Kopf's `kopf.info()` works only inside Kopf's handlers; the autoscaler loop runs outside them, so
every event goes this way. An event that cannot be posted is logged and dropped: events are notes,
never a reason to fail a reconciliation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from superinfer.operator.controller.kube_client import EVENTS, ApiError, Kube
from superinfer.operator.controller.timestamps import now_iso

COMPONENT = "superinfer-operator"
log = logging.getLogger("superinfer.operator.events")


def event_body(owner: Mapping[str, Any], reason: str, message: str, warning: bool, now: float) -> dict[str, Any]:
    meta = owner["metadata"]
    stamp = now_iso(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": owner.get("apiVersion"),
            "kind": owner.get("kind"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": "Warning" if warning else "Normal",
        "reason": reason,
        "message": message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def post(
    kube: Kube, owner: Mapping[str, Any], reason: str, message: str, now: float, warning: bool = False
) -> None:
    try:
        await kube.create(EVENTS, owner["metadata"]["namespace"], event_body(owner, reason, message, warning, now))
    except (ApiError, OSError) as exc:
        log.info("event %s for %s not posted: %s", reason, owner["metadata"].get("name"), exc)
