"""Rotate-half RoPE of every head of every token in one launch (op by op: two products, a
concatenation of the halves and a sum).

`cos` and `sin` are RotaryEmbedding's tables for the step's positions, [T, 1, D] in the input's
dtype: cos = (cos, cos) and sin = (-sin, sin) over the two halves, so out = x * cos + swap(x) * sin
with swap(x) the halves exchanged. Each product and the sum round to the input dtype, as torch's
ops do: through Triton's interpreter the results are the model's `apply_rope` bits; compiled for
CUDA a few elements differ in the last place (an H100 run, all dtypes: the compiler may fold a
rounding or fuse a multiply and add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer.kernels.common import cdiv, next_pow2

BLOCK_H = 8


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h < heads)[:, None] & (d < HALF)[None, :]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    table = t * stride_ct + d
    cos1 = tl.load(cos_ptr + table, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + table + HALF, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + table, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + table + HALF, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    out1 = ((x1 * cos1).to(dt).to(tl.float32) + (x2 * sin1).to(dt).to(tl.float32)).to(dt)
    out2 = ((x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)).to(dt)
    dst = out_ptr + (t * heads + h[:, None]) * (2 * HALF) + d[None, :]
    tl.store(dst, out1, mask=mask)
    tl.store(dst + HALF, out2, mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (any token and head strides) rotated by cos, sin [T, 1, D]; a new
    contiguous tensor."""
    t, heads, d = x.shape
    if d % 2 or cos.shape != (t, 1, d) or sin.shape != cos.shape or cos.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and tables {tuple(cos.shape)} {cos.dtype} do not fit")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t and heads:
        _rope_kernel[(t, cdiv(heads, BLOCK_H))](
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            heads,
            HALF=d // 2,
            BLOCK_H=BLOCK_H,
            BLOCK_HALF=next_pow2(d // 2),
            num_warps=4,
        )
    return out
