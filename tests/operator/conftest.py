"""Fixtures for the operator tests: the Kopf operator running against the kmock API emulator."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf
import pytest

from superinfer.operator.api import names
from superinfer.operator.controller.handlers import build_registry
from superinfer.operator.controller.kube_client import Kube
from superinfer.operator.controller.reconcile import ISVC
from superinfer.operator.controller.state import Config, State
from tests.operator.emulator import Emulator

ISVC_RES = f"{names.API_VERSION}/{names.PLURAL}"
_versions = itertools.count(1000)


def isvc(name: str, spec: dict[str, Any], namespace: str = "default", generation: int = 1) -> dict[str, Any]:
    """An InferenceService as the API server would hold it (uid and resourceVersion seeded)."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "resourceVersion": str(next(_versions)),
            "generation": generation,
            "creationTimestamp": "2025-01-01T00:00:00Z",
        },
        "spec": spec,
    }


def register_resources(kmock: Any) -> None:
    kmock.resources.load_bundled()  # without discovery data Kopf never starts watching
    kmock.resources[ISVC_RES] = kmock.ResourceInfo(
        kind=names.KIND,
        singular=names.SINGULAR,
        namespaced=True,
        shortnames=set(names.SHORT_NAMES),
        categories=set(names.CATEGORIES),
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    )


async def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll a condition without blocking the loop (kmock and Kopf run in it)."""
    deadline = asyncio.get_running_loop().time() + timeout
    last_exc: BaseException | None = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            result = check()
            if result:
                return result
        except (KeyError, AssertionError, TypeError, IndexError) as exc:
            last_exc = exc
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not reached in {timeout}s (last error: {last_exc!r})")


class Running:
    """The emulator, the operator's state, and a separate API client for the test's own writes
    (writes through HTTP so that watchers see them, as they would on a real cluster)."""

    def __init__(self, kmock: Any, state: State, api: Kube) -> None:
        self.kmock = kmock
        self.state = state
        self.api = api

    async def create_isvc(self, name: str, spec: dict[str, Any], namespace: str = "default") -> None:
        await self.api.create(ISVC, namespace, isvc(name, spec, namespace))

    def isvc(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.obj(ISVC_RES, name, namespace)

    async def wait_condition(self, name: str, ctype: str, **fields: str) -> dict[str, Any]:
        """Wait until a condition exists with these fields (e.g. reason="CrashLoop")."""

        def check() -> dict[str, Any] | None:
            cond = self.condition(name, ctype)
            return cond if cond and all(cond.get(k) == v for k, v in fields.items()) else None

        return await eventually(check)

    def condition(self, name: str, ctype: str) -> dict[str, Any] | None:
        obj = self.isvc(name) or {}
        return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)

    def obj(self, res: str, name: str, namespace: str = "default") -> Any:
        """The object's latest version as a plain dict, or None when absent or deleted."""
        try:
            found = self.kmock.objects[res, namespace, name]
        except KeyError:
            return None
        return None if found.deleted else found.last.raw


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": Emulator}


@pytest.fixture
def operator_config() -> dict[str, Any]:
    """Overridable knobs of the operator under test."""
    return {"podmonitor": "never", "timer_interval": 0.5}


@pytest.fixture
async def running(kmock: Any, operator_config: dict[str, Any]) -> AsyncIterator[Running]:
    register_resources(kmock)
    server = str(kmock.url).rstrip("/")

    async def login() -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=server)

    registry, state = build_registry(Config(login=login, **operator_config))
    settings = kopf.OperatorSettings()
    settings.watching.connect_timeout = 2
    settings.watching.server_timeout = 10
    settings.networking.request_timeout = 10
    settings.batching.exit_timeout = 0.1
    settings.background.instant_exit_timeout = 0.5
    # kmock answers a failed JSON-patch test (a stale resourceVersion) with 500, which Kopf retries
    # with backoff; a real API server answers 422 and Kopf moves on to the next event at once.
    settings.networking.error_backoffs = [0.05, 0.1, 0.2]
    stop, ready = asyncio.Event(), asyncio.Event()
    # kopf.operator() cancels every task born after it started, this fixture's teardown included;
    # spawn and run the tasks ourselves with an exclusion set that the teardown joins.
    ignored = set(asyncio.all_tasks())
    tasks = await kopf.spawn_tasks(
        registry=registry, settings=settings, clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready
    )
    task = asyncio.create_task(kopf.run_tasks(tasks, ignored=ignored))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        api = Kube(login)
        yield Running(kmock, state, api)
        await api.close()
    finally:
        ignored.add(asyncio.current_task())
        stop.set()
        await asyncio.wait_for(task, 10)
