"""Decoder-only transformer for Llama 3.x, Qwen2/2.5, Qwen3, Mixtral and Qwen3-MoE on a
flattened token batch.

The model owns no KV cache and computes no attention: each layer hands its post-norm, post-RoPE
q/k/v to an injected `Attention` callable (the paged-KV backend in the engine, a dense causal one
in tests). q/k/v and gate/up are fused into one Linear each (one matmul instead of three or two),
and a mixture-of-experts layer stacks its experts (moe.py); `checkpoint_tensors` names every
weight as Hugging Face does, the fused and stacked ones as slices, so safetensors names still map
one to one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .moe import SparseMoE

Device = torch.device | str | None


class Attention(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""
        ...


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """Inverse RoPE frequencies [head_dim // 2], float32 on CPU, as transformers computes them."""
    dims = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")  # never meta, even at build
    inv_freq = 1.0 / (theta ** (dims / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _llama3_scale(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim // 2], always float32, looked up by position."""

    cos_cached: Tensor
    sin_cached: Tensor

    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.max_positions = cfg.max_position_embeddings
        # A plain attribute, not a buffer: module dtype casts must not touch it.
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos_cached", torch.empty(0, device=device), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0, device=device), persistent=False)
        self._build(self.cos_cached.device)

    def _build(self, device: torch.device) -> None:
        if device.type == "meta":  # shapes only (meta arange would import torch._dynamo: seconds)
            shape = (self.max_positions, self.inv_freq.numel())
            self.cos_cached = torch.empty(shape, device=device)
            self.sin_cached = torch.empty(shape, device=device)
            return
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = t[:, None] * self.inv_freq.to(device)[None, :]
        self.cos_cached, self.sin_cached = freqs.cos(), freqs.sin()

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        # .to(bfloat16), .half() or to_empty() would cast or blank the tables: rebuild them in
        # float32 on whatever device they now live on.
        super()._apply(fn, recurse)
        self._build(self.cos_cached.device)
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, head_dim // 2] in `dtype` for broadcasting over heads."""
        cos = self.cos_cached.index_select(0, positions).to(dtype)
        sin = self.sin_cached.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on x [T, heads, head_dim] (the Llama/HF pairing of dims i and i + d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32, round to the input dtype, then scale: the HF order, so bf16 matches.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class FusedLinear(nn.Linear):
    """Several Linear layers over the same input as one: their weights stacked row-wise, in order."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, **factory: Any) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias, **factory)
        self.parts = parts  # checkpoint name of each part -> its output features

    def checkpoint_tensors(self, prefix: str) -> Iterator[tuple[str, Tensor]]:
        """(name, row slice) of each part's weight, then bias: views that share this layer's
        storage; `prefix` is the parent module's, e.g. "model.layers.0.self_attn."."""
        for kind, tensor in self.named_parameters():
            start = 0
            for name, size in self.parts.items():
                yield f"{prefix}{name}.{kind}", tensor[start : start + size]
                start += size


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        parts = dict(zip(("q_proj", "k_proj", "v_proj"), self.sizes, strict=True))
        self.qkv_proj = FusedLinear(h, parts, bias=bias, **factory)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=cfg.o_proj_bias, **factory)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory) if cfg.qk_norm else None

    def forward(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, attn: Attention) -> Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn(layer, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, **factory: Any) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj = FusedLinear(h, {"gate_proj": i, "up_proj": i}, bias=bias, **factory)
        self.down_proj = nn.Linear(i, h, bias=bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, **factory: Any) -> None:
        super().__init__()
        self.index = index
        self.self_attn = SelfAttention(cfg, **factory)
        self.mlp = SparseMoE(cfg, **factory) if cfg.is_moe_layer(index) else MLP(cfg, **factory)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn: Attention) -> Tensor:
        h = h + self.self_attn(self.index, self.input_layernorm(h), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """The `model.` prefix of the HF checkpoint names."""

    def __init__(self, cfg: ModelConfig, **factory: Any) -> None:
        super().__init__()
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size, **factory)
        if weight.device.type != "meta":  # normal_ on meta imports torch._dynamo: seconds for nothing
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, **factory) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        """Parameters get PyTorch's default init; use device="meta" and fill them (see loader)."""
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.config = cfg
        self.attn_scale = cfg.head_dim**-0.5
        self.model = Backbone(cfg, **factory)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **factory)
        self.rotary = RotaryEmbedding(cfg, device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the embeddings when the config ties them (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every weight under its Hugging Face checkpoint name, in parameter order (a tied lm_head
        once, as the embedding); fused and stacked weights as views of their slices, so writing
        one fills the model."""
        return _checkpoint_tensors(self, "", set())

    def forward(self, input_ids: Tensor, positions: Tensor, attn: Attention) -> Tensor:
        """input_ids, positions: [T] (many sequences flattened) -> final-norm hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, attn)
        return self.model.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


def _checkpoint_tensors(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, Tensor]]:
    for name, p in module.named_parameters(recurse=False):
        if id(p) not in seen:  # a tied lm_head is the embedding, already named
            seen.add(id(p))
            yield prefix + name, p
    for name, child in module.named_children():
        if isinstance(child, (FusedLinear, SparseMoE)):  # these name their own checkpoint tensors
            yield from child.checkpoint_tensors(prefix)
        else:
            yield from _checkpoint_tensors(child, f"{prefix}{name}.", seen)


@torch.no_grad()
def init_random_weights(model: DecoderLM, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic dummy weights in place, on the parameters' own device and dtype.

    Each checkpoint tensor is drawn on its own, in checkpoint order, so fusing layers changes no value.
    Matrices and embeddings ~ N(0, std), norm weights 1, biases 0. Meta tensors are left alone.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.checkpoint_tensors():
        if p.device.type == "meta":
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            if p.device not in generators:
                generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.normal_(0.0, std, generator=generators[p.device])
