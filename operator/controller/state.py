"""What the running operator keeps in memory: config, API client, per-service locks and scalers."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from superinfer.engine import contract
from superinfer.operator.api import names
from superinfer.operator.api.conditions import Cond
from superinfer.operator.autoscaling.decision import Memory
from superinfer.operator.autoscaling.latency_model import LatencyModel
from superinfer.operator.autoscaling.pod_metrics import Window
from superinfer.operator.autoscaling.prometheus_window import PrometheusSource
from superinfer.operator.controller.kube_client import PODMONITORS, PODS, Kube, Login, Res
from superinfer.operator.observability.operator_metrics import OperatorMetrics


def pod_metrics_url(pod: Mapping[str, Any]) -> str | None:
    """The engine's /metrics on a pod: its IP and the container port named http."""
    ip = pod.get("status", {}).get("podIP")
    if not ip:
        return None
    port = contract.DEFAULT_PORT
    for container in pod.get("spec", {}).get("containers", []) or []:
        for p in container.get("ports", []) or []:
            if p.get("name") == names.PORT_NAME:
                port = int(p["containerPort"])
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{contract.METRICS_PATH}"


def index_name(res: Res) -> str:
    """The Kopf index (a handler keyword argument) holding one kind of child by owner."""
    return f"{res.plural}_by_owner"


@dataclass
class Config:
    login: Login
    default_image: str = names.DEFAULT_ENGINE_IMAGE
    podmonitor: Literal["auto", "always", "never"] = "auto"
    timer_interval: float = 5.0  # how often the autoscaler timer wakes (each service has its own interval)
    scrape_timeout: float = 3.0
    prometheus: PrometheusSource | None = None  # for autoscaling.metricsSource: Prometheus
    clock: Callable[[], float] = time.time


@dataclass
class Scaler:
    """One InferenceService's autoscaler memory."""

    memory: Memory
    window: Window
    model: LatencyModel = field(default_factory=LatencyModel)
    last_eval: float = 0.0
    desired: int | None = None
    metrics: Cond | None = None
    scaling: Cond | None = None
    slo: Cond | None = None
    status: dict[str, Any] = field(default_factory=dict)  # status.autoscaler
    slo_status: dict[str, Any] = field(default_factory=dict)  # status.slo


@dataclass
class State:
    config: Config
    kube: Kube
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    locks: defaultdict[tuple[str, str], asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    scalers: dict[tuple[str, str], Scaler] = field(default_factory=dict)
    autoscaled: dict[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)  # latest bodies
    # Kopf's live indexes of children and engine pods by (namespace, owner name), from the watches
    # the operator runs anyway; captured from the first handler that receives them.
    indexes: Mapping[str, Any] | None = None
    _served: dict[str, tuple[float, bool]] = field(default_factory=dict)

    async def child(self, res: Res, namespace: str, name: str) -> Mapping[str, Any] | None:
        """A child (named like its owner) as the watch last saw it; from the API before indexing."""
        if self.indexes is None:
            return await self.kube.get(res, namespace, name)
        return next(iter(self.indexes[index_name(res)].get((namespace, name), [])), None)

    async def pods(self, namespace: str, owner: str) -> list[Mapping[str, Any]]:
        """The owner's engine pods as the watch last saw them; from the API before indexing."""
        if self.indexes is None:
            return await self.kube.list(PODS, namespace, names.selector_labels(owner))
        return list(self.indexes[index_name(PODS)].get((namespace, owner), []))

    async def served(self, api_version: str) -> bool:
        """Whether the cluster serves an API group/version (checked at most once a minute)."""
        now = self.config.clock()
        known = self._served.get(api_version)
        if known is None or now - known[0] > 60:
            known = self._served[api_version] = (now, await self.kube.served(api_version))
        return known[1]

    async def podmonitor_api(self) -> bool:
        """Whether PodMonitors can be created."""
        if self.config.podmonitor != "auto":
            return self.config.podmonitor == "always"
        return await self.served(PODMONITORS.api_version)

    def scaler(self, key: tuple[str, str], window_seconds: float) -> Scaler:
        scaler = self.scalers.get(key)
        if scaler is None or scaler.window.seconds != window_seconds:
            memory = scaler.memory if scaler else Memory(started_at=self.config.clock())
            scaler = Scaler(memory=memory, window=Window(seconds=window_seconds))
            self.scalers[key] = scaler
        return scaler

    def stop_autoscaling(self, key: tuple[str, str]) -> None:
        """Autoscaling turned off: its scaler and gauges go, so turning it on again starts afresh
        (as after a restart) rather than from a stale memory of the replicas it last wrote."""
        self.autoscaled.pop(key, None)
        if self.scalers.pop(key, None) is not None:
            self.metrics.forget_autoscaler(*key)

    def forget(self, key: tuple[str, str]) -> None:
        self.scalers.pop(key, None)
        self.autoscaled.pop(key, None)
        self.locks.pop(key, None)
        self.metrics.forget(*key)
