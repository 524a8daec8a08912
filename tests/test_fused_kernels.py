"""The fused RMSNorm, SwiGLU activation and RoPE kernels against the model's own op-by-op
functions, and the model on them. Without CUDA they run in Triton's interpreter (set before any
kernel module is imported)."""

# ruff: noqa: E402 (TRITON_INTERPRET must be set before the kernel modules are imported)
from __future__ import annotations

import os

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

from superinfer.engine.model import load_model
from superinfer.engine.model.config import ModelConfig
from superinfer.engine.model.decoder import FusedKernels, RMSNorm, RotaryEmbedding, apply_rope, silu_and_mul
from superinfer.engine.model.tiny import tiny_config_dict
from superinfer.kernels.rms_norm import add_rms_norm, rms_norm
from superinfer.kernels.rope import rope
from superinfer.kernels.silu_mul import silu_mul
from tests.hf_fixtures import causal_logits

DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # about one rounding of each


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 256), (3, 96), (0, 64), (2, 3, 128)])
def test_rms_norm_matches_the_model(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    norm = RMSNorm(shape[-1], 1e-5, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + _randn(shape[-1], seed=1) / 4)
        x = _randn(*shape, seed=2, scale=3).to(DEVICE, dtype)
        got = rms_norm(x, norm.weight, norm.eps)
        assert got.shape == x.shape and got.dtype == dtype
        _close(got, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_the_model(dtype: torch.dtype) -> None:
    """The residual stream's add folded into the norm: the sum and the normed sum."""
    norm = RMSNorm(200, 1e-5, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + _randn(200, seed=4) / 4)
        x, residual = (_randn(7, 200, seed=s, scale=3).to(DEVICE, dtype) for s in (5, 6))
        got, total = add_rms_norm(x, residual, norm.weight, norm.eps)
        want, want_total = norm.add(x, residual)
    assert torch.equal(total, want_total)
    _close(got, want)
    with pytest.raises(ValueError, match="do not fit"):
        add_rms_norm(x, residual[:, :100], norm.weight, norm.eps)


def test_rms_norm_of_strided_heads() -> None:
    """Qwen3's q/k norm: a slice of the heads of a [T, heads, head_dim] view, rows not one stride."""
    norm = RMSNorm(64, 1e-6, device=DEVICE)
    part = _randn(4, 6, 64, seed=3).to(DEVICE)[:, 1:4]
    with torch.no_grad():
        _close(rms_norm(part, norm.weight, norm.eps), norm(part))
    with pytest.raises(ValueError, match="do not fit"):
        rms_norm(part, norm.weight[:32], 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [8, 344, 1500])  # 1500: two column programs of 1024
def test_silu_mul_matches_the_model(dtype: torch.dtype, inner: int) -> None:
    x = _randn(3, 2 * inner + 8, seed=inner, scale=4).to(DEVICE, dtype)[:, 4 : 4 + 2 * inner]  # strided rows
    got = silu_mul(x)
    assert got.shape == (3, inner) and got.dtype == dtype
    _close(got, silu_and_mul(x))
    with pytest.raises(ValueError, match="halves"):
        silu_mul(x[:, 1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim", [(6, 64), (13, 128), (3, 80)])
def test_rope_matches_the_model(dtype: torch.dtype, heads: int, head_dim: int) -> None:
    """q and k heads inside the fused qkv output (rows strided past the v columns), at scattered
    positions; in the interpreter the same bits as the op-by-op rotation."""
    config = ModelConfig.from_dict(tiny_config_dict() | {"head_dim": head_dim})
    cos, sin = RotaryEmbedding(config, device=DEVICE)(torch.tensor([0, 7, 300, 4095, 12], device=DEVICE), dtype)
    qkv = _randn(5, heads + 2, head_dim, seed=heads, scale=2).to(DEVICE, dtype)
    qk = qkv[:, :heads]
    got = rope(qk, cos, sin)
    assert got.shape == qk.shape and got.is_contiguous()
    if GPU:  # compiled, the roundings between the products and the sum may fold (one rounding fewer)
        _close(got, apply_rope(qk, cos, sin))
    else:  # the interpreter rounds where torch does
        assert torch.equal(got, apply_rope(qk, cos, sin))
    with pytest.raises(ValueError, match="do not fit"):
        rope(qk, cos.float() if dtype != torch.float32 else cos.half(), sin)


def test_the_model_on_the_kernels_gives_its_logits() -> None:
    model = load_model("tiny", device=DEVICE, dtype="float32").model
    ids = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    expected = causal_logits(model, ids)
    kernels = FusedKernels(rms_norm, add_rms_norm, silu_mul, rope)
    model.use_kernels(kernels)
    layer = model.model.layers[0]
    assert model.model.norm.kernels is kernels and layer.mlp.act is silu_mul and layer.self_attn.rope is rope
    torch.testing.assert_close(causal_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
