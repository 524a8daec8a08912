"""The engine on CUDA: same tokens as on CPU, and a real-size preset with dummy weights runs."""

from __future__ import annotations

import pytest
import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from tests.test_engine import random_prompts, run

pytestmark = pytest.mark.gpu


def test_cuda_greedy_tokens_match_cpu():
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        core = EngineCore(
            EngineConfig(model="tiny", device=device, dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=64)
        )
        prompts = random_prompts(8, core.model_config.vocab_size, seed=3, hi=100)
        outs[device] = run(core, prompts, sampling)
    assert outs["cuda"] == outs["cpu"]


def test_dummy_preset_serves_on_cuda_in_bf16():
    core = EngineCore(
        EngineConfig(
            model="qwen3-0.6b", dummy_weights=True, device="cuda", max_model_len=2048, gpu_memory_utilization=0.5
        )
    )
    assert core.dtype == torch.bfloat16 and core.kv.num_blocks > 100
    prompts = random_prompts(16, core.model_config.vocab_size, seed=4, hi=300)
    out = run(core, prompts, SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True))
    assert all(len(tokens) == 8 for tokens in out.values())
    assert core.kv.num_free_blocks == core.kv.num_blocks
