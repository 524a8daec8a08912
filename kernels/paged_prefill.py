"""Causal attention of new tokens (prompt chunks, prefix-cache hits, decodes as 1-token extends)
over the paged, block-first KV cache, for a ragged batch.

Sequence b has `q_lens[b]` new tokens at rows `q_starts[b]`.. of q (packed: the cu_seqlens of the
batch), the last of its `context_lens[b]` positions; their K and V are already in the cache (the
KV write runs first), next to the earlier context. Grid (tiles, KV heads): a tile is BLOCK_M new
tokens of one sequence, listed on the host (`ExtendBatch.build`) so a ragged batch launches no
idle programs. A program attends the tile's tokens x every query head of its KV head (GQA: rows
token-major) over keys 0..its last position: unmasked up to its first token's position, causally
masked after.

Accumulation is fp32 whatever the input dtype. `paged_prefill_reference` is the torch reference.
"""

from __future__ import annotations

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
    dot_precision,
    int32_tensor,
    kv_offsets,
    next_pow2,
    softmax_step,
    to_device,
    upcast,
)
from superinfer.kernels.paged_decode import attention_reference, gather_context

# Keys and query rows (tokens x heads of a KV head) per tile, warps and pipeline stages: the fastest
# of bench.attn --sweep on an H100 at T=4096 on 2026-11-26 (439 us, 313 TFLOP/s; 8 warps x 3 stages:
# 920 us). Two later sweeps had 128 rows x 128 keys x 8 warps x 2 stages ahead by 2-4%.
BLOCK_N = 64
ROWS = 64
NUM_WARPS = 4
NUM_STAGES = 2


def block_m(group: int) -> int:
    """Tokens per tile: ROWS rows of `group` query heads each (at least one token)."""
    return max(1, ROWS // next_pow2(group))


@dataclass(frozen=True)
class ExtendBatch:
    q_starts: torch.Tensor  # [B] int32: first row of the sequence's new tokens in q and out
    q_lens: torch.Tensor  # [B] int32: new tokens
    context_lens: torch.Tensor  # [B] int32: keys in all, the new ones last
    block_tables: torch.Tensor  # [B, max blocks] int32
    tile_seqs: torch.Tensor  # [tiles] int32: the tile's sequence
    tile_starts: torch.Tensor  # [tiles] int32: its first new token (0, BLOCK_M, ...)
    block_m: int

    @staticmethod
    def build(
        q_starts: Sequence[int],
        q_lens: Sequence[int],
        contexts: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        block_size: int,
        group: int,
        device: torch.device,
    ) -> ExtendBatch:
        """`group`: query heads per KV head, which sets the tile's tokens."""
        if any(n < 1 or n > c for n, c in zip(q_lens, contexts, strict=True)):
            raise ValueError("every sequence needs 1..context new tokens")
        m = block_m(group)
        tiles = [(b, t) for b, n in enumerate(q_lens) for t in range(0, n, m)]
        # Most keys first: the longest tiles do not start last and leave the GPU idle at the end.
        tiles.sort(key=lambda bt: contexts[bt[0]] - q_lens[bt[0]] + bt[1], reverse=True)

        def ints(values: Sequence[int]) -> torch.Tensor:
            return to_device(int32_tensor(values), device)

        return ExtendBatch(
            q_starts=ints(q_starts),
            q_lens=ints(q_lens),
            context_lens=ints(contexts),
            block_tables=to_device(block_table(block_ids, contexts, block_size), device),
            tile_seqs=ints([b for b, _ in tiles]),
            tile_starts=ints([t for _, t in tiles]),
            block_m=m,
        )


@triton.jit(do_not_specialize=STEP_VARYING)
def _prefill_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    q_starts_ptr,
    q_lens_ptr,
    context_lens_ptr,
    block_tables_ptr,
    tile_seqs_ptr,
    tile_starts_ptr,
    layer,
    scale_log2,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seqs_ptr + tile)
    tile_start = tl.load(tile_starts_ptr + tile)
    q_start = tl.load(q_starts_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    context = tl.load(context_lens_ptr + seq)
    past = context - q_len  # keys before the first new token

    r = tl.arange(0, BLOCK_M * BLOCK_G)
    token = tile_start + r // BLOCK_G
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    real = (token < q_len) & (g < GROUP)
    row_mask = real[:, None] & (d < HEAD_DIM)[None, :]
    # Padding rows take the tile's last real token's position: every row then sees key 0.
    q_pos = past + tl.minimum(token, q_len - 1)
    q_rows = (q_start + token) * stride_qt + (kv_head * GROUP + g) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    k_base = cache_ptr + layer * stride_layer + kv_head * stride_head
    table_row = block_tables_ptr + seq * stride_table
    d_mask = (d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    # Whole tiles every row sees (keys at or before the first token's position): no mask.
    unmasked_end = (past + tile_start + 1) // BLOCK_N * BLOCK_N
    for first in range(0, unmasked_end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        offs = kv_offsets(table_row, pos, pos < unmasked_end, stride_block, stride_slot, BLOCK_SIZE)
        rows = k_base + offs  # a pointer per key, then one per element: fewer registers than offsets first
        k = tl.load(rows[:, None] + d[None, :], mask=d_mask, other=0.0)
        v = tl.load((rows + stride_kv)[:, None] + d[None, :], mask=d_mask, other=0.0)
        m, total, acc = softmax_step(q, k, v, None, m, total, acc, scale_log2, UPCAST, PRECISION, False)
    last = past + tl.minimum(tile_start + BLOCK_M, q_len)  # one past the tile's last position
    for first in range(unmasked_end, last, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        valid = pos < last
        offs = kv_offsets(table_row, pos, valid, stride_block, stride_slot, BLOCK_SIZE)
        kv_mask = valid[:, None] & d_mask
        rows = k_base + offs
        k = tl.load(rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load((rows + stride_kv)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        keep = pos[None, :] <= q_pos[:, None]
        m, total, acc = softmax_step(q, k, v, keep, m, total, acc, scale_log2, UPCAST, PRECISION, True)

    out_rows = (q_start + token) * stride_ot + (kv_head * GROUP + g) * stride_oh
    out = acc / total[:, None]
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    batch: ExtendBatch,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the batch's new tokens (rows of q [T, Hq, D]) over their sequences'
    cached keys of `layer`, written to the same rows of `out` (other rows untouched)."""
    _, layers, _, block_size, kv_heads, head_dim = kv_cache.shape
    heads = q.shape[1]
    if q.stride(-1) != 1 or q.shape[-1] != head_dim or heads % kv_heads or not 0 <= layer < layers:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(kv_cache.shape)} at layer {layer}")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q is {q.dtype}, the cache {kv_cache.dtype}")
    group = heads // kv_heads
    if batch.block_m != block_m(group):
        raise ValueError(f"the batch was built for another GQA group than {group}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    tiles = batch.tile_seqs.numel()
    if tiles == 0:
        return out
    st = CacheStrides.of(kv_cache)
    _prefill_kernel[(tiles, kv_heads)](
        q,
        out,
        kv_cache,
        batch.q_starts,
        batch.q_lens,
        batch.context_lens,
        batch.block_tables,
        batch.tile_seqs,
        batch.tile_starts,
        layer,
        scale * LOG2E,
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
        BLOCK_G=next_pow2(group),
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_M=batch.block_m,
        BLOCK_N=BLOCK_N,
        UPCAST=upcast(q.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def paged_prefill_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    q_starts: Sequence[int],
    q_lens: Sequence[int],
    contexts: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    scale: float,
) -> torch.Tensor:
    """What `paged_prefill` computes, one sequence at a time in fp32: [sum(q_lens), Hq, D] in
    the order of the sequences."""
    outs = []
    for start, n, context, ids in zip(q_starts, q_lens, contexts, block_ids, strict=True):
        k, v = gather_context(kv_cache, layer, ids, context)
        outs.append(attention_reference(q[start : start + n], k, v, scale))
    return torch.cat(outs)
