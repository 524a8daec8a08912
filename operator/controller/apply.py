"""Idempotent create-or-patch of child objects (safe to run twice, repairs drift).

A child is patched only when what we want is not already a subset of what is there (so API
server defaults never cause churn). The patch is a JSON merge patch of the desired object plus
explicit nulls for keys we set last time and no longer want, remembered in an annotation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any, Literal

import kopf

from superinfer.operator.api import quantity
from superinfer.operator.api.names import LAST_APPLIED
from superinfer.operator.controller.kube_client import BY_KIND, ApiError, Kube

Action = Literal["created", "patched", "unchanged"]
CONFLICT_RETRIES = 3
QUANTITY_MAPS = ("requests", "limits")


class NotOurs(Exception):
    """The object exists and this owner does not control it: it is left as it is."""


def is_subset(want: Any, have: Any, quantities: bool = False) -> bool:
    """Whether `have` already contains everything in `want` (dicts partially, lists item by item).

    Values of `requests`/`limits` maps are compared as quantities: the API server stores them in
    canonical form ("0.5" comes back as "500m"), which is not drift. A key we want empty ("", 0,
    false, {}, [], null) may be absent: the API server leaves empty fields out.
    """
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            is_subset(v, have[k], quantities or k in QUANTITY_MAPS) if k in have else not v for k, v in want.items()
        )
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return want == have or (quantities and _same_quantity(want, have))


def _same_quantity(want: Any, have: Any) -> bool:
    try:
        return quantity.parse(want) == quantity.parse(have)
    except (ValueError, TypeError, AttributeError):
        return False


def removals(last: Any, want: Any) -> Any:
    """Nulls for keys present in `last` but gone from `want` (recursively through dicts)."""
    if not (isinstance(last, Mapping) and isinstance(want, Mapping)):
        return None
    out: dict[str, Any] = {}
    for key, old in last.items():
        if key not in want:
            out[key] = None
        else:
            sub = removals(old, want[key])
            if sub:
                out[key] = sub
    return out


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        elif key not in out:
            out[key] = value
    return out


def with_last_applied(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object with its own content remembered in an annotation."""
    body = json.loads(json.dumps(obj))
    meta = body.setdefault("metadata", {})
    meta.setdefault("annotations", {})[LAST_APPLIED] = json.dumps(_content(obj), sort_keys=True)
    return body


def _content(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("status",)}


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return next((ref.get("uid") for ref in refs if ref.get("controller")), None)


def patch_for(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that turns `current` into `desired`, or None when nothing is to do."""
    if is_subset(desired, current):
        return None
    raw_last = (current.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED)
    last = json.loads(raw_last) if raw_last else {}
    return deep_merge(dict(desired), removals(last, desired) or {})


async def apply(kube: Kube, obj: Mapping[str, Any], cached: Mapping[str, Any] | None = None) -> Action:
    """Create the object, or patch it back to what we want; retries 409 conflicts.

    `cached` is the object as the operator's watch last saw it (None: not seen); the first attempt
    trusts it, and a conflict (it was stale) makes the retries read the API server. An object of
    the same name that another owner (or none) controls raises NotOurs: it is never taken over.
    """
    res = BY_KIND[obj["kind"]]
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    desired = with_last_applied(obj)
    for attempt in range(CONFLICT_RETRIES):
        try:
            current = cached if attempt == 0 else await kube.get(res, ns, name)
            if current is None:
                await kube.create(res, ns, desired)
                return "created"
            owner = _controller_uid(desired)
            if owner is not None and _controller_uid(current) != owner:
                raise NotOurs(
                    f"a {obj['kind']} named {ns}/{name} already exists and this InferenceService does not own it: "
                    "delete or rename that object, or give the InferenceService another name"
                )
            patch = patch_for(current, desired)
            if patch is None:
                return "unchanged"
            await kube.patch(res, ns, name, patch)
            return "patched"
        except ApiError as exc:
            if exc.status != 409:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))
    raise kopf.TemporaryError(f"{obj['kind']} {ns}/{name}: conflicts persisted, retrying", delay=5)
