"""Helpers for the real-cluster suite: tools, kind, images, kubectl and helm as subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = os.environ.get("E2E_CLUSTER_NAME", "superinfer-e2e")
IMAGE = os.environ.get("E2E_IMAGE", "superinfer:e2e")
NAMESPACE = os.environ.get("E2E_NAMESPACE", "superinfer-e2e")
RELEASE = "superinfer"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def missing_tools() -> list[str]:
    """What this machine lacks to run the suite (empty when it can)."""
    missing = [tool for tool in ("kubectl", "helm") if shutil.which(tool) is None]
    if os.environ.get("E2E_KUBECONTEXT"):
        return missing  # an existing cluster; the image must already be pullable there
    if shutil.which("kind") is None:
        missing.append("kind (or set E2E_KUBECONTEXT to use an existing cluster)")
    if shutil.which("docker") is None:
        missing.append("docker")
    elif run(["docker", "info"], check=False, capture=True).returncode != 0:
        missing.append("a running container runtime (docker info fails)")
    return missing


def run(
    cmd: Sequence[str], *, check: bool = True, capture: bool = False, stdin: str | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(
        list(cmd), check=check, text=True, input=stdin, timeout=timeout,
        stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None,
    )  # fmt: skip


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    """stdout (with check, raising on failure) or stdout + stderr (without)."""
    ctx = os.environ.get("E2E_KUBECONTEXT") or f"kind-{CLUSTER}"
    out = run(["kubectl", "--context", ctx, *args], stdin=stdin, check=False, capture=True)
    if check and out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out.stdout if check else out.stdout + out.stderr


def kube_json(*args: str) -> dict[str, Any]:
    return json.loads(kubectl(*args, "-o", "json"))


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 3.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (RuntimeError, KeyError, ValueError) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def create_cluster() -> bool:
    """Create the kind cluster unless it exists; True when this run created it."""
    if os.environ.get("E2E_KUBECONTEXT"):
        return False
    existing = run(["kind", "get", "clusters"], capture=True).stdout.split()
    if CLUSTER in existing:
        return False
    run(["kind", "create", "cluster", "--name", CLUSTER, "--wait", "120s"])
    return True


def delete_cluster() -> None:
    run(["kind", "delete", "cluster", "--name", CLUSTER], check=False)


def build_and_load_image() -> None:
    if os.environ.get("E2E_SKIP_BUILD") != "1":
        run(["docker", "build", "--build-arg", f"TORCH_INDEX_URL={CPU_TORCH_INDEX}", "-t", IMAGE, str(ROOT)],
            timeout=3600)  # fmt: skip
    if not os.environ.get("E2E_KUBECONTEXT"):
        run(["kind", "load", "docker-image", IMAGE, "--name", CLUSTER])


def fake_gpu_capacity(per_node: int = 4) -> None:
    """Advertise nvidia.com/gpu on every node (no device plugin needed for scheduling tests)."""
    for node in kube_json("get", "nodes")["items"]:
        patch = json.dumps({"status": {"capacity": {"nvidia.com/gpu": str(per_node)}}})
        kubectl("patch", "node", node["metadata"]["name"], "--subresource=status", "--type=merge", "-p", patch)


def helm_install() -> None:
    repo, _, tag = IMAGE.rpartition(":")
    ctx = os.environ.get("E2E_KUBECONTEXT") or f"kind-{CLUSTER}"
    run(["helm", "upgrade", "--install", RELEASE, str(ROOT / "charts" / "superinfer"), "--kube-context", ctx,
         "--namespace", NAMESPACE, "--create-namespace", "--wait", "--timeout", "5m",
         "--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
         "--set", "operator.logLevel=debug"])  # fmt: skip


def helm_uninstall() -> None:
    ctx = os.environ.get("E2E_KUBECONTEXT") or f"kind-{CLUSTER}"
    run(["helm", "uninstall", RELEASE, "--kube-context", ctx, "--namespace", NAMESPACE, "--wait"], check=False)


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)
