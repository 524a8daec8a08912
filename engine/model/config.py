"""Model configuration parsed from a Hugging Face `config.json`.

Both serialisations are accepted: transformers 4.x (`rope_theta` and `rope_scaling` at the top
level, `torch_dtype`) and 5.x (`rope_parameters` holding `rope_theta`, `dtype`). Mixture-of-experts
models (Mixtral, Qwen3-MoE) carry a `MoEConfig`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

Architecture = Literal["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")
_ARCH_FROM_CLASS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# Defaults of the transformers config classes for keys a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "mixtral": 131072, "qwen3_moe": 32768}
_QK_NORM = ("qwen3", "qwen3_moe")

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

# rope types and the keys each one needs besides rope_theta.
_ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def normalize_dtype(name: str) -> str:
    """Map "torch.bfloat16", "bf16", "half", ... to one of float32 | float16 | bfloat16."""
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}")
    return _DTYPE_ALIASES[key]


def _architecture(raw: Mapping[str, Any]) -> str:
    model_type = raw.get("model_type")
    if model_type is None:
        for cls in raw.get("architectures") or ():
            if cls in _ARCH_FROM_CLASS:
                return _ARCH_FROM_CLASS[cls]
        names = raw.get("architectures") or "missing"
        raise ValueError(
            f"unsupported architecture {names!r} (no model_type); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return str(model_type)


def _rope(raw: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling) from either config form; rope_scaling is None for plain RoPE."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):
        scaling: dict[str, Any] = dict(params)
        theta = scaling.pop("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        scaling = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", 10000.0)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in _ROPE_REQUIRED_KEYS:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(sorted(_ROPE_REQUIRED_KEYS))}")
    missing = [k for k in _ROPE_REQUIRED_KEYS[rope_type] if k not in scaling]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)}")
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _merge_ids(*groups: Iterable[int]) -> tuple[int, ...]:
    """Union of id groups, first occurrence order kept."""
    seen: dict[int, None] = {}
    for group in groups:
        for i in group:
            seen.setdefault(int(i), None)
    return tuple(seen)


def _require(raw: Mapping[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json is missing {key!r}")
    return raw[key]


@dataclass(frozen=True)
class MoEConfig:
    """Sparse feed-forward: each token goes to the `top_k` of `num_experts` SwiGLU experts its
    router scores highest, their outputs summed with the router's weights."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # rescale the top-k weights to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    # Qwen3-MoE rounds the top-k weights to the model dtype before weighting; Mixtral keeps float32.
    weights_in_model_dtype: bool
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (the model's intermediate_size)


def _mixtral_moe(raw: Mapping[str, Any]) -> MoEConfig:
    return MoEConfig(
        num_experts=int(raw.get("num_local_experts") or 8),
        top_k=int(raw.get("num_experts_per_tok") or 2),
        intermediate_size=int(_require(raw, "intermediate_size")),
        renormalize=True,
        weights_in_model_dtype=False,
    )


def _qwen3_moe(raw: Mapping[str, Any], num_layers: int) -> MoEConfig | None:
    # The Hub's config.json says num_experts; transformers 5 writes num_local_experts.
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if experts == 0:
        return None  # every layer dense
    step = int(raw.get("decoder_sparse_step") or 1)
    mlp_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    return MoEConfig(
        num_experts=experts,
        top_k=int(raw.get("num_experts_per_tok") or 8),
        intermediate_size=int(raw.get("moe_intermediate_size") or 768),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        weights_in_model_dtype=True,
        dense_layers=tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step),
    )


def _moe(arch: str, raw: Mapping[str, Any], num_layers: int) -> MoEConfig | None:
    if arch == "mixtral":
        return _mixtral_moe(raw)
    if arch == "qwen3_moe":
        return _qwen3_moe(raw, num_layers)
    return None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {"rope_type": "llama3" | "linear", ...parameters} or None for plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v
    o_proj_bias: bool = False  # llama/qwen3 `attention_bias` also covers o_proj; qwen2 never has it
    mlp_bias: bool = False
    qk_norm: bool = False
    dtype: str = "float32"  # what transformers assumes when a config names none
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        arch = _architecture(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only silu (SwiGLU) is supported")
        if raw.get("use_sliding_window") or (arch == "mixtral" and raw.get("sliding_window")):
            raise ValueError("sliding-window attention is not supported")
        hidden = int(_require(raw, "hidden_size"))
        heads = int(_require(raw, "num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
            head_dim = hidden // heads
        if int(head_dim) % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        theta, scaling = _rope(raw)
        bias = bool(raw.get("attention_bias", False)) and arch != "mixtral"  # Mixtral has none
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        num_layers = int(_require(raw, "num_hidden_layers"))
        return cls(
            architecture=arch,
            vocab_size=int(_require(raw, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_require(raw, "intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bias,
            o_proj_bias=False if arch == "qwen2" else bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if arch == "llama" else False,
            qk_norm=arch in _QK_NORM,
            dtype=normalize_dtype(dtype),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            moe=_moe(arch, raw, num_layers),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json`, adding the eos ids of `generation_config.json` when present."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        cfg = cls.from_dict(json.loads(config_file.read_text()))
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen_eos = _token_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
            cfg = cfg.with_eos(gen_eos)
        return cfg

    def with_eos(self, ids: Iterable[int]) -> ModelConfig:
        """A copy whose eos ids also include `ids`."""
        return replace(self, eos_token_ids=_merge_ids(self.eos_token_ids, ids))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    def _attention_params(self) -> int:
        h = self.hidden_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        return attn

    def _mlp_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        return 3 * h * i + (2 * i + h if self.mlp_bias else 0)

    def _ffn_params(self, layer: int, experts: int) -> int:
        """Feed-forward parameters of `layer`; of an MoE layer, its router and `experts` experts."""
        if self.moe is None or not self.is_moe_layer(layer):
            return self._mlp_params()
        return self.moe.num_experts * self.hidden_size + experts * 3 * self.hidden_size * self.moe.intermediate_size

    def _params(self, experts: int, head: bool) -> int:
        layers = sum(
            self._attention_params() + self._ffn_params(layer, experts) + 2 * self.hidden_size
            for layer in range(self.num_layers)
        )
        embed = self.vocab_size * self.hidden_size
        return embed + layers + self.hidden_size + (embed if head else 0)

    def num_params(self) -> int:
        """Parameter count of the decoder as built by DecoderLM (tied embeddings counted once)."""
        experts = self.moe.num_experts if self.moe else 0
        return self._params(experts, head=not self.tie_word_embeddings)

    def num_active_params(self) -> int:
        """Parameters one token's matmuls use: top_k experts per MoE layer, the head, not the
        embedding lookup (for FLOPs estimates)."""
        experts = self.moe.top_k if self.moe else 0
        return self._params(experts, head=True) - self.vocab_size * self.hidden_size

    def ffn_activations_per_token(self) -> int:
        """Elements one token's feed-forward holds at its peak: gate, up and their product (MoE:
        for each of its top_k experts, with the copies of its hidden state in and out)."""
        dense = 3 * self.intermediate_size
        if self.moe is None:
            return dense
        routed = self.moe.top_k * (3 * self.moe.intermediate_size + 2 * self.hidden_size)
        return max(routed, dense if self.moe.dense_layers else 0)
