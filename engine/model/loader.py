"""Resolve a model spec, build the decoder on the target device and fill its weights.

A spec is one of:
  * a local Hugging Face folder (config.json + safetensors, single file or sharded);
  * `hf://org/name[@revision]`, looked up ONLY in the local Hugging Face cache, never downloaded;
  * `tiny`, the built-in model (built into the SuperInfer cache on first use);
  * another preset name from `presets/*.json`, or `dummy://<preset>`: that architecture with
    deterministic random weights and no tokenizer, so a GPU run needs no download.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .config import DTYPE_BYTES, ModelConfig, normalize_dtype
from .decoder import DecoderLM, init_random_weights
from .tiny import ensure_tiny_model

PRESETS_DIR = Path(__file__).with_name("presets")
TINY = "tiny"
HF_PREFIX = "hf://"
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
    file = PRESETS_DIR / f"{name}.json"
    if not file.is_file():
        raise FileNotFoundError(f"unknown preset {name!r}; presets: {', '.join(list_presets())}")
    return ModelConfig.from_dict(json.loads(file.read_text()))


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder, resolved the way huggingface_hub does."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve_hf(ref: str) -> Path:
    """Snapshot folder of `org/name[@revision]` in the local HF cache (revision: branch, tag or commit)."""
    repo, _, revision = ref.partition("@")
    if not repo or repo.count("/") > 1 or repo.startswith("/") or repo.endswith("/"):
        raise ValueError(f"bad hf:// model id {ref!r}; expected hf://org/name[@revision]")
    cache = hf_hub_cache()
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    hint = (
        f"hf://{repo} is not in the local Hugging Face cache ({cache}); SuperInfer never downloads. "
        f"Fetch it where there is network access (`hf download {repo}` or `huggingface-cli download {repo}`, "
        "with HF_HUB_CACHE / HF_HOME pointing at this cache), or pass a local model folder."
    )
    if not repo_dir.is_dir():
        raise FileNotFoundError(hint)
    snapshots = repo_dir / "snapshots"
    available = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    ref_file = repo_dir / "refs" / (revision or "main")
    if ref_file.is_file():
        snapshot = snapshots / ref_file.read_text().strip()
    elif revision and (snapshots / revision).is_dir():
        snapshot = snapshots / revision
    elif not revision and len(available) == 1:
        snapshot = snapshots / available[0]
    else:
        wanted = revision or "main"
        raise FileNotFoundError(f"revision {wanted!r} of hf://{repo} is not in the local cache; have {available}")
    if not (snapshot / "config.json").is_file():
        raise FileNotFoundError(f"{snapshot} has no config.json (incomplete download?). {hint}")
    return snapshot


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: from model.safetensors.index.json, else model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(f"no safetensors weights in {path} (pytorch .bin checkpoints are not supported)")


def _shape_error(name: str, got: tuple[int, ...], want: tuple[int, ...], file: Path) -> ValueError:
    return ValueError(f"tensor {name!r} in {file.name} has shape {list(got)}, the config expects {list(want)}")


def _names_error(kind: str, names: list[str], path: Path) -> ValueError:
    shown = ", ".join(sorted(names)[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")
    return ValueError(f"{kind} tensor(s) in {path}: {shown}")


def _checkpoint_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, Path, object]]:
    # Tensors are read straight onto the target device (no CPU staging on CUDA); on meta only the
    # header is read and the slice handle stands in for the data.
    read_device = "cpu" if device.type in ("cpu", "meta") else str(device)
    for file in files:
        with safe_open(str(file), framework="pt", device=read_device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, file, (f.get_slice(name) if device.type == "meta" else f.get_tensor(name))


@torch.no_grad()
def load_weights(model: DecoderLM, path: Path) -> None:
    """Copy the checkpoint in `path` into `model`, checking every name and shape."""
    params = dict(model.checkpoint_tensors())  # tied lm_head appears once, as the embedding
    device = next(iter(params.values())).device
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, file, data in _checkpoint_tensors(weight_files(path), device):
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        shape = tuple(data.get_shape()) if device.type == "meta" else tuple(data.shape)  # type: ignore[attr-defined]
        if shape != tuple(param.shape):
            raise _shape_error(name, shape, tuple(param.shape), file)
        if device.type != "meta":
            param.copy_(data)  # type: ignore[arg-type]
        loaded.add(name)
    if unexpected:
        raise _names_error("unexpected", unexpected, path)
    missing = sorted(set(params) - loaded)
    if missing:
        raise _names_error("missing", missing, path)


def build_model(cfg: ModelConfig, *, dtype: str, device: str | torch.device) -> DecoderLM:
    """An uninitialised DecoderLM allocated directly on `device` in `dtype` (never staged in fp32)."""
    device = torch.device(device)
    model = DecoderLM(cfg, device="meta", dtype=getattr(torch, normalize_dtype(dtype)))
    if device.type != "meta":
        model = model.to_empty(device=device)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def _default_dtype(cfg: ModelConfig, device: torch.device) -> str:
    return "float32" if device.type == "cpu" else cfg.dtype


def _folder_tokenizer(path: Path) -> Path | None:
    return path if (path / "tokenizer.json").is_file() else None


def _resolve(spec: str) -> tuple[ModelConfig, Path | None, Path | None, bool]:
    """(config, folder, tokenizer folder, force dummy) for a spec."""
    if spec.startswith(DUMMY_PREFIX):
        name = spec.removeprefix(DUMMY_PREFIX)
        if name == TINY:
            path = ensure_tiny_model()
            return ModelConfig.from_dir(path), path, path, True
        return preset_config(name), None, None, True
    if spec.startswith(HF_PREFIX):
        path = resolve_hf(spec.removeprefix(HF_PREFIX))
        return ModelConfig.from_dir(path), path, _folder_tokenizer(path), False
    local = Path(spec).expanduser()
    if local.is_dir():
        return ModelConfig.from_dir(local), local.resolve(), _folder_tokenizer(local.resolve()), False
    if spec == TINY:
        path = ensure_tiny_model()
        return ModelConfig.from_dir(path), path, path, False
    if (PRESETS_DIR / f"{spec}.json").is_file():
        return preset_config(spec), None, None, True
    raise FileNotFoundError(
        f"model {spec!r} is not a local folder, an hf://org/name id or a preset (presets: {', '.join(list_presets())})"
    )


def load_model(
    spec: str,
    *,
    dtype: str | None = None,
    device: str = "cpu",
    dummy: bool = False,
    seed: int = 0,
) -> LoadedModel:
    """Load `spec` (see the module docstring) onto `device`.

    dtype defaults to float32 on CPU and to the config's dtype elsewhere. `dummy=True` (implied by
    presets) skips the checkpoint and fills deterministic random weights from `seed`.
    """
    cfg, path, tokenizer_dir, force_dummy = _resolve(spec)
    torch_device = torch.device(device)
    model = build_model(cfg, dtype=dtype or _default_dtype(cfg, torch_device), device=torch_device)
    if dummy or force_dummy or path is None:
        init_random_weights(model, seed=seed)
    else:
        load_weights(model, path)
    return LoadedModel(model=model, config=cfg, path=path, tokenizer_dir=tokenizer_dir)


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes the decoder's parameters take in `dtype`."""
    return cfg.num_params() * DTYPE_BYTES[normalize_dtype(dtype)]
