"""RMSNorm of each row in one launch (op by op it is eight: widen, square, mean, add, rsqrt,
multiply, narrow, scale), optionally after adding the residual stream (one more op folded in).

The roundings are the Hugging Face order, so bf16 results match the reference: the residual sum
rounds to the input dtype, then normalize in fp32, round to the input dtype, then multiply by the
weight and round again, as the model's `RMSNorm` and `RMSNorm.add`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer.kernels.common import as_rows, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x = (x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + row * D + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * rstd).to(dt).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (w * normed).to(dt), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    total: torch.Tensor,
) -> None:
    d = x.shape[-1]
    if weight.shape != (d,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)}, residual and weight {tuple(weight.shape)} do not fit")
    rows = as_rows(x)
    if not rows.shape[0]:
        return
    res = as_rows(residual) if residual is not None else rows
    block = next_pow2(d)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        res,
        weight,
        out,
        total,
        rows.stride(0),
        res.stride(0),
        eps,
        D=d,
        BLOCK=block,
        ADD=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] normalized over its last dimension and scaled by weight [D]; a new tensor."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, out)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), new tensors."""
    out, total = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2))
    _launch(x, residual, weight, eps, out, total)
    return out, total
