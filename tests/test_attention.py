"""Paged attention on ragged steps against dense causal attention over each sequence's history."""

from __future__ import annotations

import random
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from superinfer.engine.worker import attention_backend
from superinfer.engine.worker.attention import (
    AttentionGroup,
    PagedAttention,
    SeqSpan,
    allocate_kv_cache,
    plan_attention,
)
from superinfer.engine.worker.attention_backend import resolve_backend
from superinfer.engine.worker.cpu_attention import cpu_attention

LAYERS, KV_HEADS, HEADS, DIM = 2, 2, 4, 16


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.. over k, v [start + n, KV, D], causal, GQA by repetition."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * DIM**-0.5
    hidden = torch.arange(k.shape[0])[None, :] > (start + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).float()


def _run_steps(
    seed: int, block_size: int, pad_tokens: int, group_bytes: int, device: str = "cpu", backend: str = "torch"
) -> set[str]:
    """Sequences arrive, prefill in chunks (some grouped, some continued) and decode, mixed in
    shuffled steps; every step's output equals dense attention over the sequence's history.
    Returns the kinds of groups the steps had. `backend` cpu: decodes on the C kernel."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 400 // block_size * 12 + 8
    cache = allocate_kv_cache(num_blocks, LAYERS, block_size, KV_HEADS, DIM, torch.float32, "cpu")
    cache.normal_(generator=gen)  # stale values in every slot: padding must never be attended
    cache = cache.to(device)
    free = list(range(num_blocks))
    random.Random(-seed).shuffle(free)  # scattered blocks; the same steps whatever the block size
    prompts = [rng.choice([1, 2, 5, 16, 17, 40, 63, 64, 100, 150]) for _ in range(12)]
    done = [0] * len(prompts)  # tokens whose K/V are in the cache
    blocks: list[list[int]] = [[] for _ in prompts]
    history: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    kinds: set[str] = set()
    for _ in range(8):
        spans, chunks, row = [], [], 0
        order = list(range(len(prompts)))
        rng.shuffle(order)
        for i in order:
            left = prompts[i] - done[i]
            n = 1 if left <= 0 else min(left, rng.choice([left, 7, 33]))
            if rng.random() < 0.2:
                continue  # not scheduled this step
            ctx = done[i] + n
            while len(blocks[i]) * block_size < ctx:
                blocks[i].append(free.pop())
            spans.append(SeqSpan(row, n, ctx, list(blocks[i])))
            chunks.append((i, done[i], n))
            row += n
            done[i] = ctx
        if not spans:
            continue
        q = torch.randn(row, HEADS, DIM, generator=gen)
        k = torch.randn(row, KV_HEADS, DIM, generator=gen)
        v = torch.randn(row, KV_HEADS, DIM, generator=gen)
        meta = plan_attention(spans, cache, pad_tokens, group_bytes)
        kinds |= {_kind(g) for g in meta.groups}
        if backend == "cpu":
            attn = cpu_attention()(spans, cache, DIM**-0.5)
            assert attn.meta.groups == [] or all(g.q_len > 1 for g in attn.meta.groups)
        else:
            attn = PagedAttention(cache, meta, DIM**-0.5)
        for layer in range(LAYERS):
            out = attn(layer, *(t.to(device) for t in (q * (layer + 1), k + layer, v - layer))).cpu()
            for span, (i, start, n) in zip(spans, chunks, strict=True):
                rows = slice(span.row, span.row + n)
                pk, pv = history.get((i, layer), (k[:0], v[:0]))
                keys, values = torch.cat([pk, k[rows] + layer]), torch.cat([pv, v[rows] - layer])
                history[(i, layer)] = (keys, values)
                want = _dense(q[rows] * (layer + 1), keys, values, start)
                torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
    return kinds


def _kind(g: AttentionGroup) -> str:
    kind = "decodes" if g.q_len == 1 else "first chunks" if g.causal else "continued chunk"
    return kind + (" (padded)" if g.picked is not None else "") + (" x1" if g.n == 1 else " xN")


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("seed", range(3))
def test_ragged_steps_match_dense_attention(block_size: int, seed: int) -> None:
    kinds = _run_steps(seed, block_size, pad_tokens=64, group_bytes=4 << 20)
    assert {"decodes xN", "first chunks (padded) xN", "continued chunk x1"} <= kinds


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_ragged_steps_match_dense_attention_with_the_cpu_kernel(block_size: int) -> None:
    """The same steps with the decodes on the C kernel and the chunks grouped in torch."""
    _run_steps(4, block_size, pad_tokens=64, group_bytes=4 << 20, backend="cpu")


@pytest.mark.parametrize(("pad_tokens", "group_bytes"), [(0, 1), (10_000, 1 << 30), (32, 64 << 10)])
def test_grouping_never_changes_results(pad_tokens: int, group_bytes: int) -> None:
    """One group per sequence, one group for everything alike, and groups capped by size."""
    _run_steps(7, 16, pad_tokens, group_bytes)


def test_groups_bound_padding_and_size() -> None:
    rng = random.Random(0)
    cache = allocate_kv_cache(1, 1, 16, KV_HEADS, DIM, torch.float32, "cpu")
    token_bytes = 2 * KV_HEADS * DIM * 4
    spans, row = [], 0
    for _ in range(60):
        n = rng.choice([1, 1, 1, 30, 90])
        ctx = n if n > 1 and rng.random() < 0.5 else n + rng.randrange(0, 500)
        spans.append(SeqSpan(row, n, ctx, [0] * (ctx // 16 + 1)))
        row += n
    meta = plan_attention(spans, cache, pad_tokens=48, group_bytes=200 * token_bytes)
    assert sorted(torch.cat([g.out_rows for g in meta.groups]).tolist()) == list(range(row))
    for g in meta.groups:
        width = g.blocks.numel() // g.n * 16
        members = [s for s in spans if s.row in set(g.out_rows.tolist())]
        assert len(members) == g.n
        if g.n > 1:
            assert g.n * max(s.context for s in members) <= 200
            length = (lambda s: s.context) if g.q_len == 1 else (lambda s: s.num_tokens)
            assert max(map(length, members)) - min(map(length, members)) <= 48
        assert width >= max(s.context for s in members)
        assert g.causal == (g.mask is None)


@pytest.mark.gpu
def test_ragged_steps_match_dense_attention_cuda() -> None:
    _run_steps(1, 16, pad_tokens=64, group_bytes=4 << 20, device="cuda")


def _cache(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros((4, LAYERS, 2, 16, KV_HEADS, DIM), dtype=dtype)


CUDA_CACHE: Any = SimpleNamespace(device=torch.device("cuda"))  # all resolve_backend reads of a CUDA cache


def test_backend_choice_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: the C kernel on the CPU (torch where it cannot build), triton on CUDA when it
    imports; triton on the CPU only interpreted; cpu only on the CPU."""
    cpu, cuda = _cache(), CUDA_CACHE
    assert resolve_backend("auto", cpu, HEADS) == "cpu"
    assert resolve_backend("cpu", cpu, HEADS) == "cpu"
    assert resolve_backend("torch", cuda, HEADS) == "torch"
    with pytest.raises(ValueError, match="runs on the CPU, not cuda"):
        resolve_backend("cpu", cuda, HEADS)
    monkeypatch.setattr(attention_backend, "_triton_imports", lambda: True)
    assert resolve_backend("auto", cuda, HEADS) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", cpu, HEADS)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", cpu, HEADS) == "triton"
    monkeypatch.setattr(attention_backend, "_triton_imports", lambda: False)
    assert resolve_backend("auto", cuda, HEADS) == "torch"
    with pytest.raises(ValueError, match="triton is not installed"):
        resolve_backend("triton", cuda, HEADS)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        resolve_backend("flash", cpu, HEADS)


def test_auto_falls_back_to_torch_where_the_cpu_kernel_cannot_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fp16 = _cache(torch.float16)
    with caplog.at_level("WARNING"):
        assert resolve_backend("auto", fp16, HEADS) == "torch"
    assert "float32 or bfloat16 KV cache, not torch.float16" in caplog.text
    with pytest.raises(ValueError, match=r"--attention-backend cpu: .*not torch.float16"):
        resolve_backend("cpu", fp16, HEADS)
    with pytest.raises(ValueError, match="query heads per KV head up to 32, not 64"):
        resolve_backend("cpu", _cache(), 64 * KV_HEADS)
    odd = torch.zeros((4, 1, 2, 16, 1, 24))
    with pytest.raises(ValueError, match="head_dim that is a multiple of 16, not 24"):
        resolve_backend("cpu", odd, 1)
    monkeypatch.setattr(attention_backend, "_cpu_kernel_problem", lambda *_: "no C compiler")
    assert resolve_backend("auto", _cache(), HEADS) == "torch"


def test_engine_imports_without_triton(tmp_path) -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` raises ImportError
        "import torch\n"
        "from superinfer.cli import main\n"
        "from superinfer.engine import engine\n"
        "from superinfer.engine.serving import server\n"
        "from superinfer.engine.worker import attention_backend\n"
        "assert not attention_backend._triton_imports()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)  # not the root: its operator/


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_attention_bench_needs_cuda() -> None:
    from superinfer.bench import attn

    with pytest.raises(SystemExit, match="needs a CUDA device"):
        attn.main([])
