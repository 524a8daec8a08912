"""Benchmark results as JSON: the command, commit, device and versions with every figure."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def results_dir() -> Path:
    """Where records go: $SUPERINFER_RESULTS_DIR, else the checkout's bench/results when run from a
    checkout's root, else the installed package's bench/results (only as a last resort)."""
    if env := os.environ.get("SUPERINFER_RESULTS_DIR"):
        return Path(env).resolve()
    checkout = Path.cwd() / "bench" / "results"
    return checkout if checkout.is_dir() else Path(__file__).parent.parent / "bench" / "results"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


@functools.cache
def commit() -> str:
    """The checkout's commit (`-dirty` with uncommitted changes) when this process first asked,
    which is when this module was imported: a long run records the code it started with, not a
    commit made while it ran."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


commit()


def versions() -> dict[str, str]:
    """Versions of what the run used; torch's CUDA only if the run imported torch (the simulator
    does not, and its records should not load it)."""
    out = {"python": platform.python_version()}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out["torch"] = importlib.metadata.version("torch")
    for name in ("transformers", "triton"):
        with contextlib.suppress(ImportError):
            out[name] = __import__(name).__version__
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out


def result_stem(bench: str, device: str, tag: str = "") -> str:
    """<bench>[-<tag>]-<device>-<date>: the name of a record (and of what goes with it)."""
    slug = device_name(device).lower().replace(" ", "-")
    return f"{'-'.join(filter(None, (bench, tag, slug)))}-{dt.date.today().isoformat()}"


def write_result(
    bench: str,
    device: str,
    figures: dict[str, Any],
    goal: dict[str, Any],
    extra: dict[str, Any] | None = None,
    tag: str = "",
) -> Path:
    """Write bench/results/<bench>[-<tag>]-<device>-<date>.json (a tag names a variant run)."""
    name = device_name(device)
    record = {
        "bench": bench,
        "command": " ".join(["python", "-m", f"bench.{Path(sys.argv[0]).stem}", *sys.argv[1:]])
        if sys.argv[0].endswith(".py")
        else " ".join(sys.argv),
        "commit": commit(),
        "device": name,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "figures": figures,
        "goal": goal,
        **(extra or {}),
    }
    folder = results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{result_stem(bench, device, tag)}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")  # (paths among the settings)
    return path
