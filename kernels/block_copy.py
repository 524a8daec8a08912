"""Whole-block copies with a block list on either side: gather scattered blocks of a cache into a
contiguous staging buffer, scatter a staging buffer back into scattered blocks, or both at once.

DuplexKV moves a run of consecutive blocks with one copy; a list of scattered blocks would take
one copy per block. Gathered into a staging buffer first (on the device), they cross the host link
in one copy. A block is contiguous in the block-first layout, so a program copies BLOCK elements of
one block, whatever the dtype (copied as integers of its width: bit-exact).
`copy_blocks_reference` is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer.kernels.common import cdiv

BLOCK = 4096  # elements per program
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _block_copy_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    block_numel,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    src_block = tl.load(src_ids_ptr + i).to(tl.int64) if GATHER else i.to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64) if SCATTER else i.to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    x = tl.load(src_ptr + src_block * block_numel + offs, mask=mask)
    tl.store(dst_ptr + dst_block * block_numel + offs, x, mask=mask)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("block copies need contiguous tensors")
    return t.view(_BITS[t.element_size()])


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor | None = None,
    dst_ids: torch.Tensor | None = None,
) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i, blocks along dim 0; a missing id list means
    0, 1, 2, ... on that side (gather: src_ids only; scatter: dst_ids only)."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"blocks differ: {tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} {dst.dtype}")
    ids = src_ids if src_ids is not None else dst_ids
    if ids is None:
        raise ValueError("give the block ids of at least one side")
    if src_ids is not None and dst_ids is not None and src_ids.numel() != dst_ids.numel():
        raise ValueError("as many source as destination blocks")
    count, block_numel = ids.numel(), src[0].numel()
    if count == 0:
        return
    _block_copy_kernel[(count, cdiv(block_numel, BLOCK))](
        _as_bits(src),
        _as_bits(dst),
        ids if src_ids is None else src_ids,
        ids if dst_ids is None else dst_ids,
        block_numel,
        GATHER=src_ids is not None,
        SCATTER=dst_ids is not None,
        BLOCK=BLOCK,
        num_warps=4,
    )


def gather_blocks(cache: torch.Tensor, ids: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
    """staging[:n] = cache[ids] (n = len(ids)); returns that part of `staging`."""
    copy_blocks(cache, staging, src_ids=ids)
    return staging[: ids.numel()]


def scatter_blocks(staging: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor) -> None:
    """cache[ids] = staging[:n] (n = len(ids))."""
    copy_blocks(staging, cache, dst_ids=ids)


def copy_blocks_reference(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor | None = None,
    dst_ids: torch.Tensor | None = None,
) -> None:
    n = (src_ids if src_ids is not None else dst_ids).numel()
    picked = src[src_ids] if src_ids is not None else src[:n]
    if dst_ids is not None:
        dst.index_copy_(0, dst_ids.long(), picked)
    else:
        dst[:n] = picked
