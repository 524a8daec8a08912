"""Paged attention over the block-first KV cache: the torch reference backend (CPU and CUDA).

Cache layout: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]. One block across all
layers is one contiguous region, so moving a block between tiers is one copy.
The backend implements the model's `Attention` protocol for one step: it writes the step's K/V
into the cache slots, then attends each query to its sequence's cached keys. Decode rows (one
query token) are batched into one masked attention; prefill chunks run one sequence at a time.
The Triton kernels replace this on GPUs; it stays the reference they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> torch.Tensor:
    shape = (num_blocks, num_layers, 2, block_size, kv_heads, head_dim)
    if pin_memory:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class AttentionMetadata:
    """Per-step tensors describing where each token's K/V goes and what each query sees."""

    slot_blocks: torch.Tensor  # [T] block id of each new token's slot
    slot_offsets: torch.Tensor  # [T] offset inside that block
    decode_rows: torch.Tensor  # [B] token rows of the one-token sequences
    decode_tables: torch.Tensor  # [B, max_blocks] their block tables, padded with 0
    decode_context: torch.Tensor  # [B] their context lengths
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (row start, query len, context len, blocks)


class PagedAttention:
    """The `Attention` callable the model runs for one step."""

    def __init__(self, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        num_blocks, self.num_layers, _, self.block_size, kv_heads, head_dim = kv_cache.shape
        self.meta = meta
        self.scale = scale
        # Flat views: token slots [blocks * layers * 2 * block_size, H, D] for writing new K/V with
        # one index_copy_, and the K and V halves of each (block, layer) row, gathered with one
        # index_select each straight into [B, S, H, D] order.
        self.slots = kv_cache.view(-1, kv_heads, head_dim)
        rows = kv_cache.view(num_blocks * self.num_layers, 2, self.block_size * kv_heads * head_dim)
        self.k_rows, self.v_rows = rows[:, 0], rows[:, 1]
        self.head_shape = (kv_heads, head_dim)
        self.slot_index = meta.slot_blocks * (self.num_layers * 2 * self.block_size) + meta.slot_offsets

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        k_slots = self.slot_index + layer * 2 * self.block_size
        self.slots.index_copy_(0, k_slots, k.to(self.slots.dtype))
        self.slots.index_copy_(0, k_slots + self.block_size, v.to(self.slots.dtype))

        out = torch.empty_like(q)
        if m.decode_rows.numel():
            keys, values = self._gather(layer, m.decode_tables)
            visible = torch.arange(keys.shape[2], device=q.device)[None, :] < m.decode_context[:, None]
            out[m.decode_rows] = self._attend(q[m.decode_rows, :, None], keys, values, visible[:, None, None])[:, :, 0]
        for start, q_len, ctx, blocks in m.prefills:
            keys, values = self._gather(layer, blocks[None])
            # Query i sits at position ctx - q_len + i and sees keys 0..that position.
            rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
            visible = torch.arange(keys.shape[2], device=q.device)[None, :] <= rows
            rows_q = q[start : start + q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
            out[start : start + q_len] = self._attend(rows_q, keys, values, visible)[0].transpose(0, 1)
        return out

    def _gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv_heads, S, head_dim] of padded block tables [B, max_blocks]: one gather."""
        b, width = tables.shape
        index = (tables * self.num_layers + layer).flatten()
        shape = (b, width * self.block_size, *self.head_shape)
        keys = self.k_rows.index_select(0, index).view(shape).transpose(1, 2)
        values = self.v_rows.index_select(0, index).view(shape).transpose(1, 2)
        return keys, values

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, L, D] over keys/values [B, Hk, S, D]; `visible` masks keys (True = attend)."""
        return F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=visible, scale=self.scale, enable_gqa=True
        )
