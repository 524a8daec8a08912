"""Paged attention over the block-first KV cache: the torch reference backend (CPU and CUDA).

Cache layout: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]. One block across all
layers is one contiguous region, so moving a block between tiers is one copy.
The backend implements the model's `Attention` protocol for one step: it writes the step's K/V
into the cache slots, then attends each query to its sequence's cached keys. Decode rows (one
query token) are batched into one masked attention; prefill chunks run one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def allocate_kv_cache(
    num_blocks: int, num_layers: int, block_size: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device | str, pin_memory: bool = False,
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
        self.kv_cache = kv_cache
        self.meta = meta
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        k_cache = self.kv_cache[:, layer, 0]  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache = self.kv_cache[:, layer, 1]
        k_cache[m.slot_blocks, m.slot_offsets] = k.to(k_cache.dtype)
        v_cache[m.slot_blocks, m.slot_offsets] = v.to(v_cache.dtype)

        out = torch.empty_like(q)
        if m.decode_rows.numel():
            out[m.decode_rows] = self._decode(q[m.decode_rows], k_cache, v_cache)
        for start, q_len, ctx, blocks in m.prefills:
            out[start : start + q_len] = self._prefill(q[start : start + q_len], k_cache, v_cache, ctx, blocks)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        m = self.meta
        b, hq, d = q.shape
        hk = k_cache.shape[2]
        keys = k_cache[m.decode_tables].flatten(1, 2)  # [B, S, Hk, D]
        values = v_cache[m.decode_tables].flatten(1, 2)
        qg = q.view(b, hk, hq // hk, d).float()
        scores = torch.einsum("bhgd,bshd->bhgs", qg, keys.float()) * self.scale
        pos = torch.arange(keys.shape[1], device=q.device)
        invalid = pos[None, :] >= m.decode_context[:, None]  # [B, S]
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bhgs,bshd->bhgd", probs, values.float())
        return out.reshape(b, hq, d).to(q.dtype)

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: int, blocks: torch.Tensor,
    ) -> torch.Tensor:
        q_len, hq, _ = q.shape
        hk = k_cache.shape[2]
        keys = k_cache[blocks].flatten(0, 1)[:ctx]  # [S, Hk, D]
        values = v_cache[blocks].flatten(0, 1)[:ctx]
        group = hq // hk
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        # Query i sits at position ctx - q_len + i and sees keys 0..that position.
        rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=self.scale
        )
        return out.transpose(0, 1)
