"""Model package: HF config parsing, the Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE decoder, the loader and
presets."""

from superinfer.engine.download import hf_hub_cache, resolve_hf

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, MoEConfig, normalize_dtype
from .decoder import Attention, DecoderLM, apply_rope, init_random_weights, rope_inv_freq
from .loader import (
    LoadedModel,
    build_model,
    list_presets,
    load_model,
    load_weights,
    preset_config,
    weight_bytes,
)
from .tiny import default_cache_root, ensure_tiny_model, write_tiny_model, write_tokenizer_files

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Attention",
    "DecoderLM",
    "LoadedModel",
    "MoEConfig",
    "ModelConfig",
    "apply_rope",
    "build_model",
    "default_cache_root",
    "ensure_tiny_model",
    "hf_hub_cache",
    "init_random_weights",
    "list_presets",
    "load_model",
    "load_weights",
    "normalize_dtype",
    "preset_config",
    "resolve_hf",
    "rope_inv_freq",
    "weight_bytes",
    "write_tiny_model",
    "write_tokenizer_files",
]
