"""How DuplexKV issues a direction's block copies (copy_methods.py), on the CPU: the batched call's
arguments replayed by memmove, and the choice of method. The kernel method runs through Triton's
interpreter in test_kernels.py; on a GPU, test_gpu.py runs all three and the startup probe."""

from __future__ import annotations

import ctypes

import pytest
import torch

from superinfer.engine.worker import copy_methods
from superinfer.engine.worker.copy_methods import batch_arguments, copy_runs


def caches(blocks: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randn(blocks, 2, 2, 4, 2, 8)
    return src, torch.zeros_like(src)


PAIRS = [(0, 5), (1, 6), (2, 7), (3, 8), (9, 0), (4, 11), (10, 1)]


def test_the_batched_call_gets_one_copy_per_run_split_at_the_tiers_registrations():
    src, dst = caches()
    dsts, srcs, sizes = batch_arguments(src, dst, PAIRS, dst_boundary=3)
    for d, s, n in zip(dsts, srcs, sizes, strict=True):  # what cudaMemcpyBatchAsync would do
        ctypes.memmove(d, s, n)
    want = torch.zeros_like(dst)
    copy_runs(src, want, PAIRS)
    assert torch.equal(dst, want)
    block = src[0].nbytes
    # 0..3 -> 5..8 splits where the tier's second registration (blocks 6..8) starts; 9, 10 -> 0, 1 is a run.
    assert [n // block for n in sizes] == [1, 3, 1, 2]
    first_blocks = [(d - dst.data_ptr()) // block for d in dsts]
    assert all(b // 3 == (b + n // block - 1) // 3 for b, n in zip(first_blocks, sizes, strict=True))


def test_auto_is_runs_on_the_cpu_and_a_named_method_needs_cuda():
    gpu, cpu = caches()
    assert copy_methods.resolve("auto", gpu, cpu, 0) == ({"out": "runs", "in": "runs"}, {})
    assert copy_methods.resolve("runs", gpu, cpu, 0)[0] == {"out": "runs", "in": "runs"}
    with pytest.raises(ValueError, match="needs a CUDA device"):
        copy_methods.resolve("kernel", gpu, cpu, 0)
    with pytest.raises(ValueError, match="unknown KV copy method"):
        copy_methods.resolve("dma", gpu, cpu, 0)


def test_the_probe_report_reads_as_one_log_line():
    line = copy_methods.describe(
        {"out": "kernel", "in": "runs"},
        {
            "out": {"runs": 2e-4, "kernel": 5e-5, "batch": "unavailable: ImportError: no cuda.bindings"},
            "in": {"runs": 1e-4, "kernel": 3e-4},
        },
    )
    assert line == (
        "GPU->CPU kernel (runs 200 us, kernel 50 us, batch unavailable: ImportError: no cuda.bindings); "
        "CPU->GPU runs (runs 100 us, kernel 300 us)"
    )


def test_the_engine_names_its_copy_methods_in_its_info_metric():
    from prometheus_client import generate_latest

    from superinfer.engine.config import EngineConfig
    from superinfer.engine.engine import EngineCore

    core = EngineCore(EngineConfig(model="tiny", device="cpu", policy="rotary", num_gpu_blocks=64, num_cpu_blocks=64))
    assert core.runner.duplex.methods == {"out": "runs", "in": "runs"}
    text = generate_latest(core.metrics.registry).decode()
    assert 'kv_copy_in="runs"' in text and 'kv_copy_out="runs"' in text
