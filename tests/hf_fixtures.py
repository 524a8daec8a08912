"""Tiny random Hugging Face checkpoints for tests: built with transformers, saved with
save_pretrained, and made servable by copying in the tiny model's tokenizer.

transformers is a test-only dependency; the engine never imports it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from superinfer.engine.model.tiny import (
    BOS,
    END_OF_TEXT,
    EOT,
    TINY_VOCAB_SIZE,
    special_token_ids,
    write_tokenizer_files,
)

ARCHS = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")

# Small enough to build and run in milliseconds, big enough for GQA (2 query heads per kv head).
# MoE models: top-2 of 4 (Mixtral) or 8 (Qwen3-MoE) experts unless overridden.
_MOE = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
}
_BASE = {
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "vocab_size": TINY_VOCAB_SIZE,  # the copied tokenizer must fit the embedding table
}

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the test sequences cross the band where frequencies are interpolated.
    "original_max_position_embeddings": 32,
}


def _config(arch: str, rope_scaling: dict[str, Any] | None, tie: bool, overrides: dict[str, Any]) -> Any:
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }
    if arch not in cls:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    ids = special_token_ids()
    kwargs: dict[str, Any] = {
        **_BASE,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[END_OF_TEXT], ids[EOT]],
        "tie_word_embeddings": tie,
        **_MOE.get(arch, {}),
    }
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 32  # explicit and != hidden / heads, as in real Qwen3 checkpoints
    theta = overrides.pop("rope_theta", 10000.0)
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    kwargs.update(overrides)
    return cls[arch](**kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF init leaves norms at 1 and biases at 0, which would hide a q_norm or bias that is not
    # loaded; give every parameter a distinct random value, large enough for visible logits.
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.2 * noise)
        else:
            p.copy_(noise * 0.1)


def to_v4_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a transformers 5 config.json dict into the 4.x form (rope_theta/rope_scaling/torch_dtype)."""
    out = dict(raw)
    params = dict(out.pop("rope_parameters", None) or {})
    out["rope_theta"] = params.pop("rope_theta", 10000.0)
    rope_type = params.get("rope_type", "default")
    out["rope_scaling"] = None if rope_type == "default" else params
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    out.pop("layer_types", None)
    return out


def make_hf_checkpoint(
    arch: str,
    path: Path,
    *,
    seed: int = 0,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    shard: bool = False,
    config_form: str = "v5",
    **config_overrides: Any,
) -> Path:
    """Save a random float32 `arch` (one of ARCHS) model into `path` and return it.

    `rope_scaling` is an HF rope dict such as LLAMA3_SCALING; `shard` splits the weights into
    several files with an index; `config_form="v4"` rewrites config.json the transformers 4 way.
    """
    import transformers

    if config_form not in ("v4", "v5"):
        raise ValueError(f"config_form must be 'v4' or 'v5', got {config_form!r}")
    cfg = _config(arch, rope_scaling, tie, dict(config_overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size="300KB" if shard else "10GB")
    config_file = path / "config.json"
    raw = json.loads(config_file.read_text())
    raw.setdefault("dtype", "float32")
    if config_form == "v4":
        raw = to_v4_config(raw)
    config_file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    write_tokenizer_files(path)
    return path


def hf_model(path: Path) -> Any:
    """The reference transformers model for a checkpoint folder, float32, eval mode, eager attention."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_greedy(model: Any, prompt: list[int], num_tokens: int, **generate_kwargs: Any) -> list[int]:
    """transformers' greedy continuation of `prompt`: exactly `num_tokens` tokens, EOS ignored (not
    a stop and still a candidate, as the engine's ignore_eos; min_new_tokens would mask it out)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=num_tokens,
        eos_token_id=None,
        do_sample=False,
        pad_token_id=0,
        **generate_kwargs,
    )
    return out[0, len(prompt) :].tolist()


def causal_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Our model's logits for one sequence `ids`, with dense causal attention (no KV cache): what
    its logits are compared with, transformers' or its own on other kernels."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)

    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids), device=ids.device), attend))
