"""Model package: HF parity of the decoder, config parsing, loader, presets, tokenizer, tiny model."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from superinfer.engine.model import (
    DecoderLM,
    ModelConfig,
    ensure_tiny_model,
    list_presets,
    load_model,
    preset_config,
    rope_inv_freq,
    write_tiny_model,
)
from superinfer.engine.model.loader import PRESETS_DIR
from superinfer.engine.model.tiny import BOS, END_OF_TEXT, EOT, TINY_DIRNAME
from superinfer.engine.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from tests.hf_fixtures import LLAMA3_SCALING, hf_model, make_hf_checkpoint, to_v4_config

transformers = pytest.importorskip("transformers")

# ----------------------------------------------------------------------------------------------
# Reference attention implementations of the model's Attention protocol.


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """q [n, H, D] attends causally to k, v [past + n, KV, D]; GQA by repeating kv heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    n, total = q.shape[0], k.shape[0]
    mask = torch.arange(total, device=q.device)[None, :] <= (past + torch.arange(n, device=q.device))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


class DenseCausalAttention:
    """Every sequence of the flattened batch is a whole prompt: causal attention within it."""

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = seq_lens

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for n in self.seq_lens:
            outs.append(_attend(q[start : start + n], k[start : start + n], v[start : start + n], 0))
            start += n
        return torch.cat(outs)


class CachedAttention:
    """Keeps each sequence's K/V per layer across calls, like a (non-paged) KV cache."""

    def __init__(self) -> None:
        self.kv: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.chunks: list[tuple[str, int]] = []

    def step(self, chunks: list[tuple[str, int]]) -> CachedAttention:
        self.chunks = chunks
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for seq, n in self.chunks:
            end = start + n
            pk, pv = self.kv.get((seq, layer), (k[:0], v[:0]))
            keys, values = torch.cat([pk, k[start:end]]), torch.cat([pv, v[start:end]])
            self.kv[(seq, layer)] = (keys, values)
            outs.append(_attend(q[start:end], keys, values, pk.shape[0]))
            start = end
        return torch.cat(outs)


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


@torch.no_grad()
def _our_logits(model: DecoderLM, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Logits of every prompt token, all prompts in one flattened call; returned on the CPU."""
    device = model.lm_head.weight.device
    ids = torch.cat(prompts).to(device)
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).to(device)
    hidden = model(ids, positions, DenseCausalAttention([len(p) for p in prompts]))
    return model.compute_logits(hidden).cpu()


@torch.no_grad()
def _hf_logits(ref: torch.nn.Module, prompts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([ref(p[None]).logits[0].float() for p in prompts])


# ----------------------------------------------------------------------------------------------
# Logit parity with transformers.

PARITY_CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama-llama3-rope": ("llama", {"rope_scaling": LLAMA3_SCALING}),
    "llama-tied": ("llama", {"tie": True}),
    "qwen3-tied": ("qwen3", {"tie": True}),
    "llama-sharded": ("llama", {"shard": True}),
    "qwen2-v4-config": ("qwen2", {"config_form": "v4"}),
    "llama-v4-llama3-rope": ("llama", {"config_form": "v4", "rope_scaling": LLAMA3_SCALING}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
}


def _check_checkpoint_shape(path: Path, opts: dict) -> None:
    """The fixture really has the property the case is about."""
    raw = json.loads((path / "config.json").read_text())
    names: set[str] = set()
    for f in path.glob("*.safetensors"):
        names |= set(load_file(f))
    assert ("lm_head.weight" in names) != bool(opts.get("tie"))
    if opts.get("shard"):
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    if opts.get("config_form") == "v4":
        assert "rope_parameters" not in raw and "rope_theta" in raw and "torch_dtype" in raw
    else:
        assert "rope_parameters" in raw


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    arch, opts = PARITY_CASES[case]
    path = make_hf_checkpoint(arch, tmp_path / case, seed=len(case), **opts)
    _check_checkpoint_shape(path, opts)
    loaded = load_model(str(path))
    assert loaded.config.architecture == arch and loaded.path == path.resolve()
    prompts = _prompts([7, 45, 3], loaded.config.vocab_size)
    ours = _our_logits(loaded.model, prompts)
    ref = _hf_logits(hf_model(path), prompts)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert ref.abs().max() > 0.5  # not a degenerate model
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_llama3_scaling_changes_logits(tmp_path: Path) -> None:
    plain = make_hf_checkpoint("llama", tmp_path / "plain", seed=1)
    scaled = make_hf_checkpoint("llama", tmp_path / "scaled", seed=1, rope_scaling=LLAMA3_SCALING)
    prompts = _prompts([45], 3072)
    a = _our_logits(load_model(str(plain)).model, prompts)
    b = _our_logits(load_model(str(scaled)).model, prompts)
    assert not torch.allclose(a[-1], b[-1], atol=1e-3)


def test_rope_inv_freq_matches_transformers_llama3() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = json.loads((PRESETS_DIR / "llama-3.1-8b.json").read_text())
    hf_cfg = transformers.LlamaConfig(**raw)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    cfg = preset_config("llama-3.1-8b")
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(ours, ref.float())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_and_decode_match_full_forward(arch: str, tmp_path: Path) -> None:
    """Mixed steps (prefill chunks of one sequence beside decodes of another) with positions that
    do not start at 0 give the logits of a full forward."""
    path = make_hf_checkpoint(arch, tmp_path / arch, seed=3, rope_scaling=LLAMA3_SCALING if arch == "llama" else None)
    model = load_model(str(path)).model
    a, b = _prompts([40, 12], 3072, seed=5)
    full = {"a": _our_logits(model, [a]), "b": _our_logits(model, [b])}
    torch.testing.assert_close(full["a"], _hf_logits(hf_model(path), [a]), atol=1e-4, rtol=1e-4)
    seqs = {"a": a, "b": b}
    # (sequence, start, n) per step: a is prefilled in chunks while b prefills and then decodes.
    steps = [
        [("a", 0, 16), ("b", 0, 9)],
        [("b", 9, 1), ("a", 16, 20)],
        [("a", 36, 1), ("b", 10, 1)],
        [("b", 11, 1), ("a", 37, 3)],
    ]
    attn = CachedAttention()
    with torch.no_grad():
        for step in steps:
            ids = torch.cat([seqs[s][start : start + n] for s, start, n in step])
            pos = torch.cat([torch.arange(start, start + n) for _, start, n in step])
            logits = model.compute_logits(model(ids, pos, attn.step([(s, n) for s, _, n in step])))
            offset = 0
            for s, start, n in step:
                torch.testing.assert_close(
                    logits[offset : offset + n], full[s][start : start + n], atol=1e-4, rtol=1e-4
                )
                offset += n


def test_greedy_generation_matches_transformers_generate(tmp_path: Path) -> None:
    path = make_hf_checkpoint("qwen2", tmp_path / "q", seed=11)
    model = load_model(str(path)).model
    prompt = _prompts([9], 3072, seed=2)[0]
    ref = hf_model(path).generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None)[0]
    attn, ids, out = CachedAttention(), prompt, []
    with torch.no_grad():
        pos = torch.arange(len(prompt))
        for _ in range(12):
            hidden = model(ids, pos, attn.step([("s", len(ids))]))
            nxt = int(model.compute_logits(hidden[-1:]).argmax(-1))
            out.append(nxt)
            ids, pos = torch.tensor([nxt]), pos[-1:] + 1
    assert out == ref[len(prompt) :].tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(dtype: str, tmp_path: Path) -> None:
    path = make_hf_checkpoint("qwen3", tmp_path / "m", seed=4)
    prompts = _prompts([6, 11], 3072)
    full = _our_logits(load_model(str(path)).model, prompts)
    half = load_model(str(path), dtype=dtype).model
    assert half.lm_head.weight.dtype == getattr(torch, dtype)
    assert half.rotary.cos_cached.dtype == torch.float32  # RoPE tables stay float32
    low = _our_logits(half, prompts)
    assert low.dtype == torch.float32
    assert (low - full).abs().max() < 0.05 * full.abs().max()
    cast = load_model(str(path)).model.to(getattr(torch, dtype))  # a later cast keeps float32 RoPE too
    assert cast.rotary.cos_cached.dtype == torch.float32
    torch.testing.assert_close(cast.rotary.sin_cached, half.rotary.sin_cached, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# Config parsing.

_LLAMA_V5 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_SCALING},
    "dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "tie_word_embeddings": False,
}


def test_config_v4_and_v5_forms_parse_identically() -> None:
    v5 = ModelConfig.from_dict(_LLAMA_V5)
    v4_raw = to_v4_config(_LLAMA_V5)
    assert "rope_parameters" not in v4_raw and v4_raw["torch_dtype"] == "bfloat16"
    assert ModelConfig.from_dict(v4_raw) == v5
    assert v5.rope_theta == 500000.0 and v5.dtype == "bfloat16"
    assert v5.rope_scaling == LLAMA3_SCALING
    assert v5.head_dim == 16 and v5.num_kv_heads == 2 and v5.eos_token_ids == (2, 3)


def test_config_v4_legacy_type_key_and_default_rope() -> None:
    raw = to_v4_config(_LLAMA_V5)
    raw["rope_scaling"] = {**LLAMA3_SCALING}
    raw["rope_scaling"]["type"] = raw["rope_scaling"].pop("rope_type")
    assert ModelConfig.from_dict(raw).rope_scaling == LLAMA3_SCALING
    raw["rope_scaling"] = {"rope_type": "default"}
    assert ModelConfig.from_dict(raw).rope_scaling is None
    assert ModelConfig.from_dict({**raw, "rope_scaling": None}).rope_scaling is None


def test_config_architecture_specifics() -> None:
    qwen2 = preset_config("qwen2.5-7b")
    assert (qwen2.architecture, qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == ("qwen2", True, False, False)
    qwen3 = preset_config("qwen3-0.6b")
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.tie_word_embeddings
    assert qwen3.head_dim == 128 != qwen3.hidden_size // qwen3.num_heads  # explicit head_dim wins
    assert qwen3.eos_token_ids == (151645,)  # a bare int
    llama = preset_config("llama-3.1-8b")
    assert llama.rope_scaling is not None and llama.rope_scaling["factor"] == 8.0
    assert llama.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2
    only_class = {k: v for k, v in _LLAMA_V5.items() if k != "model_type"}
    assert ModelConfig.from_dict(only_class).architecture == "llama"
    assert ModelConfig.from_dict({**_LLAMA_V5, "attention_bias": True}).attention_bias


def test_config_from_dir_merges_generation_config_eos(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA_V5, "eos_token_id": 2}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 7, 9)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "mistral"),
        ({"model_type": None, "architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"dtype": "int8"}, "int8"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"use_sliding_window": True}, "sliding"),
    ],
)
def test_bad_configs_raise_clear_errors(change: dict, message: str) -> None:
    raw = {**_LLAMA_V5, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


# ----------------------------------------------------------------------------------------------
# Presets and dummy weights.

PUBLIC_PARAM_COUNTS = {  # from the model cards / safetensors index totals
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-32b": 32_763_876_352,
    "qwen3-0.6b": 596_049_920,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-8b": 8_190_735_360,
}


def test_presets_listed() -> None:
    assert list_presets() == ["tiny", *sorted(PUBLIC_PARAM_COUNTS)]
    # every listed name has a config (bench.kv_copy and the simulator take one by name)
    assert preset_config("tiny") == load_model("tiny", device="meta").config


@pytest.mark.parametrize("name", sorted(PUBLIC_PARAM_COUNTS))
def test_preset_builds_on_meta_with_right_parameter_count(name: str) -> None:
    loaded = load_model(name, device="meta")
    model, cfg = loaded.model, loaded.config
    assert loaded.path is None and loaded.tokenizer_dir is None
    params = list(model.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == cfg.num_params() == PUBLIC_PARAM_COUNTS[name]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_word_embeddings
    assert load_model(f"dummy://{name}", device="meta").config == cfg


def test_dummy_weights_are_deterministic_and_well_formed(tiny_dir: Path) -> None:
    a = load_model(str(tiny_dir), dummy=True, seed=7).model
    b = load_model(str(tiny_dir), dummy=True, seed=7).model
    c = load_model(str(tiny_dir), dummy=True, seed=8).model
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert torch.all(a.model.norm.weight == 1) and torch.all(a.model.layers[0].input_layernorm.weight == 1)
    std = dict(a.checkpoint_tensors())["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.018 < std < 0.022


def test_dummy_bf16_is_built_in_bf16(tiny_dir: Path) -> None:
    model = load_model(str(tiny_dir), dtype="bfloat16", dummy=True).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert load_model(str(tiny_dir)).model.lm_head.weight.dtype == torch.float32  # CPU default


# ----------------------------------------------------------------------------------------------
# Loader errors and hf:// resolution.


def _rewrite_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = make_hf_checkpoint("qwen3", tmp_path / "m")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(str(path))


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    path = make_hf_checkpoint("llama", tmp_path / "m")
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.extra\.weight"):
        load_model(str(path))


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    path = make_hf_checkpoint("llama", tmp_path / "m")
    _rewrite_weights(path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\[3\]"):
        load_model(str(path))


def test_hf_spec_resolves_from_local_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_hf_checkpoint("qwen2", tmp_path / "src", seed=9)
    cache = tmp_path / "hub"
    repo = cache / "models--acme--mini"
    shutil.copytree(src, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # downloads: tests/test_model_download.py
    prompts = _prompts([5], 3072)
    expected = _our_logits(load_model(str(src)).model, prompts)
    for spec in ("hf://acme/mini", "hf://acme/mini@0123abcd", "hf://acme/mini@main"):
        loaded = load_model(spec)
        assert loaded.path == repo / "snapshots" / "0123abcd" and loaded.tokenizer_dir == loaded.path
        torch.testing.assert_close(_our_logits(loaded.model, prompts), expected)
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        load_model("hf://acme/absent")
    with pytest.raises(FileNotFoundError, match="v9"):
        load_model("hf://acme/mini@v9")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert load_model("hf://acme/mini").path == repo / "snapshots" / "0123abcd"


def test_unknown_spec_lists_presets() -> None:
    with pytest.raises(FileNotFoundError, match="qwen3-8b"):
        load_model("no-such-model")


# ----------------------------------------------------------------------------------------------
# The tiny model.


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("superinfer-cache"))


def _hashes(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_tiny_model_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "again")
    assert _hashes(tmp_path / "again") == _hashes(tiny_dir)
    assert set(_hashes(tiny_dir)) == {
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_ensure_tiny_model_reuses_and_is_atomic(tiny_dir: Path) -> None:
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_dir.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in tiny_dir.parent.iterdir()] == [TINY_DIRNAME]  # no temp dirs left behind


def test_tiny_spec_uses_superinfer_cache(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERINFER_CACHE", str(tiny_dir.parent))
    loaded = load_model("tiny")
    assert loaded.path == tiny_dir and loaded.tokenizer_dir == tiny_dir
    cfg = loaded.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.dtype) == ("llama", 4, 256, "bfloat16")
    tok = Tokenizer.from_dir(tiny_dir)
    assert cfg.vocab_size == tok.vocab_size
    assert set(cfg.eos_token_ids) == set(tok.eos_token_ids)
    prompts = [torch.tensor(tok.encode("The lighthouse keeper climbed the stairs.")), torch.tensor(tok.encode("Hi"))]
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    torch.testing.assert_close(_our_logits(loaded.model, prompts), _hf_logits(ref, prompts), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# Tokenizer.

TEXTS = [
    "Hello world, café!",
    "  leading spaces and\ttabs\nand new lines  ",
    "Zürich → São Paulo: 42.195 km 🚆🚆, naïve 東京 ok",
    "",
    "<|eot_id|> looks special but sits inside text",
]


@pytest.fixture(scope="session")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def hf_tok(tiny_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip_and_transformers_parity(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok(text).input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
    if "<|" not in text:
        assert tok.decode(ids) == text


def test_tokenizer_ignores_truncation_settings(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_dir, tmp_path / "t")
    raw = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
    raw["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "t" / "tokenizer.json").write_text(json.dumps(raw))
    assert len(Tokenizer.from_dir(tmp_path / "t").encode("one two three four five six seven")) > 4


def test_tokenizer_special_ids(tok: Tokenizer) -> None:
    assert tok.bos_token_id == tok.token_to_id(BOS)
    assert tok.eos_token_ids == frozenset({tok.token_to_id(END_OF_TEXT), tok.token_to_id(EOT)})
    assert tok.vocab_size == 3072


def test_encode_does_not_double_bos(tok: Tokenizer) -> None:
    ids = tok.encode(BOS + "Hi there")
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids == tok.encode(BOS + "Hi there", add_special_tokens=False)


def test_bos_prepended_when_config_asks_and_post_processor_does_not(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_dir, tmp_path / "t")
    raw = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
    raw["post_processor"] = None
    (tmp_path / "t" / "tokenizer.json").write_text(json.dumps(raw))
    tok = Tokenizer.from_dir(tmp_path / "t")
    ids = tok.encode("Hi")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    config = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    assert tok.bos_token_id not in Tokenizer.from_dir(tmp_path / "t").encode("Hi")


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2 + 2?  "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, add_generation_prompt: bool) -> None:
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert ours.startswith(BOS + "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>")
    assert "What is 2 + 2?<|eot_id|>" in ours
    assert ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") == add_generation_prompt
    assert tok.encode(ours).count(tok.bos_token_id) == 1


def test_chat_template_rejects_unknown_role(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="no role named 'wizard'"):
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])


def _tok_with_config(tiny_dir: Path, dest: Path, **config: object) -> Tokenizer:
    shutil.copytree(tiny_dir, dest)
    (dest / "chat_template.jinja").unlink()
    raw = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**raw, **config}))
    return Tokenizer.from_dir(dest)


def test_chat_template_sources_and_helpers(tiny_dir: Path, tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
        "{{ bos_token }}|{{ strftime_now('%Y') | length }}"
    )
    inline = _tok_with_config(tiny_dir, tmp_path / "a", chat_template=template)
    assert inline.apply_chat_template([{"role": "user", "content": "<b>é</b>"}]) == '"<b>é</b>"' + BOS + "|4"
    named = _tok_with_config(
        tiny_dir,
        tmp_path / "b",
        chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    )
    assert named.apply_chat_template(MESSAGES) == "D"
    none = _tok_with_config(tiny_dir, tmp_path / "c")
    with pytest.raises(ValueError, match="no chat template"):
        none.apply_chat_template(MESSAGES)
    tools_template = "{% if tools is not none %}{{ tools | length }} tools{% else %}no tools{% endif %}"
    (tmp_path / "c" / "chat_template.json").write_text(json.dumps({"chat_template": tools_template}))
    legacy = Tokenizer.from_dir(tmp_path / "c")
    assert legacy.apply_chat_template(MESSAGES) == "no tools"  # `tools` is defined (None) as in transformers
    assert legacy.apply_chat_template(MESSAGES, tools=[{"name": "f"}]) == "1 tools"


@functools.cache
def _byte_token_ids(tok: Tokenizer) -> dict[int, int]:
    """Token id of each single byte, via the GPT-2 byte-to-unicode table byte-level BPE uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return {b: tok.token_to_id(c) for b, c in table.items()}


def test_detokenizer_holds_split_multibyte_character(tok: Tokenizer) -> None:
    byte_ids = _byte_token_ids(tok)
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(tok.encode("Price:", add_special_tokens=False)) == "Price:"
    euro = [byte_ids[b] for b in "€".encode()]
    assert detok.feed(euro[:1]) == ""
    assert detok.feed(euro[1:2]) == ""
    assert detok.feed(euro[2:]) == "€"
    assert detok.feed([byte_ids[0xE2]]) == ""  # an incomplete tail is never emitted as U+FFFD ...
    assert detok.text == "Price:€"
    assert detok.flush() == "\ufffd"  # ... until the stream ends
    assert detok.text == tok.decode(detok.token_ids)


@st.composite
def _token_streams(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Ids from real (multi-byte) text, raw byte tokens and arbitrary ids, and feed chunk sizes."""
    vocab = 3072
    pieces = draw(
        st.lists(
            st.one_of(
                st.text(alphabet=st.characters(codec="utf-8"), max_size=8).map(lambda s: ("text", s)),
                st.lists(st.integers(0, 255), max_size=4).map(lambda b: ("bytes", b)),
                st.lists(st.integers(0, vocab - 1), max_size=3).map(lambda i: ("ids", i)),
            ),
            max_size=8,
        )
    )
    chunks = draw(st.lists(st.integers(1, 4), min_size=1, max_size=50))
    return pieces, chunks


@settings(max_examples=100, deadline=None)
@given(stream=_token_streams(), skip=st.booleans())
def test_incremental_detokenizer_equals_full_decode(tok: Tokenizer, stream, skip: bool) -> None:
    pieces, chunks = stream
    byte_ids = _byte_token_ids(tok)
    ids: list[int] = []
    for kind, value in pieces:
        if kind == "text":
            ids += tok.encode(value, add_special_tokens=False)
        elif kind == "bytes":
            ids += [byte_ids[b] for b in value]
        else:
            ids += value
    full = tok.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pos, i = 0, 0
    while pos < len(ids):
        n = chunks[i % len(chunks)]
        new = detok.feed(ids[pos : pos + n])
        pos, i = pos + n, i + 1
        assert full.startswith(detok.text)
        if "\ufffd" not in full:
            assert "\ufffd" not in new
    detok.flush()
    assert detok.text == full


# ----------------------------------------------------------------------------------------------
# CUDA (`gpu` tests are skipped by conftest.py where there is no GPU).


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_logits_match_transformers(arch: str, tmp_path: Path) -> None:
    path = make_hf_checkpoint(arch, tmp_path / arch, seed=2, rope_scaling=LLAMA3_SCALING if arch == "llama" else None)
    prompts = _prompts([7, 45, 3], 3072)
    ref = _hf_logits(hf_model(path), prompts)
    fp32 = load_model(str(path), device="cuda", dtype="float32").model
    torch.testing.assert_close(_our_logits(fp32, prompts), ref, atol=2e-3, rtol=2e-3)
    bf16 = load_model(str(path), device="cuda", dtype="bfloat16").model
    assert (_our_logits(bf16, prompts) - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.gpu
def test_cuda_dummy_8b_is_allocated_once_in_bf16() -> None:
    cfg = preset_config("llama-3-8b")
    weights = cfg.num_params() * 2
    if torch.cuda.get_device_properties(0).total_memory < 1.3 * weights:
        pytest.skip("GPU too small for an 8B model in bf16")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = load_model("llama-3-8b", device="cuda")
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16  # the config's dtype on CUDA
    assert torch.cuda.max_memory_allocated() - base < weights * 1.02 + (64 << 20)  # no fp32 staging
    del loaded
    torch.cuda.empty_cache()
