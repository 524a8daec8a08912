"""A small async Kubernetes REST client (aiohttp) built from Kopf's ConnectionInfo.

The operator needs a handful of verbs on a handful of kinds; this keeps them non-blocking inside
Kopf's event loop and testable against an API emulator.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Res:
    api_version: str  # "apps/v1", "v1"
    plural: str
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def group_version(self) -> tuple[str, str]:
        return self.group, self.api_version.rpartition("/")[2]

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if sub:
            base += f"/{sub}"
        return base


DEPLOYMENTS = Res("apps/v1", "deployments")
SERVICES = Res("v1", "services")
PODS = Res("v1", "pods")
EVENTS = Res("v1", "events")
PDBS = Res("policy/v1", "poddisruptionbudgets")
PODMONITORS = Res("monitoring.coreos.com/v1", "podmonitors")
INFERENCEPOOLS = Res("inference.networking.k8s.io/v1", "inferencepools")
BY_KIND = {
    "Deployment": DEPLOYMENTS,
    "Service": SERVICES,
    "PodDisruptionBudget": PDBS,
    "PodMonitor": PODMONITORS,
    "InferencePool": INFERENCEPOOLS,
}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


Login = Callable[[], Awaitable[kopf.ConnectionInfo]]


class Kube:
    """Credentials come from `login` (the same callable Kopf logs in with); re-login on 401."""

    def __init__(self, login: Login, timeout: float = 30.0) -> None:
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._server = ""

    async def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            info = await self._login()
            self._server = info.server.rstrip("/")
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                headers=info.as_http_headers(),
                timeout=self._timeout,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        for attempt in (0, 1):
            session = await self._open()
            data = json.dumps(body) if body is not None else None
            headers = {"Content-Type": content_type} if body is not None else {}
            async with session.request(method, self._server + path, data=data, params=params, headers=headers) as resp:
                text = await resp.text()
                if resp.status == 401 and attempt == 0:
                    await self.close()
                    continue
                if resp.status >= 400:
                    raise _error(resp.status, text)
                return json.loads(text) if text else {}
        raise AssertionError("unreachable")

    # ---- verbs ----------------------------------------------------------------------------

    async def get(self, res: Res, namespace: str, name: str, sub: str | None = None) -> dict[str, Any] | None:
        try:
            return await self.request("GET", res.path(namespace, name, sub))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, res: Res, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())}
        items = (await self.request("GET", res.path(namespace), params=params)).get("items", [])
        # Filter here too: it costs nothing and does not trust the server's selector support.
        return [i for i in items if _labels_match(i, selector)]

    async def create(self, res: Res, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", res.path(namespace), body)

    async def patch(
        self, res: Res, namespace: str, name: str, body: Mapping[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        return await self.request("PATCH", res.path(namespace, name, sub), body, content_type=MERGE_PATCH)

    async def delete(self, res: Res, namespace: str, name: str) -> bool:
        try:
            await self.request("DELETE", res.path(namespace, name), {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def served(self, api_version: str) -> bool:
        """Whether the cluster serves a group/version (e.g. monitoring.coreos.com/v1)."""
        path = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
        try:
            await self.request("GET", path)
        except ApiError as exc:
            if exc.status in (404, 503):
                return False
            raise
        return True


def _labels_match(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels", {}) or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
    except ValueError:
        payload = {}
    return ApiError(status, str(payload.get("reason", "")), str(payload.get("message", text[:500])))
