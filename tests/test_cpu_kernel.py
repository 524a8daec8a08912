"""The CPU paged-attention kernel (C, built here with the system's compiler) against its torch
reference: ragged decodes and prompt chunks over scattered blocks, GQA, fp32 and bf16 caches."""

from __future__ import annotations

import ctypes
import random
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from superinfer.kernels import cpu_paged_attention as kernel
from superinfer.kernels.cpu_paged_attention import (
    KernelBuildError,
    SpanTable,
    paged_attention,
    paged_attention_reference,
)


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return kernel.load(tmp_path_factory.mktemp("kernels"))


def _case(seed: int, q_heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype, chunks: bool):
    """A step's sequences over a cache of stale values: decodes at every kind of context (1 key,
    a block boundary and one past it, long), and with `chunks` prompt chunks, first or after a prefix."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, 1), (1, block_size), (1, block_size + 1), (1, rng.randrange(2, 300)), (1, 7)]
    if chunks:
        shapes += [(5, 5), (1 + block_size, 1 + block_size), (9, 9 + 3 * block_size), (40, 41)]
    num_blocks = sum(-(-c // block_size) for _, c in shapes) + 8
    cache = torch.randn(num_blocks, 3, 2, block_size, kv_heads, dim, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    rows, tokens, contexts, tables, row = [], [], [], [], 0
    for n, c in rng.sample(shapes, len(shapes)):
        blocks = [free.pop() for _ in range(-(-c // block_size))]
        rows.append(row)
        tokens.append(n)
        contexts.append(c)
        tables.append([*blocks, free[0]])  # a spare block past the context is never read
        row += n
    q = torch.randn(row, q_heads, dim, generator=gen)
    return cache, SpanTable.build(rows, tokens, contexts, tables, block_size), q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim", "block_size"),
    [(4, 2, 64, 32), (8, 1, 128, 16), (4, 4, 64, 1), (32, 8, 64, 16), (12, 2, 80, 16)],
)
def test_kernel_matches_reference(
    lib, q_heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype
) -> None:
    cache, batch, q = _case(q_heads + dim + block_size, q_heads, kv_heads, dim, block_size, dtype, chunks=True)
    got = torch.full_like(q, float("nan"))
    want = torch.full_like(q, float("nan"))
    for layer in range(cache.shape[1]):
        paged_attention(lib, q, cache, layer, batch, dim**-0.5, got)
        paged_attention_reference(q, cache, layer, batch, dim**-0.5, want)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_threads_split_the_work_without_changing_it(lib) -> None:
    cache, batch, q = _case(3, 8, 2, 64, 16, torch.float32, chunks=True)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = torch.empty_like(q)
            paged_attention(lib, q, cache, 1, batch, 0.125, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])  # each row has one owner


def test_rows_it_is_not_given_are_left_alone(lib) -> None:
    cache, batch, q = _case(5, 4, 2, 64, 16, torch.float32, chunks=False)
    out = torch.full((q.shape[0] + 3, *q.shape[1:]), 7.0)
    paged_attention(lib, torch.cat([q, torch.zeros(3, *q.shape[1:])]), cache, 0, batch, 0.125, out)
    assert torch.all(out[q.shape[0] :] == 7.0)


def test_build_is_cached_per_source_and_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = kernel.build(tmp_path)
    assert first.exists() and [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left
    version = subprocess.run([kernel._compiler(), "--version"], capture_output=True, text=True).stdout

    def compiler_reporting(reported: str) -> Callable[..., subprocess.CompletedProcess[str]]:
        def run(args: list[str], **_: object) -> subprocess.CompletedProcess[str]:
            if args[1:] == ["--version"]:
                return subprocess.CompletedProcess(args, 0, reported, "")
            raise AssertionError("compiled again")

        return run

    monkeypatch.setattr(subprocess, "run", compiler_reporting(version))
    assert kernel.build(tmp_path) == first
    monkeypatch.setattr(subprocess, "run", compiler_reporting(version + "patched\n"))
    with pytest.raises(AssertionError, match="compiled again"):
        kernel.build(tmp_path)  # another compiler is another key


def test_missing_or_failing_compiler_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(KernelBuildError, match="no C compiler: 'no-such-cc' is not on PATH"):
        kernel.build(tmp_path)
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\necho 'fake-cc 1.0'\n[ \"$1\" = --version ] || { echo 'error: no' >&2; exit 1; }\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(KernelBuildError, match=r"failed on cpu_paged_attention\.c:\nerror: no"):
        kernel.build(tmp_path / "out")
