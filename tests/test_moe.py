"""Mixture-of-experts models (Mixtral, Qwen3-MoE): the router and the grouped expert computation
against references, Hub-style checkpoints loaded and served token-exact against transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.model import ModelConfig, load_model, preset_config
from superinfer.engine.model.loader import PRESETS_DIR
from superinfer.engine.model.moe import grouped_experts, route
from tests.hf_fixtures import causal_logits, hf_greedy, hf_model, make_hf_checkpoint

transformers = pytest.importorskip("transformers")

# ----------------------------------------------------------------------------------------------
# The router and the grouped experts.


def per_token_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights, ids) -> torch.Tensor:
    """The definition, one token and one chosen expert at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].float() @ x[t].float()
            out[t] += weights[t, j].float() * (w2[e].float() @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 37])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_experts_equal_the_per_token_definition(num_tokens: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    experts, hidden, inter = 8, 24, 40
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / 5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / 5
    # Tokens route to experts 0..5 only, so some experts get no tokens at all.
    logits = torch.randn(num_tokens, experts, generator=gen)
    logits[:, 6:] = -1e9
    weights, ids = route(logits, top_k, renormalize=True)
    ours = grouped_experts(x, w13, w2, weights, ids)
    assert ours.shape == x.shape and ours.dtype == x.dtype
    torch.testing.assert_close(ours, per_token_experts(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_grouped_experts_in_bfloat16_stay_close_to_float32() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 32, generator=gen)
    w13, w2 = torch.randn(4, 96, 32, generator=gen) / 5, torch.randn(4, 32, 48, generator=gen) / 5
    weights, ids = route(torch.randn(16, 4, generator=gen), 2, renormalize=False)
    full = grouped_experts(x, w13, w2, weights, ids)
    half = grouped_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert half.dtype == torch.bfloat16
    assert (half.float() - full).abs().max() < 0.02 * full.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe-norm", "qwen3_moe-no-norm"])
def test_route_matches_transformers_routers(case: str, dtype: torch.dtype) -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    experts, hidden = 8, 32
    if case == "mixtral":
        hf_cfg = transformers.MixtralConfig(hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=2)
        router, renormalize, cast = MixtralTopKRouter(hf_cfg), True, False
    else:
        norm = case == "qwen3_moe-norm"
        hf_cfg = transformers.Qwen3MoeConfig(
            hidden_size=hidden, num_experts=experts, num_experts_per_tok=2, norm_topk_prob=norm
        )
        router, renormalize, cast = Qwen3MoeTopKRouter(hf_cfg), norm, True
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen))
    router = router.to(dtype)
    x = torch.randn(50, hidden, generator=gen).to(dtype)
    with torch.no_grad():
        _, ref_weights, ref_ids = router(x)
        weights, ids = route(F.linear(x, router.weight), 2, renormalize)
    if cast:  # what SparseMoE does for Qwen3-MoE
        weights = weights.to(dtype)
    assert torch.equal(ids, ref_ids)
    assert weights.dtype == ref_weights.dtype
    torch.testing.assert_close(weights, ref_weights, atol=0, rtol=0)
    if renormalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(50), atol=1e-2 if cast else 1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------
# Configs and checkpoints.

# Name -> (arch, make_hf_checkpoint options). Mixtral: top-2 of 4 experts; Qwen3-MoE: top-2 of 8.
CASES = {
    "mixtral": ("mixtral", {"shard": True}),
    "qwen3_moe-norm": ("qwen3_moe", {"shard": True, "norm_topk_prob": True}),
    "qwen3_moe-mlp-only": ("qwen3_moe", {"norm_topk_prob": False, "num_hidden_layers": 3, "mlp_only_layers": [1]}),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch, opts = CASES[request.param]
    path = make_hf_checkpoint(arch, tmp_path_factory.mktemp(request.param), seed=7, **opts)
    return request.param, path


def _tensor_names(path: Path) -> set[str]:
    names: set[str] = set()
    for f in path.glob("*.safetensors"):
        names |= set(load_file(f))
    return names


def test_checkpoints_are_per_expert_as_on_the_hub(checkpoint: tuple[str, Path]) -> None:
    """transformers 5 fuses the experts in memory (experts.gate_up_proj) but save_pretrained writes
    the Hub's per-expert names, the only ones the loader needs."""
    case, path = checkpoint
    names = _tensor_names(path)
    assert not any("gate_up_proj" in n for n in names)
    if case == "mixtral":
        assert {
            "model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.1.block_sparse_moe.experts.3.w2.weight",
        } <= names
    else:
        assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.7.up_proj.weight"} <= names
    if CASES[case][1].get("shard"):
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1


def test_config_and_parameter_count_match_transformers(checkpoint: tuple[str, Path]) -> None:
    case, path = checkpoint
    cfg = ModelConfig.from_dir(path)
    ref = hf_model(path)
    assert cfg.moe is not None and cfg.num_params() == sum(p.numel() for p in ref.parameters())
    assert cfg.moe.top_k == 2 and cfg.moe.num_experts == (4 if case == "mixtral" else 8)
    assert cfg.moe.renormalize == (case != "qwen3_moe-mlp-only")
    assert cfg.moe.dense_layers == ((1,) if case == "qwen3_moe-mlp-only" else ())
    ours = [hasattr(layer.mlp, "w13") for layer in load_model(str(path)).model.model.layers]
    assert ours == [hasattr(layer.mlp, "experts") for layer in ref.model.layers]  # MoE where transformers has it


def _raw(preset: str, **change: object) -> dict:
    raw = {**json.loads((PRESETS_DIR / f"{preset}.json").read_text()), **change}
    return {k: v for k, v in raw.items() if v is not None}


def test_config_moe_fields() -> None:
    mixtral = preset_config("mixtral-8x7b")
    assert mixtral.moe is not None and (mixtral.moe.num_experts, mixtral.moe.top_k) == (8, 2)
    assert mixtral.moe.intermediate_size == 14336 and mixtral.moe.renormalize and not mixtral.qk_norm
    qwen = preset_config("qwen3-30b-a3b")
    assert qwen.moe is not None and (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.intermediate_size) == (128, 8, 768)
    assert qwen.moe.renormalize and qwen.moe.weights_in_model_dtype and qwen.qk_norm
    assert qwen.num_active_params() + qwen.vocab_size * qwen.hidden_size == 3_353_032_704  # "3.3B activated"
    # transformers 5 writes num_local_experts where the Hub's config.json says num_experts.
    assert ModelConfig.from_dict(_raw("qwen3-30b-a3b", num_experts=None, num_local_experts=128)) == qwen
    assert ModelConfig.from_dict(_raw("qwen3-30b-a3b", norm_topk_prob=None)).moe.renormalize is False  # type: ignore[union-attr]
    sparse = ModelConfig.from_dict(
        _raw("qwen3-30b-a3b", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    )
    assert sparse.moe.dense_layers == (0, 2, 3, 4)  # type: ignore[union-attr]
    assert [sparse.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert ModelConfig.from_dict(_raw("qwen3-30b-a3b", num_experts=0)).moe is None  # every layer dense
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_dict(_raw("mixtral-8x7b", sliding_window=4096))


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    path = make_hf_checkpoint("mixtral", tmp_path / "m")
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight"):
        load_model(str(path))


def test_dummy_weights_fill_every_expert(checkpoint: tuple[str, Path]) -> None:
    _, path = checkpoint
    a = load_model(str(path), dummy=True, seed=3).model
    b = load_model(str(path), dummy=True, seed=3).model
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    moe = next(layer.mlp for layer in a.model.layers if hasattr(layer.mlp, "w13"))
    for w in (moe.w13, moe.w2, moe.gate.weight):
        assert 0.018 < w.std().item() < 0.022 and w.abs().max() < 0.2


# ----------------------------------------------------------------------------------------------
# Token-exact against transformers.


def test_logits_match_transformers(checkpoint: tuple[str, Path]) -> None:
    _, path = checkpoint
    ids = torch.randint(3, 3072, (33,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(path)(ids[None]).logits[0]
    ours = causal_logits(load_model(str(path)).model, ids)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def _prompts(n: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, 3072) for _ in range(rng.randint(3, 40))] for i in range(n)}


def _serve(path: Path, prompts: dict[str, list[int]], **config: object) -> dict[str, list[int]]:
    core = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", num_gpu_blocks=256, **config))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, greedy)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while core.has_work:
        for o in core.step():
            out[o.request_id] += o.token_ids
    return out


def test_engine_greedy_matches_transformers_batched_and_chunked(checkpoint: tuple[str, Path]) -> None:
    """Every prompt in one batch, then again with 16-token steps (chunked prefill beside decodes)."""
    case, path = checkpoint
    reference = hf_model(path)
    prompts = _prompts(4, seed=len(case))
    expected = {rid: hf_greedy(reference, prompt, 12) for rid, prompt in prompts.items()}
    assert _serve(path, prompts, block_size=4) == expected
    assert _serve(path, prompts, max_num_batched_tokens=16) == expected


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bfloat16_follows_transformers_in_bfloat16(arch: str, tmp_path: Path) -> None:
    """Against transformers in the same dtype: rounding can flip a near-tie in the router, and it
    must flip the same way (float32 logits can be further away than this)."""
    path = make_hf_checkpoint(arch, tmp_path / "m", seed=2)
    ids = torch.randint(3, 3072, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(path).bfloat16()(ids[None]).logits[0].float()
    ours = causal_logits(load_model(str(path), dtype="bfloat16").model, ids)
    assert (ours - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_logits_match_transformers(case: str, tmp_path: Path) -> None:
    arch, opts = CASES[case]
    path = make_hf_checkpoint(arch, tmp_path / case, seed=2, **opts)
    ids = torch.randint(3, 3072, (33,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(path)(ids[None]).logits[0]
    fp32 = causal_logits(load_model(str(path), device="cuda", dtype="float32").model, ids.cuda()).cpu()
    torch.testing.assert_close(fp32, ref, atol=2e-3, rtol=2e-3)
    bf16 = causal_logits(load_model(str(path), device="cuda", dtype="bfloat16").model, ids.cuda()).cpu()
    # Rounding can flip a router's near-tie for a token (transformers' own bf16 does on these
    # weights): that token's logits move a lot, the others stay close.
    error = (bf16 - ref).abs().amax(dim=-1)
    assert (error < 0.05 * ref.abs().max()).float().mean() >= 0.9, error
