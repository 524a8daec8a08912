"""kmock's Kubernetes emulator plus the bookkeeping a real API server does on writes.

Adds what Kopf and the operator rely on and kmock 0.8 leaves out: names for `generateName`
(Kopf posts Events that way), `uid`, `creationTimestamp`, a `resourceVersion` bumped on every
write and a `generation` bumped on spec writes, and 409 Conflict for a write whose
`metadata.resourceVersion` is not the stored one (optimistic concurrency). `refuse()` makes the next
matching writes fail as an API server refuses them: with an error status and nothing stored (kmock's
own reactions answer with an error but store the write anyway). Everything else is kmock's own
behaviour.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import secrets
import uuid
from typing import Any

import aiohttp.web
from kmock import KubernetesEmulator, action


@dataclasses.dataclass
class Refusal:
    method: str  # POST, PATCH, ...
    plural: str  # deployments, inferenceservices, ...
    subresource: str | None
    status: int
    message: str
    times: int

    def matches(self, request: Any) -> bool:
        return (
            self.times > 0
            and request.method == self.method
            and request.resource is not None
            and request.resource.plural == self.plural
            and (request.subresource or None) == self.subresource
        )


class Emulator(KubernetesEmulator):
    _versions = itertools.count(1)

    def refuse(
        self, method: str, plural: str, status: int, message: str, subresource: str | None = None, times: int = 1
    ) -> Refusal:
        refusal = Refusal(method, plural, subresource, status, message, times)
        self._refusals = [*getattr(self, "_refusals", []), refusal]
        return refusal

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        for refusal in getattr(self, "_refusals", []):
            if refusal.matches(request):
                refusal.times -= 1
                return _status(refusal.status, refusal.message)
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
                    return _status(409, "the object has been modified; please apply your changes to the latest version")
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


REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 422: "Invalid", 500: "InternalError"}


def _status(code: int, message: str) -> aiohttp.web.Response:
    """A metav1.Status error, as the API server answers."""
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": REASONS.get(code, ""),
            "message": message, "code": code}  # fmt: skip
    return aiohttp.web.json_response(body, status=code)
