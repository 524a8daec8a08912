"""SwiGLU's activation, silu(gate) * up, from the fused gate/up projection's output in one launch
(op by op: a slice, silu, multiply).

`x` is [..., 2 * I]: the gate in the first I columns, up in the last I. silu rounds to the input
dtype before the product, as torch's two ops in the model's `silu_and_mul` do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer.kernels.common import as_rows, cdiv, next_pow2

MAX_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inner + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I]; a new tensor [..., I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"expected gate and up halves, got a last dimension of {x.shape[-1]}")
    inner = x.shape[-1] // 2
    rows = as_rows(x)
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(next_pow2(inner), MAX_BLOCK)
        _silu_mul_kernel[(rows.shape[0], cdiv(inner, block))](
            rows, out, rows.stride(0), inner, BLOCK=block, num_warps=4
        )
    return out
