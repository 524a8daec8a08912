"""What the cost model needs of a model: parameter and weight bytes (dense or MoE), KV bytes per
token, FLOPs per token. Read from the engine's preset config.json files without importing the
model package (it imports torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import superinfer.engine

PRESETS = Path(superinfer.engine.__file__).parent / "model" / "presets"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2
    num_experts: int = 1  # MoE: experts per MoE layer (1: dense, its MLP the one "expert")
    experts_per_token: int = 1
    expert_intermediate_size: int = 0  # MoE: one expert's (0: intermediate_size, as Mixtral)
    num_dense_layers: int = 0  # MoE: layers with a dense MLP of intermediate_size (Qwen3-MoE's mlp_only_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def expert_params(self) -> int:
        """One expert's MLP (gate, up, down) in one layer."""
        return 3 * self.hidden_size * (self.expert_intermediate_size or self.intermediate_size)

    @property
    def shared_params(self) -> int:
        """Parameters every token reads: attention, norms, routers, dense MLPs, embeddings and head."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = 2 * h * q + 2 * h * kv
        router = h * self.num_experts if self.num_experts > 1 else 0
        dense_mlps = self.num_dense_layers * 3 * h * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        layers = self.num_layers * (attn + 2 * h) + self.num_moe_layers * router + dense_mlps
        return layers + self.vocab_size * h + h + head

    @property
    def num_params(self) -> int:
        return self.shared_params + self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token computes with (the embedding is a lookup, not a matmul)."""
        return (
            self.shared_params
            - self.vocab_size * self.hidden_size * (0 if self.tie_word_embeddings else 1)
            + self.num_moe_layers * self.experts_per_token * self.expert_params
        )

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per MoE layer that `tokens` tokens route to (uniform routing)."""
        if self.num_experts == 1:
            return 1.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes a step over `tokens` tokens streams from HBM: the shared weights (attention,
        routers, dense MLPs, head) and, of each MoE layer, the experts its tokens route to."""
        experts = self.num_moe_layers * self.experts_touched(tokens) * self.expert_params
        return (self.shared_params + experts) * self.dtype_bytes


def _num_dense_layers(raw: dict, num_layers: int, num_experts: int) -> int:
    """Qwen3-MoE: the layers in mlp_only_layers or off the decoder_sparse_step grid are dense."""
    if num_experts == 1:
        return 0
    mlp_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    step = int(raw.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(num_layers) if i in mlp_only or (i + 1) % step)


def from_hf_config(name: str, raw: dict) -> ModelSpec:
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    layers = int(raw["num_hidden_layers"])
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16").removeprefix("torch.")
    # Mixtral says num_local_experts, Qwen3-MoE's Hub config num_experts.
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 1)
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        vocab_size=int(raw["vocab_size"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype_bytes=DTYPE_BYTES.get(dtype, 2),
        num_experts=experts,
        experts_per_token=int(raw.get("num_experts_per_tok") or 1) if experts > 1 else 1,
        expert_intermediate_size=int(raw.get("moe_intermediate_size") or 0) if experts > 1 else 0,
        num_dense_layers=_num_dense_layers(raw, layers, experts),
    )


def list_models() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.json"))


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name (llama-3-8b, qwen2.5-32b, mixtral-8x7b, qwen3-30b-a3b, ...) or a config.json path."""
    path = Path(name_or_path)
    if path.is_file():
        return from_hf_config(path.parent.name or path.stem, json.loads(path.read_text()))
    preset = PRESETS / f"{name_or_path}.json"
    if not preset.is_file():
        raise ValueError(f"unknown model {name_or_path!r}; choose one of {', '.join(list_models())} or a config.json")
    return from_hf_config(name_or_path, json.loads(preset.read_text()))
