"""Decode attention over the paged, block-first KV cache: one query token per sequence.

Grid (sequences, KV heads, splits). A program takes every query head of one KV head (GQA: each K
and V tile it loads serves them all, the heads padded to at least 16 rows for tl.dot) over one
split of the context, BLOCK_N keys at a time, each key found through the block table. Long
contexts with few sequences are split across programs (flash-decoding): each split writes its
normalized output and log-sum-exp, and `_reduce_kernel` combines them. With one split the first
kernel writes the output itself.

Accumulation is fp32 whatever the input dtype. `paged_decode_reference` is the torch reference.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from superinfer.kernels.common import (
    LOG2E,
    STEP_VARYING,
    CacheStrides,
    block_table,
    cdiv,
    dot_precision,
    int32_tensor,
    kv_offsets,
    next_pow2,
    softmax_step,
    to_device,
    upcast,
)

# Keys per tile, warps and pipeline stages: the fastest of bench.attn --sweep on an H100 at B=64 x
# 2k keys on 2026-11-26 (231 us, 81% of HBM; 32 keys x 4 warps, the earlier choice by register
# count: 256 us). Each later sweep had another ahead: 64 x 4 x 3 by 14%, then 128 x 8 x 4 by 6%.
BLOCK_N = 128
NUM_WARPS = 8
NUM_STAGES = 3
MIN_SPLIT = 512  # keys: a shorter split costs more in the reduction than it gains


@dataclass(frozen=True)
class DecodeBatch:
    """One step's decodes: output row, context length and block table of each sequence."""

    rows: torch.Tensor  # [B] int32: the sequence's row in q and out
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max blocks] int32
    max_context: int  # on the host
    split_keys: int  # keys per split (a multiple of BLOCK_N): the whole context unless SMs would idle

    @staticmethod
    def build(
        rows: Sequence[int],
        contexts: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device,
        kv_heads: int,
        split_keys: int | None = None,
    ) -> DecodeBatch:
        """`split_keys` overrides `split_size`."""
        if split_keys is not None and (split_keys <= 0 or split_keys % BLOCK_N):
            raise ValueError(f"split_keys must be a positive multiple of {BLOCK_N}, got {split_keys}")

        def ints(values: Sequence[int]) -> torch.Tensor:
            return to_device(int32_tensor(values), device)

        table = to_device(block_table(block_ids, contexts, block_size), device)
        longest = max(contexts)
        if split_keys is None:
            split_keys = split_size(len(rows) * kv_heads, longest, device)
        return DecodeBatch(ints(rows), ints(contexts), table, longest, split_keys)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_size(programs: int, max_context: int, device: torch.device) -> int:
    """Keys per split: the whole context unless the sequences x KV heads leave the GPU's SMs idle;
    then enough splits for about two programs per SM, each at least MIN_SPLIT keys."""
    whole = cdiv(max_context, BLOCK_N) * BLOCK_N
    if device.type != "cuda":
        return whole
    want = cdiv(2 * _sm_count(device), programs)
    return min(whole, cdiv(max(MIN_SPLIT, cdiv(max_context, want)), BLOCK_N) * BLOCK_N)


@triton.jit(do_not_specialize=[*STEP_VARYING, "split_keys", "num_splits"])
def _decode_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    rows_ptr,
    context_lens_ptr,
    block_tables_ptr,
    part_out_ptr,  # [B, Hq, splits, D] fp32 (only with SPLIT)
    part_lse_ptr,  # [B, Hq, splits] fp32 (only with SPLIT)
    layer,
    scale_log2,
    split_keys,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_block,
    stride_layer,
    stride_kv,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_lens_ptr + seq)
    start = split * split_keys
    if start >= context:
        return
    end = tl.minimum(start + split_keys, context)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    row = tl.load(rows_ptr + seq)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    k_base = cache_ptr + layer * stride_layer + kv_head * stride_head
    table_row = block_tables_ptr + seq * stride_table
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        valid = pos < end
        offs = kv_offsets(table_row, pos, valid, stride_block, stride_slot, BLOCK_SIZE)
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        rows = k_base + offs  # a pointer per key, then one per element: fewer registers than offsets first
        k = tl.load(rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load((rows + stride_kv)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        m, total, acc = softmax_step(q, k, v, valid[None, :], m, total, acc, scale_log2, UPCAST, PRECISION, True)

    out = acc / total[:, None]
    if SPLIT:
        part = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=row_mask)
        tl.store(part_lse_ptr + part, m + tl.log2(total), mask=g < GROUP)
    else:
        dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["split_keys", "num_splits"])
def _reduce_kernel(
    out_ptr,
    rows_ptr,
    context_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    split_keys,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (sequence, query head): the splits' outputs weighted by their share of the softmax,
    BLOCK_S splits at a time."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(context_lens_ptr + seq), split_keys)
    d = tl.arange(0, BLOCK_D)
    base = (seq * tl.num_programs(1) + head) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, used, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        lse = tl.load(part_lse_ptr + base + s, mask=s < used, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        mask = (s < used)[:, None] & (d < HEAD_DIM)[None, :]
        parts = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        acc = acc * alpha + tl.sum(parts * weight[:, None], 0)
        total = total * alpha + tl.sum(weight, 0)
        m = m_new
    row = tl.load(rows_ptr + seq)
    dst = out_ptr + row * stride_ot + head * stride_oh + d
    tl.store(dst, (acc / total).to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    batch: DecodeBatch,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q[batch.rows] [.., Hq, D] over each sequence's cached keys of `layer`, written
    to the same rows of `out` (other rows untouched)."""
    _, layers, _, block_size, kv_heads, head_dim = kv_cache.shape
    heads = q.shape[1]
    if q.stride(-1) != 1 or q.shape[-1] != head_dim or heads % kv_heads or not 0 <= layer < layers:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(kv_cache.shape)} at layer {layer}")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q is {q.dtype}, the cache {kv_cache.dtype}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    num_seqs, group, split_keys = batch.rows.numel(), heads // kv_heads, batch.split_keys
    num_splits = cdiv(batch.max_context, split_keys)
    split = num_splits > 1
    part_out = part_lse = out  # placeholders: not read without SPLIT
    if split:
        part_out = torch.empty(num_seqs, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, heads, num_splits, dtype=torch.float32, device=q.device)
    st = CacheStrides.of(kv_cache)
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        q,
        out,
        kv_cache,
        batch.rows,
        batch.context_lens,
        batch.block_tables,
        part_out,
        part_lse,
        layer,
        scale * LOG2E,
        split_keys,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        batch.block_tables.stride(0),
        st.block,
        st.layer,
        st.kv,
        st.slot,
        st.head,
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_N=BLOCK_N,
        SPLIT=split,
        UPCAST=upcast(q.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if split:
        _reduce_kernel[(num_seqs, heads)](
            out,
            batch.rows,
            batch.context_lens,
            part_out,
            part_lse,
            split_keys,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=next_pow2(head_dim),
            BLOCK_S=16,  # (not the splits' count: each new one would compile the kernel again)
            num_warps=4,
        )
    return out


def gather_context(kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int], context: int) -> torch.Tensor:
    """[2, context, kv_heads, head_dim]: one sequence's keys and values of `layer`, in order."""
    block_size = kv_cache.shape[3]
    ids = torch.as_tensor(list(block_ids[: cdiv(context, block_size)]), device=kv_cache.device)
    kv = kv_cache[ids, layer]  # [blocks, 2, block_size, H, D]
    return kv.transpose(0, 1).reshape(2, -1, *kv.shape[-2:])[:, :context]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in fp32 of q [n, Hq, D], the last n positions, over k, v [ctx, Hkv, D]."""
    n, ctx = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(rep, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    hidden = torch.arange(ctx, device=q.device)[None, :] > torch.arange(ctx - n, ctx, device=q.device)[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    rows: Sequence[int],
    contexts: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    scale: float,
) -> torch.Tensor:
    """What `paged_decode` computes, one sequence at a time in fp32: [len(rows), Hq, D]."""
    outs = []
    for row, context, ids in zip(rows, contexts, block_ids, strict=True):
        k, v = gather_context(kv_cache, layer, ids, context)
        outs.append(attention_reference(q[row : row + 1], k, v, scale))
    return torch.cat(outs)
