"""Closed loop: the operator (Kopf, against kmock) autoscales real `superinfer serve` processes.

The test plays the Deployment controller and the kubelet: for each replica the operator asks for,
it starts an engine subprocess on loopback with the args the operator rendered into the
Deployment, and publishes a pod object (podIP 127.0.0.1, the engine's port) that turns Ready when
the engine's /ready answers. A load generator (the Service) keeps more requests in flight than one
replica admits, so queueing and TTFT misses show up in the engines' real /metrics; the autoscaler
must scrape them, decide to scale up, and end up scraping both replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from superinfer.engine import contract
from superinfer.operator.api import names
from superinfer.operator.controller.kube_client import DEPLOYMENTS, PODS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("superinfer.engine.serving.server") is None,
        reason="awaits the engine: superinfer.engine.serving.server cannot be imported",
    ),
]

NAME = "sloop"
SPEC = {
    "model": {"uri": "preset://tiny"},
    "engine": {"maxNumSeqs": 2, "maxModelLen": 256},
    "slo": {"ttftMs": 300, "tbtMs": 100, "attainmentTarget": 0.9, "windowSeconds": 10},
    "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
    "autoscaling": {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 2,
        "intervalSeconds": 1,
        "initialDelaySeconds": 0,
        "minRequests": 5,
    },
}


@pytest.fixture
def operator_config() -> dict[str, Any]:
    return {"podmonitor": "never", "timer_interval": 0.3, "scrape_timeout": 2.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_args(args: list[str], port: int) -> list[str]:
    out = list(args)
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = str(port)
    return out


class Kubelet:
    """Replicas of the operator's Deployment as engine processes and pod objects."""

    def __init__(self, running: Any) -> None:
        self.running = running
        self.procs: dict[str, tuple[asyncio.subprocess.Process, int]] = {}
        self.ready: set[str] = set()

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            while True:
                await self.step(http)
                await asyncio.sleep(0.2)

    async def step(self, http: aiohttp.ClientSession) -> None:
        dep = self.running.obj("apps/v1/deployments", NAME)
        if dep is None:
            return
        want = dep["spec"]["replicas"]
        container = dep["spec"]["template"]["spec"]["containers"][0]
        while len(self.procs) < want:
            await self.start(f"{NAME}-{len(self.procs)}", container["args"])
        for pod_name, (proc, port) in self.procs.items():
            if pod_name in self.ready or proc.returncode is not None:
                continue
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"http://127.0.0.1:{port}{contract.READY_PATH}", timeout=1) as resp:
                    if resp.status == 200:
                        self.ready.add(pod_name)
                        await self.running.api.patch(PODS, "default", pod_name, self.pod_status(True), sub="status")
        status = {"replicas": len(self.procs), "readyReplicas": len(self.ready)}
        if dep.get("status", {}).get("readyReplicas") != status["readyReplicas"]:
            await self.running.api.patch(DEPLOYMENTS, "default", NAME, {"status": status}, sub="status")

    async def start(self, pod_name: str, args: list[str]) -> None:
        port = free_port()
        # The console script, not `python -m` from the repo root (where operator/ shadows the stdlib).
        cmd = [str(Path(sys.executable).parent / "superinfer"), "serve", *local_args(args, port)]
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)  # fmt: skip
        self.procs[pod_name] = (proc, port)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": "default", "labels": names.child_labels(NAME)},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
            **self.pod_status(False),
        }
        await self.running.api.create(PODS, "default", pod)

    @staticmethod
    def pod_status(ready: bool) -> dict[str, Any]:
        cond = [{"type": "Ready", "status": "True" if ready else "False"}]
        return {"status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": cond}}

    def ports(self) -> list[int]:
        return [port for name, (_, port) in self.procs.items() if name in self.ready]

    async def stop(self) -> None:
        for proc, _ in self.procs.values():
            if proc.returncode is None:
                proc.terminate()
        for proc, _ in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def load(kubelet: Kubelet, concurrency: int, stop: asyncio.Event) -> int:
    """Keep `concurrency` completions in flight, spread over the ready replicas (the Service)."""
    done = 0

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        nonlocal done
        while not stop.is_set():
            ports = kubelet.ports()
            if not ports:
                await asyncio.sleep(0.1)
                continue
            port = ports[(i + done) % len(ports)]
            body = {"model": NAME, "prompt": "tell me about rotary scheduling", "max_tokens": 24}
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.post(f"http://127.0.0.1:{port}{contract.COMPLETIONS_PATH}", json=body) as resp:
                    await resp.read()
                    done += resp.status == 200

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
    return done


async def test_autoscaler_adds_a_replica_for_real_engines_under_load(running):
    kubelet = Kubelet(running)
    kubelet_task = asyncio.create_task(kubelet.run())
    stop = asyncio.Event()
    load_task = asyncio.create_task(load(kubelet, concurrency=12, stop=stop))
    try:
        await running.create_isvc(NAME, SPEC)

        def scaled_up() -> dict | None:
            status = (running.isvc(NAME) or {}).get("status") or {}
            history = (status.get("autoscaler") or {}).get("history") or []
            return next((h for h in history if h["action"] == "ScaleUp" and h["applied"]), None)

        decision = await _wait(scaled_up, 90)
        assert (decision["fromReplicas"], decision["toReplicas"]) == (1, 2)
        assert decision["reason"] == "SLODistress"
        assert running.isvc(NAME)["spec"]["replicas"] == 2  # written through /scale
        await _wait(lambda: running.obj("apps/v1/deployments", NAME)["spec"]["replicas"] == 2, 10)
        # The second engine comes up and the autoscaler scrapes both.
        await _wait(lambda: len(kubelet.ready) == 2, 60)
        metrics = await _wait(
            lambda: (c := running.condition(NAME, "MetricsAvailable")) and "2 pod(s)" in c["message"] and c, 30
        )
        assert metrics["status"] == "True"
        status = running.isvc(NAME)["status"]
        # What the autoscaler scraped from both pods: the SLO distress was the decision's reason
        # above; once the second engine serves, the window's attainment may have recovered.
        assert status["slo"]["requests"] > 0 and 0.0 <= status["slo"]["attainment"] <= 1.0
        # Requests without a class: held to the target the engines export for `default` (slo.ttftMs).
        (default,) = status["slo"]["classes"]
        assert (default["name"], default["ttftTargetMs"], default["tbtTargetMs"]) == ("default", 300, 100)
        assert running.state.metrics.desired_replicas.labels("default", NAME)._value.get() == 2
    finally:
        stop.set()
        served = await asyncio.wait_for(load_task, 40)
        kubelet_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await kubelet_task
        await kubelet.stop()
    assert served > 0


async def _wait(check, timeout: float) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        with contextlib.suppress(KeyError, TypeError, AttributeError):
            result = check()
            if result:
                return result
        await asyncio.sleep(0.1)
    raise AssertionError(f"not reached in {timeout}s")
