"""The engine on CUDA: same tokens as on CPU, and a real-size preset with dummy weights runs."""

from __future__ import annotations

import pytest
import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from tests.test_async_scheduling import PROMPTS, mixed_sampling_params, run_all
from tests.test_engine import random_prompts, run

pytestmark = pytest.mark.gpu


def test_cuda_greedy_tokens_match_cpu():
    """On CUDA the decode steps replay CUDA graphs (Triton attention): the CPU's greedy tokens."""
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        core = EngineCore(
            EngineConfig(model="tiny", device=device, dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=64)
        )
        prompts = random_prompts(8, core.model_config.vocab_size, seed=3, hi=100)
        outs[device] = run(core, prompts, sampling)
    assert outs["cuda"] == outs["cpu"]
    assert core.runner.graphs is not None and core.runner.graphs.replays >= 15  # the decode steps
    layer = core.runner.model.model.layers[0]  # on the fused kernels, in and out of the graphs
    assert layer.input_layernorm.kernels is not None
    assert layer.mlp.act.__module__.endswith("silu_mul") and layer.self_attn.rope.__module__.endswith("rope")


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


def rotating_cuda_engine(async_scheduling: bool, kv_copy_method: str = "auto") -> EngineCore:
    """The rotary policy with a tiny GPU pool: KV moves over the copy streams every few steps."""
    return EngineCore(
        EngineConfig(
            model="tiny",
            device="cuda",
            dtype="float32",
            policy="rotary",
            num_gpu_blocks=20,
            num_cpu_blocks=400,
            transfer_budget_blocks=16,
            async_scheduling=async_scheduling,
            kv_copy_method=kv_copy_method,
        )
    )


@pytest.mark.parametrize(
    ("async_scheduling", "kv_copy_method"),
    [(False, "auto"), (True, "auto"), (True, "runs"), (True, "kernel"), (True, "batch")],
    ids=["sync", "async-scheduling", "async-runs", "async-kernel", "async-batch"],
)
def test_rotation_on_cuda_streams_keeps_greedy_tokens(async_scheduling, kv_copy_method):
    """Rotary policy with a tiny GPU pool: KV moves over the two copy streams (pinned CPU tier)
    while steps run, with and without async scheduling, by each copy method; tokens equal the CPU
    run without pressure."""
    sampling = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = random_prompts(10, 2000, seed=9, lo=10, hi=50)
    cpu = EngineCore(EngineConfig(model="tiny", device="cpu", dtype="float32", num_gpu_blocks=256))
    reference = run(cpu, prompts, sampling)
    core = rotating_cuda_engine(async_scheduling, kv_copy_method)
    assert core.runner.duplex.cpu.is_pinned()
    if kv_copy_method != "auto":
        assert core.runner.duplex.methods == {"out": kv_copy_method, "in": kv_copy_method}
    assert run(core, prompts, sampling) == reference
    assert core.scheduler.counters.rotations > 0  # how many depends on step times (4 with CUDA graphs on an H100)
    assert core.kv.pool.num_free == core.kv.num_blocks and core.kv.cpu.num_free == core.kv.cpu.num_blocks


def test_submitting_a_step_never_waits_for_the_device(monkeypatch):
    """Submitting a step only queues work: no host sync (penalties, seeds, top-k/top-p, logprobs,
    rotations over the copy streams, async scheduling). Only `collect` waits, for the sampled
    tokens. (Steps under a grammar sync by design: the matchers need the token.)"""
    core = rotating_cuda_engine(async_scheduling=True)
    submit = core.runner.submit

    def submit_without_sync(plan):
        torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
        try:
            return submit(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(core.runner, "submit", submit_without_sync)
    sampling = SamplingParams(
        max_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=7, presence_penalty=0.5, logprobs=2, ignore_eos=True
    )
    out = run(core, random_prompts(10, core.model_config.vocab_size, seed=9, lo=10, hi=50), sampling)
    assert all(len(tokens) == 30 for tokens in out.values())
    assert core.scheduler.counters.rotations > 5


def test_async_scheduling_on_cuda_matches_sync():
    """Stops the scheduler cannot foresee, seeds, logprobs: the pipelined CUDA engine equals the synchronous one."""
    outs = {}
    for mode in (False, True):
        core = EngineCore(
            EngineConfig(model="tiny", device="cuda", dtype="float32", num_gpu_blocks=14, async_scheduling=mode)
        )
        outs[mode] = run_all(core, PROMPTS, mixed_sampling_params())
    for rid, (tokens, text, logprobs, reason) in outs[False].items():
        assert outs[True][rid][0] == tokens and outs[True][rid][1] == text and outs[True][rid][3] == reason
        assert [v for _, v in outs[True][rid][2]] == pytest.approx([v for _, v in logprobs], abs=1e-4)


@pytest.mark.parametrize("method", ["kernel", "batch"])
def test_copy_methods_cross_the_pinned_tiers_registrations_exactly(monkeypatch, method: str):
    """The kernel reads and writes the pinned tier in place (unified addressing), the batch call
    moves runs: both exact across slab boundaries, in both directions."""
    from superinfer.engine.worker import host_memory
    from superinfer.engine.worker.copy_methods import COPIERS

    block = 1 << 20
    monkeypatch.setattr(host_memory, "SLAB_BYTES", 3 * block)
    tier = host_memory.host_tensor(9 * block, pin=True, align=block).view(9, block)
    src = torch.randint(0, 256, (9, block), dtype=torch.uint8, device="cuda")
    pairs = [(0, 8), (1, 2), (2, 3), (3, 4), (7, 0), (8, 5)]  # runs across slabs 0|1 and 1|2
    copier, side = COPIERS[method], torch.cuda.Stream()
    with torch.cuda.stream(side):
        copier(src, tier, pairs, 0, 3)
        back = torch.zeros_like(src)
        copier(tier, back, [(d, s) for s, d in pairs], 3, 0)
    side.synchronize()
    for s, d in pairs:
        assert torch.equal(tier[d], src[s].cpu()) and torch.equal(back[s], src[s])
    assert not back[[4, 5, 6]].any()


def test_copy_probe_times_each_method_and_keeps_the_fastest():
    from superinfer.engine.worker import host_memory
    from superinfer.engine.worker.copy_methods import METHODS, probe

    shape = (2, 2, 16, 2, 64)  # layers, K|V, block tokens, KV heads, head dim
    gpu = torch.zeros(100, *shape, dtype=torch.bfloat16, device="cuda")
    block = gpu[0].nbytes
    cpu = host_memory.host_tensor(200 * block, pin=True, align=block).view(torch.bfloat16).view(200, *shape)
    chosen, report = probe(gpu, cpu, host_memory.slab_bytes(block) // block)
    for direction in ("out", "in"):
        assert set(report[direction]) == set(METHODS)
        timed = {m: t for m, t in report[direction].items() if isinstance(t, float)}
        assert "runs" in timed and chosen[direction] == min(timed, key=timed.__getitem__)
    assert not gpu.any() and not cpu.any()  # the probe's blocks are zeroed again


def test_pinned_cpu_tier_takes_exactly_its_size(monkeypatch):
    """The CPU tier is not torch's pinned allocator (which rounds up to a power of two): it pins
    exactly its blocks, registered in slabs, and runs of blocks across slab boundaries copy exactly."""
    from superinfer.engine.worker import host_memory
    from superinfer.engine.worker.copy_methods import copy_runs

    block = 2 << 20
    monkeypatch.setattr(host_memory, "SLAB_BYTES", 3 * block)  # three blocks per slab
    allocated = torch.cuda.host_memory_stats().get("allocated_bytes.allocated", 0)
    n = 9 * block  # not a power of two
    cpu = host_memory.host_tensor(n, pin=True, align=block)
    assert cpu.nbytes == n and cpu.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.allocated", 0) == allocated
    # One copy may not span two registrations (CUDA refuses it): a run of all 9 blocks goes as 3.
    boundary = host_memory.slab_bytes(block) // block
    assert boundary == 3
    tier, src = cpu.view(9, block), torch.randint(0, 256, (9, block), dtype=torch.uint8, device="cuda")
    pairs = [(i, i) for i in range(9)]
    assert copy_runs(src, tier, pairs, dst_boundary=boundary) == 3
    back = torch.empty_like(src)
    assert copy_runs(tier, back, pairs, src_boundary=boundary) == 3
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    del cpu  # unregisters every slab; a second tensor over fresh memory pins again
    assert host_memory.host_tensor(n, pin=True, align=block).is_pinned()


def test_engine_cpu_tier_on_cuda_is_pinned_at_the_requested_size():
    gib = 0.0123  # no power of two
    core = EngineCore(
        EngineConfig(model="tiny", device="cuda", dtype="float32", policy="rotary", num_gpu_blocks=20, cpu_kv_gib=gib)
    )
    tier = core.runner.duplex.cpu
    assert core.kv.cpu.num_blocks == int(gib * (1 << 30)) // core.block_bytes
    assert tier.nbytes == core.kv.cpu.num_blocks * core.block_bytes and tier.is_pinned()


@pytest.mark.parametrize("mode", ["full", "half", "serial"])
def test_happens_before_on_cuda_streams_the_duplex_modes_leave_the_serial_kv(mode: str):
    """The recorded CPU trace of tests/test_happens_before.py on real CUDA streams: every duplex
    mode, with async scheduling, gives the serial executor's tokens and leaves bitwise the same KV
    in both tiers as `--duplex serial` (the plans are the same; only the copies' overlap differs)."""
    from tests.test_happens_before import BURST, serve

    cuda = {"device": "cuda", "num_gpu_blocks": 20, "async_scheduling": True}
    tokens, core = serve(BURST, **cuda, duplex=mode)
    baseline_tokens, baseline = serve(BURST, **cuda, duplex="serial")
    serial_cpu, _ = serve(BURST, async_scheduling=False, duplex="serial", num_gpu_blocks=20)
    assert core.scheduler.counters.rotations > 0
    assert tokens == baseline_tokens == serial_cpu
    torch.cuda.synchronize()
    assert torch.equal(core.runner.kv_cache, baseline.runner.kv_cache)
    assert torch.equal(core.runner.duplex.cpu, baseline.runner.duplex.cpu)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sampling_controls_and_grammars_on_cuda_match_cpu(async_scheduling):
    """Penalties, logit_bias, prompt logprobs and grammar masks (packed on the host, unpacked on
    the device) give the CPU's tokens on CUDA, with async scheduling too."""
    import json

    from superinfer.engine.output_constraint import GuidedSpec

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    sampling = {
        "penalized": SamplingParams(
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
            presence_penalty=1.0,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
            logit_bias=((5, 3.0),),
        ),
        "scored": SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1),
        "json": SamplingParams(max_tokens=64, temperature=0, guided=GuidedSpec.for_json_schema(schema)),
    }
    outs = {}
    for device in ("cpu", "cuda"):
        core = EngineCore(
            EngineConfig(
                model="tiny",
                device=device,
                dtype="float32",
                num_gpu_blocks=256,
                async_scheduling=async_scheduling if device == "cuda" else False,
            )
        )
        prompts = random_prompts(3, core.model_config.vocab_size, seed=6, lo=10, hi=30)
        outs[device] = run(core, dict(zip(sampling, prompts.values(), strict=True)), sampling)
    assert outs["cuda"] == outs["cpu"]
    text = core.tokenizer.decode(outs["cuda"]["json"])
    assert isinstance(json.loads(text)["n"], int)
