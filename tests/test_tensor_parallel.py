"""Tensor parallelism: each rank's weights are its part of the one-device model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from superinfer.engine.model import ModelConfig, ensure_tiny_model, load_model, preset_config
from superinfer.engine.model.moe import grouped_experts, route
from superinfer.engine.model.sharding import TensorParallel, check_fits
from tests.hf_fixtures import make_hf_checkpoint


# --- the weights each rank holds (no processes) -------------------------------------------------
def _parts_equal_whole(spec: str, size: int, **load: object) -> None:
    whole = dict(load_model(spec, **load).model.checkpoint_tensors())
    for rank in range(size):
        shard = load_model(spec, tp=TensorParallel(rank, size), **load).model
        held = 0
        for t in shard.sharded_tensors():
            if t.view is None:
                continue
            held += 1
            part = t.part(whole[t.name])
            mine = t.view if t.shard is None else t.view.narrow(t.shard.dim, 0, t.shard.length)
            assert torch.equal(mine, part), f"rank {rank}: {t.name}"
            if t.shard is not None and t.view.shape[t.shard.dim] > t.shard.length:  # vocabulary padding
                padding = t.view.narrow(t.shard.dim, t.shard.length, t.view.shape[t.shard.dim] - t.shard.length)
                assert not padding.any()
        assert held


@pytest.mark.parametrize("size", [2, 4])  # 4 ranks: one query head each, the 2 KV heads replicated
@pytest.mark.parametrize("dummy", [False, True], ids=["checkpoint", "dummy"])
def test_each_rank_holds_its_part_of_the_tiny_model(size: int, dummy: bool) -> None:
    _parts_equal_whole("tiny", size, dummy=dummy)


def test_each_rank_holds_its_experts_and_a_padded_vocabulary(tmp_path: Path) -> None:
    path = make_hf_checkpoint("qwen3_moe", tmp_path / "m", seed=3, vocab_size=3075)  # 3075 = 2 x 1538 - 1
    _parts_equal_whole(str(path), 2)
    _parts_equal_whole(str(path), 2, dummy=True)
    shard = load_model(str(path), tp=TensorParallel(1, 2)).model
    assert shard.model.layers[0].mlp.w13.shape[0] == 4  # 8 experts, whole
    assert shard.lm_head.weight.shape[0] == 1538


def test_kv_heads_follow_the_query_heads() -> None:
    cfg = preset_config("llama-3-8b")  # 32 query heads, 8 KV heads
    for size, expected in ((2, [(0, 4), (4, 4)]), (16, [(r // 2, 1) for r in range(16)])):
        shards = [TensorParallel(r, size).kv_heads(cfg.num_kv_heads) for r in range(size)]
        assert [(s.start, s.length) for s in shards] == expected
        group = cfg.num_heads // cfg.num_kv_heads
        for r, s in enumerate(shards):  # every query head of the rank reads one of its KV heads
            q = TensorParallel(r, size).split(cfg.num_heads)
            assert {h // group for h in range(q.start, q.start + q.length)} <= set(range(s.start, s.start + s.length))


def test_experts_split_over_ranks_add_up_to_all_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(21, 16, generator=gen)
    w13, w2 = torch.randn(6, 40, 16, generator=gen) / 4, torch.randn(6, 16, 20, generator=gen) / 4
    weights, ids = route(torch.randn(21, 6, generator=gen), 2, renormalize=True)
    split = sum(grouped_experts(x, w13[e : e + 2], w2[e : e + 2], weights, ids, first=e) for e in (0, 2, 4))
    torch.testing.assert_close(split, grouped_experts(x, w13, w2, weights, ids), atol=1e-6, rtol=1e-5)


def test_a_model_that_cannot_be_split_names_the_fields() -> None:
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by 3") as err:
        check_fits(ModelConfig.from_dir(ensure_tiny_model()), 3)
    assert "num_key_value_heads 2" in str(err.value) and "intermediate_size 688" in str(err.value)
    with pytest.raises(ValueError, match=r"num_experts 8 .* not divisible by 3"):
        check_fits(preset_config("mixtral-8x7b"), 3)
