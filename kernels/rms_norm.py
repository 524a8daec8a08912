"""RMSNorm of each row in one launch (op by op it is eight: widen, square, mean, add, rsqrt,
multiply, narrow, scale).

The roundings are the Hugging Face order, so bf16 results match the reference: normalize in fp32,
round to the input dtype, then multiply by the weight and round again, as the model's `RMSNorm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer.kernels.common import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x, eps, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] normalized over its last dimension and scaled by weight [D]; a new tensor."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit rows of {d}")
    rows = x.reshape(-1, d)  # a view where the rows have one stride, else a copy
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = next_pow2(d)
        num_warps = min(16, max(1, block // 256))
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), eps, D=d, BLOCK=block, num_warps=num_warps
        )
    return out
