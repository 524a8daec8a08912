"""Decoder-only transformer for Llama 3.x, Qwen2/2.5, Qwen3, Mixtral and Qwen3-MoE on a
flattened token batch.

The model owns no KV cache and computes no attention: each layer hands its post-norm, post-RoPE
q/k/v to an injected `Attention` callable (the paged-KV backend in the engine, a dense causal one
in tests). q/k/v and gate/up are fused into one Linear each (one matmul instead of three or two),
and a mixture-of-experts layer stacks its experts (moe.py); `checkpoint_tensors` names every
weight as Hugging Face does, the fused and stacked ones as slices, so safetensors names still map
one to one. With tensor parallelism (sharding.py) each rank builds only its part of every layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import ModelConfig
from .moe import SparseMoE
from .packed_linear import Linear
from .sharding import CheckpointTensor, Shard, TensorParallel, held

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
    """cos/sin tables [max_positions, head_dim], always float32, looked up by position, laid out
    for `apply_rope`: cos repeated over both halves of the head, sin negated on the first."""

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
            shape = (self.max_positions, 2 * self.inv_freq.numel())
            self.cos_cached = torch.empty(shape, device=device)
            self.sin_cached = torch.empty(shape, device=device)
            return
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = t[:, None] * self.inv_freq.to(device)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        self.cos_cached, self.sin_cached = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        # .to(bfloat16), .half() or to_empty() would cast or blank the tables: rebuild them in
        # float32 on whatever device they now live on.
        super()._apply(fn, recurse)
        self._build(self.cos_cached.device)
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, head_dim] in `dtype` for broadcasting over heads."""
        cos = self.cos_cached.index_select(0, positions).to(dtype)
        sin = self.sin_cached.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on x [T, heads, head_dim] (the Llama/HF pairing of dims i and i + d/2),
    with RotaryEmbedding's tables: x1 cos - x2 sin and x2 cos + x1 sin, as x * cos + swap(x) * sin
    (four ops instead of eight; the same roundings, so the same bits)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class FusedKernels:
    """One-launch versions of the model's small ops, with their roundings (`DecoderLM.use_kernels`):
    rms_norm(x, weight, eps), add_rms_norm(x, residual, weight, eps) -> (normed, sum),
    silu_mul(gate_up), rope(x, cos, sin)."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    silu_mul: Callable[[Tensor], Tensor]
    rope: Callable[[Tensor, Tensor, Tensor], Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps
        self.kernels: FusedKernels | None = None

    def add(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(this norm of residual + x, residual + x): the residual stream's add and the next norm."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # the same bits, fewer calls
        # Normalise in float32, round to the input dtype, then scale: the HF order, so bf16 matches.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class FusedLinear(Linear):
    """Several Linear layers over the same input as one: their weights stacked row-wise, in order.
    Column-parallel: each part holds its shard's output features (all of them on one device)."""

    def __init__(self, in_features: int, parts: dict[str, Shard], bias: bool, **factory: Any) -> None:
        super().__init__(in_features, sum(p.length for p in parts.values()), bias=bias, **factory)
        self.parts = parts  # checkpoint name of each part -> its output features held here

    def checkpoint_tensors(self, prefix: str) -> Iterator[CheckpointTensor]:
        """Each part's weight, then bias, as a row slice that shares this layer's storage; `prefix`
        is the parent module's, e.g. "model.layers.0.self_attn."."""
        for kind, tensor in self.named_parameters():
            start = 0
            for name, part in self.parts.items():
                yield held(f"{prefix}{name}.{kind}", tensor[start : start + part.length], part)
                start += part.length


class RowParallelLinear(Linear):
    """A Linear whose input features are split over the ranks (`part` of them here): the partial
    products are summed over the ranks, then the bias is added once."""

    def __init__(self, part: Shard, out_features: int, bias: bool, tp: TensorParallel, **factory: Any) -> None:
        super().__init__(part.length, out_features, bias=bias, **factory)
        self.tp = tp
        self.shards = {"weight": part.along(1)}

    def forward(self, x: Tensor) -> Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Embedding):
    """The embedding rows of this rank's slice of the vocabulary; other tokens embed as zeros here
    and are summed in from the rank that holds them."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, **factory: Any) -> None:
        part, rows = tp.vocab(vocab_size)
        weight = torch.empty(rows, hidden_size, **factory)
        if weight.device.type != "meta":  # normal_ on meta imports torch._dynamo: seconds for nothing
            nn.init.normal_(weight)
        super().__init__(rows, hidden_size, _weight=weight)
        self.tp, self.part = tp, part
        self.shards = {"weight": part}

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.part.start
        elsewhere = (local < 0) | (local >= self.part.length)
        h = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(elsewhere[:, None], 0))


class LMHead(Linear):
    """The output projection of this rank's slice of the vocabulary; rank 0 gathers the logits."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel, **factory: Any) -> None:
        part, rows = tp.vocab(vocab_size)
        super().__init__(hidden_size, rows, bias=False, **factory)
        self.tp, self.vocab_size = tp, vocab_size
        self.shards = {"weight": part}

    def logits(self, hidden: Tensor) -> Tensor | None:
        """float32 logits [N, vocab] on rank 0, None on the other ranks."""
        local = self.matmul(hidden).float()
        if self.tp.size == 1:
            return local
        full = self.tp.gather_first(local)
        return None if full is None else full[:, : self.vocab_size]


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, **factory: Any) -> None:
        super().__init__()
        heads, kv_heads, d = tp.split(cfg.num_heads), tp.kv_heads(cfg.num_kv_heads), cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads.length, kv_heads.length, d
        q, kv = heads.times(d), kv_heads.times(d)
        self.qk_width = q.length + kv.length  # qkv's columns: q, then k, then v
        parts = {"q_proj": q, "k_proj": kv, "v_proj": kv}
        self.qkv_proj = FusedLinear(cfg.hidden_size, parts, bias=cfg.attention_bias, **factory)
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, cfg.o_proj_bias, tp, **factory)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory) if cfg.qk_norm else None
        self.rope: Callable[[Tensor, Tensor, Tensor], Tensor] = apply_rope  # or FusedKernels.rope

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What attention takes: q [T, heads, head_dim], k and v [T, kv_heads, head_dim]."""
        t, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.qk_width].view(t, heads + kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        q, k = self.rope(qk, cos, sin).split((heads, kv_heads), dim=1)  # one rotation for both
        return q, k, qkv[:, self.qk_width :].view(t, kv_heads, self.head_dim)

    def output(self, out: Tensor) -> Tensor:
        """Attention's output [T, heads, head_dim] projected back to the hidden size."""
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


def silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, **factory: Any) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, tp.split(cfg.intermediate_size), cfg.mlp_bias
        self.gate_up_proj = FusedLinear(h, {"gate_proj": i, "up_proj": i}, bias=bias, **factory)
        self.down_proj = RowParallelLinear(i, h, bias, tp, **factory)
        self.act: Callable[[Tensor], Tensor] = silu_and_mul  # or FusedKernels.silu_mul

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel, **factory: Any) -> None:
        super().__init__()
        self.index = index
        self.self_attn = SelfAttention(cfg, tp, **factory)
        self.mlp = SparseMoE(cfg, tp, **factory) if cfg.is_moe_layer(index) else MLP(cfg, tp, **factory)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)

    def forward(
        self, h: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, attn: Attention
    ) -> tuple[Tensor, Tensor]:
        """(this layer's MLP output, the residual stream before it): the stream is the sum of the
        embedding and every attention and MLP output so far; each add is folded into the norm
        that reads it (`RMSNorm.add`). The first layer gets h = the embedding, residual None."""
        q, k, v, residual = self.attention_inputs(h, residual, cos, sin)
        return self.after_attention(attn(self.index, q, k, v), residual)

    def attention_inputs(
        self, h: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer up to its attention: q, k, v and the residual stream (forward's first half)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add(h, residual)
        return *self.self_attn.qkv(x, cos, sin), residual

    def after_attention(self, out: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The layer from its attention's output on (forward's second half)."""
        x, residual = self.post_attention_layernorm.add(self.self_attn.output(out), residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    """The `model.` prefix of the HF checkpoint names."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp, **factory)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, **factory) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)


class DecoderLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        device: Device = None,
        dtype: torch.dtype | None = None,
        tp: TensorParallel = TensorParallel(),  # noqa: B008 - frozen
    ) -> None:
        """Parameters get PyTorch's default init; use device="meta" and fill them (see loader).
        `tp`: build only this rank's part of every layer (see sharding.py)."""
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.config = cfg
        self.tp = tp
        self.attn_scale = cfg.head_dim**-0.5
        self.model = Backbone(cfg, tp, **factory)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, tp, **factory)
        self.rotary = RotaryEmbedding(cfg, device=device)
        self.tie_weights()

    def use_kernels(self, kernels: FusedKernels) -> None:
        """Fused kernels for every RMSNorm (with the residual add before it), dense MLP activation
        and RoPE (the runner passes the Triton ones on CUDA): one launch each where op by op they
        take eight or nine, three and four, which on a GPU costs host time op by op and a gap per
        kernel inside a CUDA graph."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernels = kernels
            elif isinstance(module, MLP):
                module.act = kernels.silu_mul
            elif isinstance(module, SelfAttention):
                module.rope = kernels.rope

    def tie_weights(self) -> None:
        """Share lm_head with the embeddings when the config ties them (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every weight under its Hugging Face checkpoint name, in parameter order (a tied lm_head
        once, as the embedding); fused and stacked weights as views of their slices, so writing
        one fills the model. With tensor parallelism: this rank's parts, see `sharded_tensors`."""
        return ((t.name, t.view) for t in self.sharded_tensors() if t.view is not None)

    def sharded_tensors(self) -> Iterator[CheckpointTensor]:
        """Every checkpoint tensor in checkpoint order with the part of it this rank holds (all of
        it on one device)."""
        return _checkpoint_tensors(self, "", set())

    def forward(self, input_ids: Tensor, positions: Tensor, attn: Attention) -> Tensor:
        """input_ids, positions: [T] (many sequences flattened) -> final-norm hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin, attn)
        return self.model.norm(h) if residual is None else self.model.norm.add(h, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """hidden [N, hidden] -> float32 logits [N, vocab]; with tensor parallelism every rank
        calls it and rank 0 gets the logits, the others None."""
        return self.lm_head.logits(hidden)


def _checkpoint_tensors(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[CheckpointTensor]:
    shards: dict[str, Shard] = getattr(module, "shards", {})
    for name, p in module.named_parameters(recurse=False):
        if id(p) not in seen:  # a tied lm_head is the embedding, already named
            seen.add(id(p))
            yield held(prefix + name, p, shards.get(name))
    for name, child in module.named_children():
        if isinstance(child, (FusedLinear, SparseMoE)):  # these name their own checkpoint tensors
            yield from child.checkpoint_tensors(prefix)
        else:
            yield from _checkpoint_tensors(child, f"{prefix}{name}.", seen)


@torch.no_grad()
def init_random_weights(model: DecoderLM, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic dummy weights in place, on the parameters' own device and dtype.

    Each checkpoint tensor is drawn on its own, in checkpoint order, so fusing layers changes no value.
    Matrices and embeddings ~ N(0, std), norm weights 1, biases 0. Meta tensors are left alone. A
    tensor split over ranks is drawn whole and sliced, and one another rank holds is drawn too (it
    moves the generator on), so every rank holds its part of the one-device model's weights.
    """
    some = next(model.parameters())
    if some.device.type == "meta":
        return
    generator = torch.Generator(device=some.device).manual_seed(seed)
    for t in model.sharded_tensors():
        if t.name.endswith(("norm.weight", ".bias")):
            if t.view is not None:
                t.view.fill_(1.0 if t.name.endswith("norm.weight") else 0.0)
        elif t.view is not None and t.shard is None:
            t.view.normal_(0.0, std, generator=generator)
        else:
            whole = torch.empty(t.shape, dtype=some.dtype, device=some.device).normal_(0.0, std, generator=generator)
            t.load(t.part(whole))
