"""The step's new K and V of one layer into their cache slots.

`slots[t]` is token t's slot, block_id * block_size + offset (negative: not written). In the
block-first cache one token's K (or V) of one layer is `kv_heads * head_dim` contiguous elements,
so a program copies BLOCK_T tokens x BLOCK_HD of those elements, for K and V at once.
`kv_write_reference` is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer.kernels.common import CacheStrides, cdiv, next_pow2

# 4 tokens x 512 elements a program: 64 registers on sm_90 (16 x 1024 took a 3 KiB stack).
BLOCK_T = 4
MAX_BLOCK_HD = 512


@triton.jit(do_not_specialize=["num_tokens", "layer"])
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slots_ptr,
    num_tokens,
    layer,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_block,
    stride_layer,
    stride_kv,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slots_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    i = tl.program_id(1) * BLOCK_HD + tl.arange(0, BLOCK_HD)
    head, d = i // HEAD_DIM, i % HEAD_DIM
    mask = (slot >= 0)[:, None] & (i < HD)[None, :]
    block = tl.where(slot >= 0, slot, 0) // BLOCK_SIZE
    dst = block * stride_block + (slot % BLOCK_SIZE) * stride_slot + layer * stride_layer
    dst = dst[:, None] + (head * stride_head + d)[None, :]
    k = tl.load(k_ptr + t[:, None] * stride_kt + (head * stride_kh + d)[None, :], mask=mask)
    v = tl.load(v_ptr + t[:, None] * stride_vt + (head * stride_vh + d)[None, :], mask=mask)
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_kv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def kv_write(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] (any row and head strides) into `layer` at `slots` [T]."""
    _, layers, _, block_size, kv_heads, head_dim = kv_cache.shape
    if k.shape != v.shape or k.shape[1:] != (kv_heads, head_dim) or not 0 <= layer < layers:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the cache {tuple(kv_cache.shape)}")
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    num_tokens, hd = k.shape[0], kv_heads * head_dim
    if num_tokens == 0:
        return
    block_hd = min(next_pow2(hd), MAX_BLOCK_HD)
    st = CacheStrides.of(kv_cache)
    _kv_write_kernel[(cdiv(num_tokens, BLOCK_T), cdiv(hd, block_hd))](
        k,
        v,
        kv_cache,
        slots,
        num_tokens,
        layer,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        st.block,
        st.layer,
        st.kv,
        st.slot,
        st.head,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HD=hd,
        BLOCK_T=BLOCK_T,
        BLOCK_HD=block_hd,
        num_warps=4,
    )


def kv_write_reference(
    kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """What `kv_write` does, with index_put_ on the cache's [blocks, block_size] slots."""
    block_size = kv_cache.shape[3]
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    kv_cache[blocks, layer, 0, offsets] = k[keep].to(kv_cache.dtype)
    kv_cache[blocks, layer, 1, offsets] = v[keep].to(kv_cache.dtype)
