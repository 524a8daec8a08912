"""The fused RMSNorm and SwiGLU activation kernels against their torch references, and the model on
them. Without CUDA they run in Triton's interpreter (set before any kernel module is imported)."""

# ruff: noqa: E402 (TRITON_INTERPRET must be set before the kernel modules are imported)
from __future__ import annotations

import os

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
from torch.nn import functional as F

pytest.importorskip("triton")

from superinfer.engine.model import load_model
from superinfer.kernels.rms_norm import rms_norm, rms_norm_reference
from superinfer.kernels.silu_mul import silu_mul, silu_mul_reference

DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # about one rounding of each


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 256), (3, 96), (0, 64), (2, 3, 128)])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (3 * torch.randn(shape, generator=g)).to(DEVICE, dtype)
    weight = (1 + torch.randn(shape[-1], generator=g) / 4).to(DEVICE, dtype)
    got = rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    _close(got, rms_norm_reference(x, weight, 1e-5))


def test_rms_norm_of_strided_heads() -> None:
    """Qwen3's q/k norm: a slice of the heads of a [T, heads, head_dim] view, rows not one stride."""
    qk = torch.randn(4, 6, 64, device=DEVICE)
    weight = torch.rand(64, device=DEVICE) + 0.5
    part = qk[:, 1:4]
    _close(rms_norm(part, weight, 1e-6), rms_norm_reference(part, weight, 1e-6))
    with pytest.raises(ValueError, match="does not fit"):
        rms_norm(part, weight[:32], 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [8, 344, 1500])  # 1500: two column programs of 1024
def test_silu_mul_matches_the_reference(dtype: torch.dtype, inner: int) -> None:
    g = torch.Generator().manual_seed(inner)
    x = (4 * torch.randn(3, 2 * inner + 8, generator=g)).to(DEVICE, dtype)[:, 4 : 4 + 2 * inner]  # strided rows
    got = silu_mul(x)
    assert got.shape == (3, inner) and got.dtype == dtype
    _close(got, silu_mul_reference(x))
    with pytest.raises(ValueError, match="halves"):
        silu_mul(x[:, 1:])


def _causal_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)

    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids), device=ids.device), attend))


def test_the_model_on_the_kernels_gives_its_logits() -> None:
    model = load_model("tiny", device=DEVICE, dtype="float32").model
    ids = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    expected = _causal_logits(model, ids)
    model.use_kernels(rms_norm, silu_mul)
    assert model.model.norm.kernel is rms_norm and model.model.layers[0].mlp.act is silu_mul
    torch.testing.assert_close(_causal_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
