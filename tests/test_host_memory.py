"""The CPU KV tier's host memory: exact size, registration in slabs and its end, default sizing."""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import sys

import pytest
import torch

from superinfer.engine.worker import host_memory
from superinfer.engine.worker.attention import allocate_kv_cache
from superinfer.engine.worker.copy_methods import coalesce
from superinfer.engine.worker.host_memory import available_host_bytes, default_tier_bytes, host_tensor, slab_bytes
from tests.test_engine import engine

GIB = 1 << 30
PAGE = mmap.PAGESIZE


def test_host_tensor_is_exactly_the_size_asked_zeroed_and_writable():
    n = 3 * PAGE + 5  # just above a page multiple (torch's pinned allocator would take a power of two)
    t = host_tensor(n)
    assert t.dtype == torch.uint8 and t.nbytes == n and t.data_ptr() % PAGE == 0
    assert not t.any()
    t[-1] = 7
    assert int(t[-1]) == 7


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of `t` in memory (mincore: exact for the range, unlike smaps, whose neighbouring
    anonymous mappings merge into one entry)."""
    pages = -(-t.nbytes // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(pages * PAGE), vec) == 0
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore's residency bits as Linux reports them")
def test_populated_host_memory_is_mapped_before_its_first_write():
    n = 64 * PAGE + 3
    assert _resident_pages(host_tensor(n)) == 0  # pages arrive at their first write
    populated = host_tensor(n, populate=True)
    assert _resident_pages(populated) == 65 and not populated.any()


def test_kv_cache_in_host_memory_has_the_cache_shape_and_exact_bytes():
    cache = allocate_kv_cache(5, 2, 16, 3, 8, torch.bfloat16, "cpu")
    assert cache.shape == (5, 2, 2, 16, 3, 8) and cache.dtype == torch.bfloat16
    assert cache.nbytes == 5 * 2 * 2 * 16 * 3 * 8 * 2 and cache.is_contiguous() and not cache.any()


class FakeCudart:
    """Records cudaHostRegister/Unregister calls; `fail_at` makes that registration fail."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: dict[int, int] = {}
        self.calls = 0
        self.fail_at = fail_at

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.registered[ptr]
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_pinned_host_memory_is_registered_in_block_aligned_slabs_until_the_last_view_goes(cudart, monkeypatch):
    block = 3 * PAGE  # slabs hold whole blocks
    monkeypatch.setattr(host_memory, "SLAB_BYTES", 7 * PAGE)
    t = host_tensor(5 * block, pin=True, align=block)
    base = t.data_ptr()
    spans = sorted(cudart.registered.items())
    assert spans == [(base, 2 * block), (base + 2 * block, 2 * block), (base + 4 * block, block)]
    view = t.view(torch.float32)[10:20]
    del t
    gc.collect()
    assert cudart.registered, "a view still uses the memory: it stays registered"
    view.fill_(1.0)
    del view
    assert not cudart.registered


def test_slabs_of_blocks_that_are_not_whole_pages_never_share_a_page(cudart, monkeypatch):
    block = PAGE // 2 * 3  # one and a half pages
    monkeypatch.setattr(host_memory, "SLAB_BYTES", 4 * PAGE)
    t = host_tensor(7 * block, pin=True, align=block)
    spans = sorted(cudart.registered.items())
    assert all(start % PAGE == 0 and size % (3 * PAGE) == 0 for start, size in spans[:-1])
    assert spans[-1][0] + spans[-1][1] == t.data_ptr() + -(-t.nbytes // PAGE) * PAGE
    assert sum(size for _, size in spans) == -(-t.nbytes // PAGE) * PAGE


def test_block_runs_split_where_a_registration_of_the_pinned_tier_ends(cudart, monkeypatch):
    """One CUDA copy must stay within one registration: DuplexKV's runs of consecutive blocks
    split at the tier's slab boundaries, and only on the tier's side."""
    block = 3 * PAGE
    monkeypatch.setattr(host_memory, "SLAB_BYTES", 7 * PAGE)  # two blocks per slab
    tier = host_tensor(5 * block, pin=True, align=block)
    boundary = slab_bytes(block) // block
    pairs = [(11 + i, i) for i in range(5)]  # GPU blocks 11..15 out to tier blocks 0..4
    runs = coalesce(pairs, dst_boundary=boundary)
    assert [n for *_, n in runs] == [2, 2, 1]
    slabs = cudart.registered.items()
    for _, dst, n in runs:
        first, end = tier.data_ptr() + dst * block, tier.data_ptr() + (dst + n) * block
        assert any(start <= first and end <= start + size for start, size in slabs)
    assert coalesce([(d, s) for s, d in pairs], src_boundary=boundary) == [(d, s, n) for s, d, n in runs]
    assert coalesce(pairs) == [(11, 0, 5)]


def test_a_failed_registration_unregisters_the_slabs_before_it(monkeypatch):
    fake = FakeCudart(fail_at=3)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(host_memory, "SLAB_BYTES", PAGE)
    with pytest.raises(RuntimeError, match="cudaError 2"):
        host_tensor(4 * PAGE, pin=True, align=PAGE)
    assert fake.calls == 3 and not fake.registered


@pytest.mark.parametrize(
    ("available", "pool", "gpus", "fraction", "expected"),
    [
        (400 * GIB, 70 * GIB, 1, 0.5, 200 * GIB),  # plenty (GH200): half of what is available
        (100 * GIB, 70 * GIB, 1, 0.5, 70 * GIB),  # half is short of the GPU pool: the pool, within 80%
        (60 * GIB, 70 * GIB, 1, 0.5, 48 * GIB),  # the pool does not fit: 80% of what is available
        (2000 * GIB, 70 * GIB, 8, 0.5, 125 * GIB),  # an 8-GPU host: each GPU's share
        (16 * GIB, 1 * GIB, 1, 0.0, 1 * GIB),  # the model on the CPU: the KV pool's size
        (0, 70 * GIB, 1, 0.5, 0),
    ],
)
def test_default_tier_size(available, pool, gpus, fraction, expected):
    assert default_tier_bytes(available, pool, gpus, fraction) == pytest.approx(expected, abs=1)


def test_available_host_memory_is_capped_by_the_cgroup_limit(tmp_path):
    proc, v2, v1 = tmp_path / "proc", tmp_path / "v2", tmp_path / "v1"
    for d in (proc, v2, v1 / "memory"):
        d.mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       4000000 kB\nMemAvailable:   2000000 kB\n")
    assert available_host_bytes(proc, v2) == 2000000 * 1024
    (v2 / "memory.max").write_text("max\n")
    assert available_host_bytes(proc, v2) == 2000000 * 1024
    (v2 / "memory.max").write_text(f"{GIB}\n")
    (v2 / "memory.current").write_text(f"{GIB // 2}\n")
    (v2 / "memory.stat").write_text(f"anon 1\ninactive_file {GIB // 4}\n")  # dropable page cache is room
    assert available_host_bytes(proc, v2) == GIB - GIB // 4
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{GIB - 100}\n")
    (v1 / "memory" / "memory.stat").write_text("total_inactive_file 0\n")
    assert available_host_bytes(proc, v1) == 100


def test_engine_sizes_the_cpu_tier_by_default_and_honours_the_overrides(caplog):
    caplog.set_level(logging.INFO, logger="superinfer.engine")
    auto = engine("tiny", max_model_len=256, policy="rotary", num_gpu_blocks=24)
    # The model on the CPU: a 4 GiB tier (within a quarter of the available memory), far more than the pool.
    expected = min(4 * GIB, available_host_bytes() // 4) // auto.block_bytes
    assert auto.kv.cpu.num_blocks == expected > 24
    assert auto.runner.duplex.cpu.nbytes == expected * auto.block_bytes
    assert "CPU KV tier sized automatically" in caplog.text
    assert engine("tiny", max_model_len=256, num_gpu_blocks=24).kv.cpu is None  # fcfs never rotates
    gib = 0.01
    sized = engine("tiny", max_model_len=256, policy="watermark", num_gpu_blocks=24, cpu_kv_gib=gib)
    assert sized.kv.cpu.num_blocks == int(gib * GIB) // sized.block_bytes
    assert sized.runner.duplex.cpu.nbytes == sized.kv.cpu.num_blocks * sized.block_bytes
