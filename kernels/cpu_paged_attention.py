"""Paged attention on the CPU: cpu_paged_attention.c, built for this machine and called in place.

The C kernel reads the block-first cache where it lies: no gather of K and V, no padding to the
longest context, decodes and prompt chunks in one call per layer. It is compiled at first use
with the system's C compiler (`$CC`, else `cc`; `-O3 -march=native -fopenmp`) into a cache folder,
keyed by the source, the flags, the compiler and the CPU, and loaded with ctypes; torch's own
OpenMP runtime serves its threads. `paged_attention_reference` (gather + SDPA per sequence) is
what the tests hold it to.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=fast")
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class KernelBuildError(RuntimeError):
    """The C kernel cannot be built or loaded here (no compiler, a compile error, an odd CPU)."""


def _cpu_identity() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str:
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise KernelBuildError(f"no C compiler: {name!r} is not on PATH (set CC, or use --attention-backend torch)")
    return path


def build(cache_dir: Path) -> Path:
    """The shared library for this machine, compiled into `cache_dir` unless already there."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_identity()]).encode()
    ).hexdigest()[:16]
    target = cache_dir / f"cpu_paged_attention-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed on {SOURCE.name}:\n{result.stderr.strip()}")
        os.replace(built, target)  # atomic: another process building the same key is harmless
    return target


@functools.cache
def load(cache_dir: Path) -> ctypes.CDLL:
    """Builds (if needed) and loads the kernel; raises KernelBuildError with the reason. torch,
    imported above, has loaded its libgomp already, so the kernel's OpenMP uses that runtime."""
    try:
        lib = ctypes.CDLL(str(build(cache_dir)))
    except OSError as e:
        raise KernelBuildError(f"cannot load the CPU attention kernel: {e}") from e
    lib.paged_attention.restype = None
    lib.paged_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
    ]  # fmt: skip
    return lib


def check_shapes(lib: ctypes.CDLL, kv_cache: torch.Tensor, q_heads: int) -> None:
    """Raises ValueError when the kernel cannot serve this cache and head count."""
    _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    if kv_cache.stride()[4:] != (head_dim, 1):
        raise ValueError("the CPU attention kernel takes a cache whose KV heads and head dims are contiguous")
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"the CPU attention kernel takes a float32 or bfloat16 KV cache, not {kv_cache.dtype}")
    limits = {
        "query heads per KV head": (q_heads // kv_heads, lib.max_group()),
        "head_dim": (head_dim, lib.max_dim()),
        "block_size": (block_size, lib.max_block()),
    }
    for name, (value, limit) in limits.items():
        if value > limit:
            raise ValueError(f"the CPU attention kernel takes {name} up to {limit}, not {value}")
    if head_dim % (2 * lib.lanes()):
        raise ValueError(
            f"the CPU attention kernel takes a head_dim that is a multiple of {2 * lib.lanes()}, not {head_dim}"
        )


@dataclass(frozen=True)
class SpanTable:
    """A step's sequences for the kernel: four int32 each (first row, rows, context length, offset of
    its block table), and the block tables one after another."""

    spans: torch.Tensor
    tables: torch.Tensor

    @staticmethod
    def build(
        rows: Sequence[int],
        num_tokens: Sequence[int],
        contexts: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        block_size: int,
    ) -> SpanTable:
        table: list[int] = []
        spans: list[int] = []
        for row, n, context, ids in zip(rows, num_tokens, contexts, block_ids, strict=True):
            spans += (row, n, context, len(table))
            table += ids[: -(-context // block_size)]
        # Through numpy: torch.tensor of a long list is 3-4x slower.
        as_int32 = np.array(spans, dtype=np.int32), np.array(table or [0], dtype=np.int32)
        return SpanTable(*map(torch.from_numpy, as_int32))


def paged_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    batch: SpanTable,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention of the rows of `q` [T, Hq, D] (fp32, contiguous) that `batch` names, into the same
    rows of `out`, against layer `layer` of `kv_cache` (the step's new K/V already written)."""
    _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    block_stride, _, v_offset, slot_stride = kv_cache.stride()[:4]
    lib.paged_attention(
        q.data_ptr(),
        out.data_ptr(),
        kv_cache[0, layer].data_ptr(),
        CACHE_DTYPES[kv_cache.dtype],
        block_stride,
        v_offset,
        slot_stride,
        batch.tables.data_ptr(),
        batch.spans.data_ptr(),
        batch.spans.shape[0] // 4,
        q.shape[1],
        kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )


def paged_attention_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, batch: SpanTable, scale: float, out: torch.Tensor
) -> None:
    """The same in torch: each sequence's keys gathered, then causal SDPA over its own rows."""
    block_size = kv_cache.shape[3]
    spans = batch.spans.view(-1, 4).tolist()
    for row, n, context, offset in spans:
        ids = batch.tables[offset : offset + -(-context // block_size)].long()
        k = kv_cache[ids, layer, 0].flatten(0, 1)[:context].transpose(0, 1).float()  # [Hkv, ctx, D]
        v = kv_cache[ids, layer, 1].flatten(0, 1)[:context].transpose(0, 1).float()
        qs = q[row : row + n].transpose(0, 1)  # [Hq, n, D]
        visible = torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
        out[row : row + n] = o.transpose(0, 1).to(out.dtype)
