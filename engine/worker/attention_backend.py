"""Which attention backend runs a step (`--attention-backend`): the torch reference, the C kernel
on the CPU, or the Triton kernels on CUDA, with the reason when the one asked for cannot run."""

from __future__ import annotations

import importlib
import logging
import os
from typing import Literal

import torch

from superinfer.engine.worker.attention import StepAttention, torch_attention

log = logging.getLogger(__name__)


def _triton_imports() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _cpu_kernel_problem(kv_cache: torch.Tensor, q_heads: int) -> str | None:
    """Why the CPU kernel cannot serve this cache here (no compiler, a failed build, a shape or
    dtype it does not take), or None when it can."""
    from superinfer.engine.worker.cpu_attention import kernel_library
    from superinfer.kernels.cpu_paged_attention import KernelBuildError, check_shapes

    try:
        check_shapes(kernel_library(), kv_cache, q_heads)
    except (KernelBuildError, ValueError) as e:
        return str(e)
    return None


def resolve_backend(choice: str, kv_cache: torch.Tensor, q_heads: int) -> Literal["torch", "triton", "cpu"]:
    """`auto`: Triton on CUDA when triton imports, else torch; on the CPU the C kernel when it
    builds and takes this cache, else torch. `triton` on the CPU runs the kernels in Triton's
    interpreter (slow: for tests), so it needs TRITON_INTERPRET=1."""
    device = kv_cache.device
    if choice == "torch":
        return "torch"
    if choice == "auto" and device.type == "cpu":
        problem = _cpu_kernel_problem(kv_cache, q_heads)
        if problem is not None:
            log.warning("attention: the CPU kernel is not used (%s); the torch backend runs instead", problem)
        return "torch" if problem else "cpu"
    if choice == "auto":
        return "triton" if device.type == "cuda" and _triton_imports() else "torch"
    if choice == "cpu":
        if device.type != "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU, not {device.type}")
        problem = _cpu_kernel_problem(kv_cache, q_heads)
        if problem is not None:
            raise ValueError(f"--attention-backend cpu: {problem}")
        return "cpu"
    if choice != "triton":
        raise ValueError(f"unknown attention backend {choice!r}; choose auto, torch, cpu or triton")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--attention-backend triton runs on CUDA (or the CPU, interpreted), not {device.type}")
    if not _triton_imports():
        raise ValueError("--attention-backend triton: triton is not installed (pip install 'superinfer[gpu]')")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--attention-backend triton on the CPU runs Triton's interpreter (slow, for tests): set TRITON_INTERPRET=1"
        )
    return "triton"


def attention_backend(choice: str, kv_cache: torch.Tensor, q_heads: int) -> tuple[str, StepAttention]:
    """The backend `choice` resolves to for `kv_cache` and `q_heads` query heads (this rank's):
    its name and its per-step attention."""
    name = resolve_backend(choice, kv_cache, q_heads)
    if name == "torch":
        return name, torch_attention
    if name == "cpu":
        from superinfer.engine.worker.cpu_attention import cpu_attention

        return name, cpu_attention()
    from superinfer.engine.worker.triton_attention import TritonPagedAttention
    from superinfer.kernels.common import INTERPRETED

    if kv_cache.device.type == "cpu" and not INTERPRETED:
        raise ValueError("the Triton kernels were imported before TRITON_INTERPRET=1 was set: set it at startup")
    return name, TritonPagedAttention.for_step
