"""The Triton kernels against their torch references, and the engine on them.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here
before any kernel module is imported: triton.jit reads it), on tiny shapes; with CUDA the same
tests run compiled, and the `gpu` tests add Llama-3-8B shapes. Without triton the module skips.
"""

# ruff: noqa: E402 (TRITON_INTERPRET must be set before the kernel modules are imported)
from __future__ import annotations

import gc
import os

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import random
import subprocess
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


triton = pytest.importorskip("triton")
if not GPU and _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4):
    pytest.skip("Triton < 3.7's interpreter fails with numpy >= 2.4: upgrade triton", allow_module_level=True)

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.worker.attention import SeqSpan, torch_attention
from superinfer.engine.worker.attention_backend import attention_backend
from superinfer.engine.worker.copy_methods import copy_kernel
from superinfer.engine.worker.duplex import DuplexKV
from superinfer.engine.worker.triton_attention import TritonPagedAttention, token_slots
from superinfer.kernels.block_copy import copy_blocks_reference, gather_blocks, scatter_blocks
from superinfer.kernels.common import cdiv, next_pow2
from superinfer.kernels.kv_write import kv_write, kv_write_reference
from superinfer.kernels.paged_decode import BLOCK_N, DecodeBatch, paged_decode, paged_decode_reference
from superinfer.kernels.paged_prefill import BLOCK_N as PREFILL_BLOCK_N
from superinfer.kernels.paged_prefill import ExtendBatch, paged_prefill, paged_prefill_reference

DEVICE = torch.device("cuda" if GPU else "cpu")
LAYERS = 2
# bf16 through the interpreter only via the kernels' fp32 upcast (its bf16 tl.dot is wrong).
DTYPES = [torch.float32, torch.float16]
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 3e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass
class Paged:
    """A cache holding some sequences in shuffled, scattered blocks."""

    cache: torch.Tensor
    block_ids: list[list[int]]
    contexts: list[int]


def paged(
    contexts: Sequence[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    poison: bool = True,
) -> Paged:
    """With `poison` every slot the sequences do not own (unused blocks, the tails of their last
    blocks) is NaN, so a kernel that reads one fails; else it holds stale random values."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(c, block_size) for c in contexts) + 3
    shape = (num_blocks, LAYERS, 2, block_size, kv_heads, head_dim)
    cache = torch.full(shape, float("nan")) if poison else torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_ids = []
    for c in contexts:
        ids = [order.pop() for _ in range(cdiv(c, block_size))]
        for i, b in enumerate(ids):
            used = min(block_size, c - i * block_size)
            cache[b, :, :, :used] = torch.randn(LAYERS, 2, used, kv_heads, head_dim, generator=gen)
        block_ids.append(ids)
    return Paged(cache.to(DEVICE, dtype), block_ids, list(contexts))


def queries(rows: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """[rows, heads, head_dim], a non-contiguous view (as q is, split from a fused projection)."""
    wide = torch.randn(rows, heads + 3, head_dim, generator=torch.Generator().manual_seed(seed))
    return wide.to(DEVICE, dtype)[:, 1 : heads + 1]


def close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCE[dtype])


# Block boundaries (k * 16 and +-1), one key, and past one BLOCK_N tile.
DECODE_CONTEXTS = [1, 15, 16, 17, 31, 33, 2 * BLOCK_N + 3]


@pytest.mark.parametrize("split_keys", [None, BLOCK_N], ids=["whole", "split"])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(dtype: torch.dtype, group: int, split_keys: int | None) -> None:
    kv_heads, head_dim, block_size = 2, 64, 16
    p = paged(DECODE_CONTEXTS, block_size, kv_heads, head_dim, dtype)
    q = queries(len(DECODE_CONTEXTS) + 2, group * kv_heads, head_dim, dtype)
    rows = random.Random(group).sample(range(q.shape[0]), len(DECODE_CONTEXTS))  # rows anywhere in the step
    batch = DecodeBatch.build(rows, p.contexts, p.block_ids, block_size, DEVICE, kv_heads, split_keys)
    assert (batch.max_context > batch.split_keys) == (split_keys is not None)
    out = torch.full(q.shape, 7.0, dtype=dtype, device=DEVICE)
    paged_decode(q, p.cache, 1, batch, 0.125, out=out)
    want = paged_decode_reference(q, p.cache, 1, rows, p.contexts, p.block_ids, 0.125)
    close(out[rows], want, dtype)
    untouched = sorted(set(range(q.shape[0])) - set(rows))
    assert (out[untouched] == 7.0).all()


@pytest.mark.parametrize(
    ("block_size", "head_dim", "dtype"),
    [(1, 64, torch.float32), (32, 128, torch.float16), (16, 80, torch.float32), (16, 64, torch.bfloat16)],
    ids=["block1", "block32-dim128", "dim80", "bf16"],
)
def test_decode_block_sizes_and_head_dims(block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    # The longest has 18 splits: the reduction takes them 16 at a time.
    contexts = [1, block_size, block_size + 1, 3 * block_size - 1, 17 * BLOCK_N + 5]
    p = paged(contexts, block_size, 1, head_dim, dtype, seed=2)
    late = p.block_ids[-1][16 * BLOCK_N // block_size :]
    p.cache[late, 0, 0] *= 4  # larger scores in the last splits: the reduction must rescale
    q = queries(len(contexts), 4, head_dim, dtype)
    rows = list(range(len(contexts)))
    batch = DecodeBatch.build(rows, contexts, p.block_ids, block_size, DEVICE, 1, BLOCK_N)
    out = paged_decode(q, p.cache, 0, batch, head_dim**-0.5)
    close(out, paged_decode_reference(q, p.cache, 0, rows, contexts, p.block_ids, head_dim**-0.5), dtype)


# (new tokens, context): first chunks at block boundaries, continued chunks (prefix hits, chunked
# prefill) whose earlier keys fill whole BLOCK_N tiles, and decodes as 1-token extends.
EXTENDS = [(16, 16), (17, 17), (5, 37), (1, 33), (40, 2 * PREFILL_BLOCK_N + 1), (1, 1), (15, PREFILL_BLOCK_N + 15)]


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(dtype: torch.dtype, group: int) -> None:
    kv_heads, head_dim, block_size = 2, 64, 16
    lens, contexts = [n for n, _ in EXTENDS], [c for _, c in EXTENDS]
    p = paged(contexts, block_size, kv_heads, head_dim, dtype)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    q = queries(sum(lens), group * kv_heads, head_dim, dtype)
    batch = ExtendBatch.build(starts, lens, contexts, p.block_ids, block_size, group, DEVICE)
    out = paged_prefill(q, p.cache, 1, batch, 0.125)
    close(out, paged_prefill_reference(q, p.cache, 1, starts, lens, contexts, p.block_ids, 0.125), dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16], ids=str)
def test_kv_write_is_exact(dtype: torch.dtype) -> None:
    cache = torch.randn(9, LAYERS, 2, 4, 2, 64).to(DEVICE, dtype)
    qkv = torch.randn(21, 7, 64).to(DEVICE, dtype)  # k and v as views of a fused projection
    k, v = qkv[:, 3:5], qkv[:, 5:7]
    slots = torch.randperm(36)[:21].to(torch.int32)
    slots[[2, 11]] = -1  # not written
    slots = slots.to(DEVICE)
    want = cache.clone()
    kv_write(cache, 1, k, v, slots)
    kv_write_reference(want, 1, k, v, slots.long())
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16], ids=str)
def test_block_gather_and_scatter_are_exact(dtype: torch.dtype) -> None:
    # 9216 elements a block: two whole 4096-element chunks and a partial one.
    cache = torch.randn(12, LAYERS, 2, 16, 2, 72).to(DEVICE, dtype)
    ids = torch.tensor([9, 2, 7, 3, 11], dtype=torch.int32, device=DEVICE)
    staging = torch.zeros(8, *cache.shape[1:], dtype=dtype, device=DEVICE)
    assert torch.equal(gather_blocks(cache, ids, staging), cache[ids.long()])
    assert not staging[5:].any()
    target, want = cache.clone(), cache.clone()
    back = staging[:5].flip(0).contiguous()
    scatter_blocks(back, target, ids)
    copy_blocks_reference(back, want, dst_ids=ids.long())
    assert torch.equal(target, want)


def test_the_kernel_copy_method_moves_block_pairs_within_each_registration() -> None:
    """DuplexKV's `kernel` method: one launch per pair of registrations (3 blocks each on the
    tier's side), every pair exact, nothing else written; the other direction runs as runs."""
    gpu = torch.randn(10, LAYERS, 2, 16, 2, 72, device=DEVICE)
    cpu = torch.zeros(9, *gpu.shape[1:], pin_memory=GPU)
    out = [(0, 8), (1, 2), (2, 3), (3, 4), (7, 0), (9, 5)]
    back = [(8, 9), (2, 1), (0, 6)]
    want_cpu = cpu.clone()
    for s, d in out:
        want_cpu[d] = gpu[s].cpu()
    want_gpu = gpu.clone()
    for s, d in back:
        want_gpu[d] = want_cpu[s].to(DEVICE)
    assert copy_kernel(gpu, cpu, out, 0, 3) == 3  # tier slabs 2, 0, 1
    if GPU:
        torch.cuda.synchronize()
    assert torch.equal(cpu, want_cpu)
    cpu.zero_()
    duplex = DuplexKV(gpu, cpu, methods={"out": "kernel"})
    assert duplex.methods == {"out": "kernel", "in": "runs"}
    duplex.boundary = 3  # as for a pinned tier of three-block registrations
    duplex.finish(duplex.start(StepPlan(step_id=1, seqs=[], swap_out=out)))
    duplex.finish(duplex.start(StepPlan(step_id=2, seqs=[], swap_in=back)))
    if GPU:
        torch.cuda.synchronize()
    assert torch.equal(cpu, want_cpu) and torch.equal(gpu, want_gpu)


def _mixed_step(block_size: int, group: int, seed: int) -> tuple[list[SeqSpan], Paged]:
    """A step of first chunks, continued chunks and decodes in shuffled rows, over a cache that
    already holds each sequence's earlier keys."""
    rng = random.Random(seed)
    kinds = [(16, 16), (3, 20), (1, 17), (1, 40), (9, 9), (1, 2), (24, 90)]
    rng.shuffle(kinds)
    p = paged([c for _, c in kinds], block_size, 2, 64, torch.float32, seed, poison=False)  # torch reads stale slots
    spans, row = [], 0
    for (n, c), ids in zip(kinds, p.block_ids, strict=True):
        spans.append(SeqSpan(row, n, c, ids))
        row += n
    return spans, p


@pytest.mark.parametrize("group", [1, 2])
def test_triton_step_matches_torch_backend(group: int) -> None:
    """The whole backend: KV write, decodes and extends in one step, against the torch backend."""
    spans, p = _mixed_step(16, group, seed=group)
    rows = sum(s.num_tokens for s in spans)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(rows, h, 64, generator=gen).to(DEVICE) for h in (2 * group, 2, 2))
    ours, theirs = p.cache.clone(), p.cache.clone()
    triton_attn = TritonPagedAttention.for_step(spans, ours, 0.125)
    torch_attn = torch_attention(spans, theirs, 0.125)
    for layer in range(LAYERS):
        args = (q * (layer + 1), k + layer, v - layer)
        close(triton_attn(layer, *args), torch_attn(layer, *args), torch.float32)
    assert torch.equal(ours, theirs)


def test_next_pow2_is_tritons() -> None:
    assert [next_pow2(n) for n in range(5000)] == [triton.next_power_of_2(n) for n in range(5000)]


def test_token_slots() -> None:
    spans = [SeqSpan(0, 3, 5, [4, 9]), SeqSpan(3, 1, 1, [7])]
    want = [4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0, 7 * 4 + 0]
    assert token_slots(spans, 4) == want
    as_arrays = [SeqSpan(s.row, s.num_tokens, s.context, np.asarray(s.block_ids, np.int32)) for s in spans]
    slots = token_slots(as_arrays, 4)  # what the runner gives the Triton backend (block_rows.py)
    assert slots == want and all(type(v) is int for v in slots)


def test_backend_choice() -> None:
    cache = torch.zeros((2, 1, 2, 16, 2, 64), device=DEVICE)
    assert attention_backend("triton", cache, 4)[0] == "triton"
    assert attention_backend("torch", cache, 4)[0] == "torch"
    assert attention_backend("auto", cache, 4)[0] == ("triton" if GPU else "cpu")


def _engine(backend: str, **config: object) -> EngineCore:
    core = EngineCore(
        EngineConfig(
            model="tiny",
            device=str(DEVICE),
            dtype="float32",
            block_size=8,
            num_gpu_blocks=16,
            max_model_len=64,
            attention_backend=backend,
            **config,
        )
    )
    assert core.runner.attention_backend == backend
    return core


def _greedy(core: EngineCore, prompts: list[list[int]], tokens: Sequence[int]) -> list[list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, tokens, strict=True)):
        core.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out: list[list[int]] = [[] for _ in prompts]
    while core.has_work:
        for o in core.step():
            out[int(o.request_id)] += o.token_ids
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_warm_up_step_before_serving_changes_no_token(async_scheduling: bool) -> None:
    """The runner's warm-up step (run at startup on CUDA) writes KV into free blocks and samples
    for requests of its own: what is served after it is what is served without it."""
    prompts, tokens = [[5, 17, 42, 9, 77, 31, 8, 100, 3], [250, 11, 6, 1000]], [6, 9]
    warmed = _engine("triton", async_scheduling=async_scheduling)
    warmed.runner.warm_up()
    assert _greedy(warmed, prompts, tokens) == _greedy(
        _engine("triton", async_scheduling=async_scheduling), prompts, tokens
    )


def test_engine_greedy_tokens_match_torch_backend() -> None:
    """The tiny model (4 layers, GQA 2, head_dim 64) on the Triton kernels: prefill across a block
    boundary, then decodes crossing the next one; the same greedy tokens as the torch backend."""
    prompts = [[5, 17, 42, 9, 77, 31, 8, 100, 3], [250, 11, 6, 1000]]
    triton_tokens = _greedy(_engine("triton"), prompts, [6, 6])
    assert triton_tokens == _greedy(_engine("torch"), prompts, [6, 6])
    assert all(len(t) == 6 for t in triton_tokens)


def test_engine_on_the_fused_kernels_gives_the_op_by_op_tokens() -> None:
    """The fused norm, activation and RoPE kernels in the engine (the runner turns them on with the
    Triton backend on CUDA; here they are turned on by hand): prompt chunks beside decodes, the
    greedy tokens of the torch backend's op-by-op model."""
    from superinfer.engine.model.decoder import FusedKernels
    from superinfer.kernels.rms_norm import add_rms_norm, rms_norm
    from superinfer.kernels.rope import rope
    from superinfer.kernels.silu_mul import silu_mul

    prompts = [[5, 17, 42, 9, 77, 31, 8, 100, 3], [250, 11, 6, 1000], [7, 8, 9, 10, 11, 12, 13]]
    fused = _engine("triton", max_num_batched_tokens=8)
    fused.runner.model.use_kernels(FusedKernels(rms_norm, add_rms_norm, silu_mul, rope))
    assert _greedy(fused, prompts, [5, 7, 4]) == _greedy(_engine("torch"), prompts, [5, 7, 4])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decode_graphs_give_the_op_by_op_tokens(async_scheduling: bool) -> None:
    """Decode steps through the CUDA graphs' static buffers (replayed on CUDA; without CUDA the same
    buffers run op by op): padded rows, a batch larger than the largest graph (op by op), requests
    finishing at different steps, tokens the previous step samples (async scheduling); the tokens
    of op-by-op steps."""
    from superinfer.engine.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes

    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert graph_batch_sizes(4096)[-1] == 512
    prompts = [[5, 17, 42, 9, 77, 31, 8, 100, 3], [250, 11, 6, 1000], [7, 8], [300, 301, 302, 303, 304], [9]]
    tokens = [6, 9, 3, 7, 5]
    core = _engine("triton", async_scheduling=async_scheduling)
    with torch.inference_mode():
        runner = core.runner
        graphs = runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.scale, 64, [1, 2, 4])
    out = _greedy(core, prompts, tokens)
    eager = _engine("triton", enforce_eager=True)
    assert out == _greedy(eager, prompts, tokens)
    assert [len(t) for t in out] == tokens
    assert 0 < graphs.replays < max(tokens)  # five rows ran op by op
    replays = graphs.replays
    one = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]  # a step of one sequence's prompt is no decode
    assert _greedy(core, one, [4]) == _greedy(eager, one, [4])
    assert graphs.replays == replays + 3


@pytest.mark.parametrize(
    ("async_scheduling", "fused"), [(False, False), (True, False), (False, True)], ids=["sync", "async", "fused"]
)
def test_piecewise_graphs_give_the_op_by_op_tokens(async_scheduling: bool, fused: bool, monkeypatch) -> None:
    """Steps through the piecewise graphs' static buffers (replayed on CUDA; without CUDA the same
    pieces run op by op): prompt chunks beside decodes and decode batches past the decode graphs,
    padded to 4 or 8 tokens; steps past 8 tokens op by op; the tokens of op-by-op steps. `fused`:
    with the fused norm, activation and RoPE kernels in both engines, as the runner has them on CUDA
    (the pieces then run them on the buffers' rows)."""
    from superinfer.engine.model.decoder import FusedKernels
    from superinfer.engine.worker.cuda_graphs import DecodeGraphs
    from superinfer.engine.worker.piecewise_graphs import PiecewiseGraphs, graph_token_counts
    from superinfer.kernels.rms_norm import add_rms_norm, rms_norm
    from superinfer.kernels.rope import rope
    from superinfer.kernels.silu_mul import silu_mul

    assert graph_token_counts(100) == [16, 32, 64, 100]
    assert graph_token_counts(2048)[-1] == 2048 and graph_token_counts(100_000)[-1] == 8192
    steps: list[tuple[int, bool, bool]] = []  # (tokens, through the pieces, with prompt tokens)
    run = PiecewiseGraphs.run

    def counted(
        self: PiecewiseGraphs, input_ids: torch.Tensor, positions: Sequence[int], attn: TritonPagedAttention
    ) -> torch.Tensor | None:
        hidden = run(self, input_ids, positions, attn)
        steps.append((len(positions), hidden is not None, bool(attn.extend_spans)))
        return hidden

    monkeypatch.setattr(PiecewiseGraphs, "run", counted)
    prompts = [[5, 17, 42, 9, 77, 31, 8, 100, 3], [250, 11, 6, 1000], [7, 8], list(range(300, 320)), [9]]
    tokens = [6, 9, 3, 7, 5]
    core = _engine("triton", async_scheduling=async_scheduling, max_num_batched_tokens=12)
    eager = _engine("triton", enforce_eager=True, max_num_batched_tokens=12)
    if fused:
        for engine in (core, eager):
            engine.runner.model.use_kernels(FusedKernels(rms_norm, add_rms_norm, silu_mul, rope))
    with torch.inference_mode():
        runner = core.runner
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.scale, 64, [1, 2])
        runner.piecewise = PiecewiseGraphs(runner.model, [4, 8], DEVICE, runner.graphs.pool)  # (as the runner)
    assert _greedy(core, prompts, tokens) == _greedy(eager, prompts, tokens)
    assert any(piece and prompt for _, piece, prompt in steps)  # a prompt chunk through the pieces
    assert any(piece and not prompt for _, piece, prompt in steps)  # decode rows past the decode graphs'
    assert all(piece == (n <= 8) for n, piece, _ in steps) and any(n > 8 for n, _, _ in steps)


def test_dropped_graphs_free_their_buffers_without_a_garbage_collection() -> None:
    """The decode and piecewise graphs hold no reference cycle: dropping them frees their buffers
    (on CUDA, their device memory) at once, also where the serving processes froze the collector."""
    from superinfer.engine.worker.cuda_graphs import DecodeGraphs
    from superinfer.engine.worker.piecewise_graphs import PiecewiseGraphs

    runner = _engine("triton").runner
    with torch.inference_mode():
        decode = DecodeGraphs(runner.model, runner.kv_cache, runner.scale, 64, [1, 2])
        piecewise = PiecewiseGraphs(runner.model, [4, 8], DEVICE, decode.pool)
    buffers = [weakref.ref(decode.input_ids), weakref.ref(piecewise.q), weakref.ref(piecewise.hidden)]
    gc.disable()
    try:
        del decode, piecewise
        assert [buffer() for buffer in buffers] == [None, None, None]
    finally:
        gc.enable()


def test_kernels_compile_for_a_gpu_without_one(tmp_path) -> None:
    """The engine's launches (bf16, Llama-3-8B heads) compiled for sm_90 down to a cubin, in a
    process of its own (this one has the interpreted kernels) with an empty Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "superinfer.kernels.compile_check", "--arch", "90"]
    out = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("sm_90") == 12, out.stdout


# Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128; contexts to 8k.


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decode_llama3_8b_shapes(dtype: torch.dtype, block_size: int, split: bool) -> None:
    contexts = [1, block_size - 1, block_size, block_size + 1, 1000, 4095, 8192]
    p = paged(contexts, block_size, 8, 128, dtype)
    q = queries(len(contexts), 32, 128, dtype)
    rows = list(range(len(contexts)))
    batch = DecodeBatch.build(rows, contexts, p.block_ids, block_size, DEVICE, 8, 512 if split else 8192)
    out = paged_decode(q, p.cache, 1, batch, 128**-0.5)
    close(out, paged_decode_reference(q, p.cache, 1, rows, contexts, p.block_ids, 128**-0.5), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_prefill_llama3_8b_shapes(dtype: torch.dtype, block_size: int) -> None:
    extends = [(2048, 2048), (300, 8192), (1, 4097), (block_size + 1, block_size + 1), (1, 1), (517, 6000)]
    lens, contexts = [n for n, _ in extends], [c for _, c in extends]
    p = paged(contexts, block_size, 8, 128, dtype)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    q = queries(sum(lens), 32, 128, dtype)
    batch = ExtendBatch.build(starts, lens, contexts, p.block_ids, block_size, 4, DEVICE)
    out = paged_prefill(q, p.cache, 1, batch, 128**-0.5)
    close(out, paged_prefill_reference(q, p.cache, 1, starts, lens, contexts, p.block_ids, 128**-0.5), dtype)


@pytest.mark.gpu
def test_block_copy_llama3_8b_blocks() -> None:
    cache = torch.randn(300, 32, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.randperm(300, device=DEVICE)[:64].to(torch.int32)
    staging = torch.empty(64, *cache.shape[1:], dtype=cache.dtype, device=DEVICE)
    assert torch.equal(gather_blocks(cache, ids, staging), cache[ids.long()])
    scatter_blocks(staging.flip(0).contiguous(), cache, ids)
    assert torch.equal(cache[ids.long()], staging.flip(0))


@pytest.mark.gpu
def test_new_table_widths_token_counts_and_layers_compile_nothing_new() -> None:
    """Serving meets block tables of every width, steps of every token count and every layer: each
    kernel compiles once, not again for a new value that is 1 or divisible by 16 (Triton's default
    specialization: a stall of seconds in the middle of serving)."""
    from superinfer.kernels.kv_write import _kv_write_kernel
    from superinfer.kernels.paged_decode import _decode_kernel
    from superinfer.kernels.paged_prefill import _prefill_kernel

    block_size, dtype, scale = 16, torch.bfloat16, 128**-0.5
    kernels = (_prefill_kernel, _decode_kernel, _kv_write_kernel)

    def compiled() -> list[int]:
        return [len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels]

    first = None
    for width in (1, 2, 16, 17, 32):  # the longest context, in blocks
        contexts = [width * block_size, 3]
        p = paged(contexts, block_size, 8, 128, dtype)
        for layer in range(LAYERS):
            q = queries(width + 1, 32, 128, dtype)
            lens = [width, 1]
            batch = ExtendBatch.build([0, width], lens, contexts, p.block_ids, block_size, 4, DEVICE)
            paged_prefill(q, p.cache, layer, batch, scale)
            decode = DecodeBatch.build([0, 1], contexts, p.block_ids, block_size, DEVICE, 8)
            paged_decode(q[:2], p.cache, layer, decode, scale)
            slots = torch.arange(width + 1, dtype=torch.int32, device=DEVICE)
            kv_write(p.cache, layer, q[:, :8], q[:, 8:16], slots)
        torch.cuda.synchronize()
        first = first or compiled()
    assert compiled() == first
