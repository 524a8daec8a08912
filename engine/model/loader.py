"""Resolve a model spec, build the decoder on the target device and fill its weights.

A spec is one of:
  * a local Hugging Face folder (config.json + safetensors, single file or sharded);
  * `hf://org/name[@revision]`, or a bare `org/name[@revision]` that is not a local folder: a model on
    the Hugging Face Hub, downloaded into the HF cache (or `download_dir`) unless already there, and
    taken from that cache alone when offline (see superinfer.engine.download);
  * `tiny`, the built-in model (built into the SuperInfer cache on first use);
  * another preset name from `presets/*.json`, or `dummy://<preset>`: that architecture with
    deterministic random weights and no tokenizer, so a GPU run needs no download.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from superinfer.engine.download import (
    HF_PREFIX,
    ModelDownloadError,
    hub_ref,
    is_repo_id,
    model_snapshot,
    weight_files,
)

from .config import DTYPE_BYTES, ModelConfig, normalize_dtype
from .decoder import DecoderLM, init_random_weights
from .sharding import TensorParallel, check_fits
from .tiny import ensure_tiny_model, tiny_config_dict

PRESETS_DIR = Path(__file__).with_name("presets")
TINY = "tiny"
DUMMY_PREFIX = "dummy://"
# Buffers some older transformers versions saved into checkpoints; we recompute them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: DecoderLM
    config: ModelConfig
    path: Path | None  # the folder the config (and weights) came from; None for presets
    tokenizer_dir: Path | None  # where tokenizer.json lives; None when there is no tokenizer


def list_presets() -> list[str]:
    """`tiny` followed by the architecture presets shipped in presets/*.json."""
    return [TINY, *sorted(p.stem for p in PRESETS_DIR.glob("*.json"))]


def preset_config(name: str) -> ModelConfig:
    if name == TINY:
        return ModelConfig.from_dict(tiny_config_dict())
    file = PRESETS_DIR / f"{name}.json"
    if not file.is_file():
        raise FileNotFoundError(f"unknown preset {name!r}; presets: {', '.join(list_presets())}")
    return ModelConfig.from_dict(json.loads(file.read_text()))


def _shape_error(name: str, got: tuple[int, ...], want: tuple[int, ...], file: Path) -> ValueError:
    return ValueError(f"tensor {name!r} in {file.name} has shape {list(got)}, the config expects {list(want)}")


def _names_error(kind: str, names: list[str], path: Path) -> ValueError:
    shown = ", ".join(sorted(names)[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")
    return ValueError(f"{kind} tensor(s) in {path}: {shown}")


def _checkpoint_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, Path, Any]]:
    """(name, file, open file) of every tensor; the open file reads it (or a slice of it) lazily."""
    # Tensors are read straight onto the target device (no CPU staging on CUDA).
    read_device = "cpu" if device.type in ("cpu", "meta") else str(device)
    for file in files:
        with safe_open(str(file), framework="pt", device=read_device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, file, f


@torch.no_grad()
def load_weights(model: DecoderLM, path: Path) -> None:
    """Copy the checkpoint in `path` into `model`, checking every name and shape. With tensor
    parallelism only this rank's part of each tensor is read, and none of the experts others hold."""
    tensors = {t.name: t for t in model.sharded_tensors()}  # tied lm_head appears once, as the embedding
    device = next(model.parameters()).device
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, file, f in _checkpoint_tensors(weight_files(path), device):
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        t = tensors.get(name)
        if t is None:
            unexpected.append(name)
            continue
        data = f.get_slice(name)
        shape = tuple(data.get_shape())
        if shape != t.shape:
            raise _shape_error(name, shape, t.shape, file)
        if device.type != "meta" and t.view is not None:
            t.load(f.get_tensor(name) if t.shard is None else data[t.shard.index(len(shape))])
        loaded.add(name)
    if unexpected:
        raise _names_error("unexpected", unexpected, path)
    missing = sorted(set(tensors) - loaded)
    if missing:
        raise _names_error("missing", missing, path)


def build_model(
    cfg: ModelConfig,
    *,
    dtype: str,
    device: str | torch.device,
    tp: TensorParallel = TensorParallel(),  # noqa: B008 - frozen
) -> DecoderLM:
    """An uninitialised DecoderLM (this rank's part of it) allocated directly on `device` in `dtype`
    (never staged in fp32)."""
    check_fits(cfg, tp.size)
    device = torch.device(device)
    model = DecoderLM(cfg, device="meta", dtype=getattr(torch, normalize_dtype(dtype)), tp=tp)
    if device.type != "meta":
        model = model.to_empty(device=device)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def _default_dtype(cfg: ModelConfig, device: torch.device) -> str:
    return "float32" if device.type == "cpu" else cfg.dtype


def _folder_tokenizer(path: Path) -> Path | None:
    return path if (path / "tokenizer.json").is_file() else None


def _hub_snapshot(spec: str, revision: str | None, download_dir: str | None, offline: bool) -> Path | None:
    """Local folder of a Hugging Face Hub spec (downloaded unless cached or offline); None for other specs."""
    if spec.startswith(HF_PREFIX):
        return model_snapshot(hub_ref(spec, revision), cache_dir=download_dir, offline=offline)
    if not is_repo_id(spec) or Path(spec).expanduser().is_dir():
        return None
    try:
        return model_snapshot(hub_ref(spec, revision), cache_dir=download_dir, offline=offline)
    except (ModelDownloadError, FileNotFoundError) as exc:
        # A mistyped relative path reads as org/name too: say why the Hub was asked.
        message = f"model {spec!r} is not a local folder, so it was looked up on the Hugging Face Hub: {exc}"
        raise type(exc)(message) from exc


def _resolve(
    spec: str, revision: str | None = None, download_dir: str | None = None, offline: bool = False
) -> tuple[ModelConfig, Path | None, Path | None, bool]:
    """(config, folder, tokenizer folder, force dummy) for a spec."""
    hub = _hub_snapshot(spec, revision, download_dir, offline)
    if hub is not None:
        return ModelConfig.from_dir(hub), hub, _folder_tokenizer(hub), False
    if revision:
        raise ValueError(f"--revision is for Hugging Face models (org/name or hf://org/name); {spec!r} is not one")
    if spec.startswith(DUMMY_PREFIX):
        name = spec.removeprefix(DUMMY_PREFIX)
        if name == TINY:
            path = ensure_tiny_model()
            return ModelConfig.from_dir(path), path, path, True
        return preset_config(name), None, None, True
    local = Path(spec).expanduser()
    if local.is_dir():
        return ModelConfig.from_dir(local), local.resolve(), _folder_tokenizer(local.resolve()), False
    if spec == TINY:
        path = ensure_tiny_model()
        return ModelConfig.from_dir(path), path, path, False
    if (PRESETS_DIR / f"{spec}.json").is_file():
        return preset_config(spec), None, None, True
    raise FileNotFoundError(
        f"model {spec!r} is not a local folder, a Hugging Face id (org/name or hf://org/name) or a preset "
        f"(presets: {', '.join(list_presets())})"
    )


def model_config(
    spec: str, revision: str | None = None, download_dir: str | None = None, offline: bool = False
) -> ModelConfig:
    """The config of `spec` (a Hub model is downloaded first, as load_model would)."""
    return _resolve(spec, revision, download_dir, offline)[0]


def load_model(
    spec: str,
    *,
    dtype: str | None = None,
    device: str = "cpu",
    dummy: bool = False,
    seed: int = 0,
    revision: str | None = None,
    download_dir: str | None = None,
    offline: bool = False,
    tp: TensorParallel = TensorParallel(),  # noqa: B008 - frozen
) -> LoadedModel:
    """Load `spec` (see the module docstring) onto `device`; with `tp`, this rank's part of it.

    dtype defaults to float32 on CPU and to the config's dtype elsewhere. `dummy=True` (implied by
    presets) skips the checkpoint and fills deterministic random weights from `seed`. For Hub models,
    `revision` pins a branch, tag or commit (like `@revision`), `download_dir` replaces the Hugging
    Face cache folder, and `offline` (or HF_HUB_OFFLINE=1) uses that cache without contacting the Hub.
    """
    cfg, path, tokenizer_dir, force_dummy = _resolve(spec, revision, download_dir, offline)
    torch_device = torch.device(device)
    model = build_model(cfg, dtype=dtype or _default_dtype(cfg, torch_device), device=torch_device, tp=tp)
    if dummy or force_dummy or path is None:
        init_random_weights(model, seed=seed)
    else:
        load_weights(model, path)
    return LoadedModel(model=model, config=cfg, path=path, tokenizer_dir=tokenizer_dir)


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes the decoder's parameters take in `dtype`."""
    return cfg.num_params() * DTYPE_BYTES[normalize_dtype(dtype)]
