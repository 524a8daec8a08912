"""kmock's Kubernetes emulator plus the bookkeeping a real API server does on writes.

Adds what Kopf and the operator rely on and kmock 0.8 leaves out: names for `generateName`
(Kopf posts Events that way), `uid`, `creationTimestamp`, a `resourceVersion` bumped on every
write and a `generation` bumped on spec writes, and 409 Conflict for a write whose
`metadata.resourceVersion` is not the stored one (optimistic concurrency). Everything else is
kmock's own behaviour.
"""

from __future__ import annotations

import datetime
import itertools
import secrets
import uuid
from typing import Any

import aiohttp.web
from kmock import KubernetesEmulator, action


class Emulator(KubernetesEmulator):
    _versions = itertools.count(1)

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        data = request.data if isinstance(request.data, dict) else None
        if request.resource is not None and data is not None:
            meta = data.setdefault("metadata", {})
            if request.action == action.CREATE:
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + secrets.token_hex(3)
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                now = datetime.datetime.now(tz=datetime.timezone.utc)
                meta.setdefault("creationTimestamp", now.strftime("%Y-%m-%dT%H:%M:%SZ"))
                meta["resourceVersion"] = str(next(self._versions))
            elif request.action == action.UPDATE and request.name is not None:
                wanted = meta.get("resourceVersion")
                if wanted is not None and wanted != self._stored_version(request):
                    return aiohttp.web.json_response(
                        {"kind": "Status", "status": "Failure", "reason": "Conflict", "code": 409,
                         "message": "the object has been modified; please apply your changes to the latest version"},
                        status=409,
                    )  # fmt: skip
                meta["resourceVersion"] = str(next(self._versions))
                if "spec" in data and request.subresource != "status":
                    meta["generation"] = self._generation(request) + 1
        return await super()._handle(request)

    def _stored_version(self, request: Any) -> str | None:
        try:
            obj = self.objects[request.resource, request.namespace, request.name]
        except KeyError:
            return None
        return None if obj.deleted else obj.get("metadata", {}).get("resourceVersion")

    def _generation(self, request: Any) -> int:
        try:
            obj = self.objects[request.resource, request.namespace, request.name]
        except KeyError:
            return 0
        if obj.deleted:
            return 0
        return int(obj.get("metadata", {}).get("generation", 0) or 0)
