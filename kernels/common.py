"""What the attention kernels share: the cache's strides, block-table tensors, tile helpers.

The KV cache is block-first, `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`; a
kernel gets the whole tensor, the layer index and the strides, and finds a key of a sequence at
position `pos` in block `block_table[pos // block_size]`, slot `pos % block_size`.

Triton launches on the current CUDA device (and its current stream): the caller makes the
tensors' device current (the runner does, with the Triton backend).

Under the interpreter (`TRITON_INTERPRET=1`, read when `triton.jit` runs, so before these modules
are imported) the kernels run on CPU tensors; `tl.dot` there is wrong on bf16, so bf16 operands are
widened to fp32 first (`UPCAST`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Arguments of the attention kernels that change from step to step (the block table's width is the
# batch's longest context in blocks): Triton would compile a kernel again for each new value == 1
# or divisible by 16, seconds in the middle of serving, so they are not specialized on.
STEP_VARYING = ["layer", "stride_table"]
LOG2E = 1.4426950408889634


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as triton.next_power_of_2 gives it, a third of its
    cost: called for every kernel launch, a few hundred times a step op by op."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@dataclass(frozen=True)
class CacheStrides:
    """Element strides of the block-first cache: block, layer, K->V, slot (token), KV head."""

    block: int
    layer: int
    kv: int
    slot: int
    head: int

    @staticmethod
    def of(kv_cache: torch.Tensor) -> CacheStrides:
        if kv_cache.dim() != 6 or kv_cache.stride(-1) != 1:
            raise ValueError(
                f"expected a [blocks, layers, 2, block_size, kv_heads, head_dim] cache, got {kv_cache.shape}"
            )
        return CacheStrides(*kv_cache.stride()[:5])


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit column stride, for a kernel that takes a row stride: a view
    where the rows have one stride, else a copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def upcast(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands of `dtype` must be widened to fp32 (the interpreter's bf16)."""
    return INTERPRETED and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs in full precision (tests compare them at fp32 tolerances); others: the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, without a host sync on CUDA."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def int32_tensor(values: Sequence[int]) -> torch.Tensor:
    """A host int32 tensor of `values`, through numpy (torch.tensor of a long list is 3-4x slower)."""
    return torch.from_numpy(np.array(values, dtype=np.int32))


def block_table(block_ids: Sequence[Sequence[int]], contexts: Sequence[int], block_size: int) -> torch.Tensor:
    """[n, max blocks] int32 host tensor: each sequence's first cdiv(context, block_size) block ids,
    padded with 0 (never read: the kernels mask keys at or past the context)."""
    widths = [cdiv(c, block_size) for c in contexts]
    table = np.zeros((len(widths), max(widths, default=0) or 1), dtype=np.int32)
    for row, (ids, width) in enumerate(zip(block_ids, widths, strict=True)):
        table[row, :width] = ids[:width]
    return torch.from_numpy(table)


@triton.jit
def kv_offsets(table_row, pos, valid, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr):
    """Element offsets (int64) of the slots holding keys `pos` of the sequence whose block table
    starts at `table_row`; positions not `valid` read block 0 (and are masked by the caller)."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * stride_block + (pos % BLOCK_SIZE) * stride_slot


@triton.jit
def softmax_step(
    q, k, v, keep, m, total, acc, scale_log2, UPCAST: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr
):
    """One tile of online softmax: rows of q against keys k [BLOCK_N, D] and values v; `keep`
    [rows, BLOCK_N] says which keys each row sees (only read when MASKED). Returns (m, total, acc),
    with m the running row max of the log2-scaled scores and l the running sum."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    total = total * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, total, acc
