"""How DuplexKV issues one direction's block copies, and the startup probe that picks the method.

A copy list is (src, dst) block pairs; blocks are dim 0 of both caches and contiguous (block-first
layout). Three methods:
- `runs`: runs of blocks consecutive on both sides, one `copy_` (a cudaMemcpyAsync) per run;
- `kernel`: one Triton launch copies every block (kernels/block_copy.py), reading or writing the
  pinned CPU tier in place through unified addressing: no staging buffer, no call per block;
- `batch`: every run in one `cudaMemcpyBatchAsync` call (CUDA >= 12.8, through NVIDIA's
  cuda-bindings), flagged to prefer the copy engines over the SMs (overlap with compute).

Which is fastest depends on the link (PCIe or NVLink-C2C), the block size and the number of runs,
so it is measured, not guessed: `probe` times each method on the engine's own caches at startup
and picks the fastest per direction; a method that fails there, or copies wrong bytes, is left out.
On the CPU only `runs` exists. The pinned tier is registered in slabs (host_memory.py): no copy
spans two, so runs split at a slab boundary and the kernel launches once per slab pair.
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Callable
from typing import Literal

import torch

from superinfer.engine.worker.device_tensor import to_device

log = logging.getLogger("superinfer.copy_methods")

CopyMethod = Literal["runs", "kernel", "batch"]
METHODS: tuple[CopyMethod, ...] = ("runs", "kernel", "batch")
Pairs = list[tuple[int, int]]
Copier = Callable[[torch.Tensor, torch.Tensor, Pairs, int, int], int]

PROBE_BLOCKS = 32  # blocks per probe copy: a rotation's worth, scattered on both sides
PROBE_BYTES = 64 << 20  # at most, each way (the probe's random sources take as much device memory)
PROBE_REPEATS = 5


def _device(src: torch.Tensor, dst: torch.Tensor) -> torch.device:
    """Where a copy between the two runs: the GPU side's device."""
    return src.device if src.is_cuda else dst.device


def coalesce(pairs: Pairs, src_boundary: int = 0, dst_boundary: int = 0) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs -> (src_start, dst_start, count) runs, consecutive on both sides;
    a block whose src (dst) id is a multiple of `src_boundary` (`dst_boundary`) starts a run."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs):
        if (
            runs
            and runs[-1][0] + runs[-1][2] == src
            and runs[-1][1] + runs[-1][2] == dst
            and not (src_boundary and src % src_boundary == 0)
            and not (dst_boundary and dst % dst_boundary == 0)
        ):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def copy_runs(src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, src_boundary: int = 0, dst_boundary: int = 0) -> int:
    """Copy whole blocks src[s] -> dst[d], one copy per run; returns the number of copy calls. A
    boundary is a pinned tier's registration size in blocks (0: none)."""
    runs = coalesce(pairs, src_boundary, dst_boundary)
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
    return len(runs)


def copy_kernel(
    src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, src_boundary: int = 0, dst_boundary: int = 0
) -> int:
    """The same copies by the Triton block-copy kernel, one launch per pair of registrations
    (a launch addresses one registration per side; a tier up to host_memory.SLAB_BYTES is one)."""
    from superinfer.kernels.block_copy import copy_blocks

    device = _device(src, dst)
    groups: dict[tuple[int, int], Pairs] = {}
    for s, d in pairs:
        key = (s // src_boundary if src_boundary else 0, d // dst_boundary if dst_boundary else 0)
        groups.setdefault(key, []).append((s - key[0] * src_boundary, d - key[1] * dst_boundary))
    for (gs, gd), group in groups.items():
        ids = to_device(torch.tensor(group, dtype=torch.int32).T.contiguous(), device)
        src_part = src[gs * src_boundary : (gs + 1) * src_boundary] if src_boundary else src
        dst_part = dst[gd * dst_boundary : (gd + 1) * dst_boundary] if dst_boundary else dst
        copy_blocks(src_part, dst_part, ids[0], ids[1])
    return len(groups)


def batch_arguments(
    src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, src_boundary: int = 0, dst_boundary: int = 0
) -> tuple[list[int], list[int], list[int]]:
    """cudaMemcpyBatchAsync's destination addresses, source addresses and byte counts: one per run."""
    block_bytes = src[0].nbytes
    src_base, dst_base = src.data_ptr(), dst.data_ptr()
    runs = coalesce(pairs, src_boundary, dst_boundary)
    return (
        [dst_base + d * block_bytes for _, d, _ in runs],
        [src_base + s * block_bytes for s, _, _ in runs],
        [n * block_bytes for _, _, n in runs],
    )


def copy_batch(src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, src_boundary: int = 0, dst_boundary: int = 0) -> int:
    """Every run in one cudaMemcpyBatchAsync on the current stream. The legacy default stream is
    refused by that call: there (the `serial` duplex mode) the runs go one by one."""
    from cuda.bindings import runtime

    stream = torch.cuda.current_stream(_device(src, dst)).cuda_stream
    if stream == 0:
        return copy_runs(src, dst, pairs, src_boundary, dst_boundary)
    dsts, srcs, sizes = batch_arguments(src, dst, pairs, src_boundary, dst_boundary)
    attrs = runtime.cudaMemcpyAttributes()
    attrs.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    attrs.flags = runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
    result = runtime.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [attrs], [0], 1, stream)
    error = result[0] if isinstance(result, tuple) else result
    if error != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaMemcpyBatchAsync of {len(sizes)} copies failed: {error!r}")
    return 1


COPIERS: dict[CopyMethod, Copier] = {"runs": copy_runs, "kernel": copy_kernel, "batch": copy_batch}


def _bytes(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return cache[ids].view(torch.uint8)


def _time_method(
    copier: Copier, src: torch.Tensor, dst: torch.Tensor, pairs: Pairs, boundaries: tuple[int, int]
) -> float:
    """Median seconds of one copy of `pairs` (after a first one, checked for exact bytes)."""
    device = _device(src, dst)
    copier(src, dst, pairs, *boundaries)
    torch.cuda.synchronize(device)
    if not torch.equal(_bytes(dst, [d for _, d in pairs]).cpu(), _bytes(src, [s for s, _ in pairs]).cpu()):
        raise RuntimeError("copied the wrong bytes")
    seconds = []
    for _ in range(PROBE_REPEATS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        copier(src, dst, pairs, *boundaries)
        end.record()
        end.synchronize()
        seconds.append(begin.elapsed_time(end) / 1000.0)
    return statistics.median(seconds)


def probe(
    gpu: torch.Tensor, cpu: torch.Tensor, boundary: int, methods: tuple[CopyMethod, ...] = METHODS
) -> tuple[dict[str, CopyMethod], dict[str, dict[str, float | str]]]:
    """Time each method moving PROBE_BLOCKS scattered blocks each way between the engine's own
    caches (before they hold anything: the blocks used are zeroed again after). Returns the fastest
    method per direction ("out": GPU -> CPU, "in": CPU -> GPU) and, per direction, each method's
    seconds or why it was left out."""
    n = min(PROBE_BLOCKS, max(1, PROBE_BYTES // gpu[0].nbytes), len(gpu) // 2, len(cpu) // 2)
    if n == 0:
        return {"out": "runs", "in": "runs"}, {}
    rng = random.Random(0)
    gpu_ids = rng.sample(range(len(gpu)), 2 * n)  # scattered: runs of one block, as after many rotations
    cpu_ids = rng.sample(range(len(cpu)), 2 * n)
    out_pairs = list(zip(gpu_ids[:n], cpu_ids[:n], strict=True))
    in_pairs = list(zip(cpu_ids[n:], gpu_ids[n:], strict=True))
    chosen: dict[str, CopyMethod] = {}
    report: dict[str, dict[str, float | str]] = {}
    side = torch.cuda.Stream(gpu.device)  # not the legacy default stream, which the batch call refuses
    try:
        with torch.cuda.stream(side):
            for cache, ids in ((gpu, gpu_ids[:n]), (cpu, cpu_ids[n:])):  # the sources: random bytes
                noise = torch.randint(0, 256, (len(ids), cache[0].nbytes), dtype=torch.uint8, device=cache.device)
                cache[ids] = noise.view(cache.dtype).view(len(ids), *cache.shape[1:])
            for direction, src, dst, pairs, boundaries in (
                ("out", gpu, cpu, out_pairs, (0, boundary)),
                ("in", cpu, gpu, in_pairs, (boundary, 0)),
            ):
                report[direction] = {}
                for method in methods:
                    try:
                        report[direction][method] = _time_method(COPIERS[method], src, dst, pairs, boundaries)
                    except Exception as exc:  # left out: the probe says why
                        report[direction][method] = f"unavailable: {type(exc).__name__}: {exc}"
                timed = {m: s for m, s in report[direction].items() if isinstance(s, float)}
                chosen[direction] = min(timed, key=timed.__getitem__) if timed else "runs"
    finally:
        torch.cuda.synchronize(gpu.device)  # nothing of the probe's still in flight
        gpu[gpu_ids] = 0
        cpu[cpu_ids] = 0
        torch.cuda.synchronize(gpu.device)
    return chosen, report


def resolve(
    method: str, gpu: torch.Tensor, cpu: torch.Tensor | None, boundary: int
) -> tuple[dict[str, CopyMethod], dict[str, dict[str, float | str]]]:
    """The copy method per direction for `--kv-copy-method`: `auto` probes on CUDA (runs
    elsewhere, and where there is no CPU tier); a named method applies to both directions, once
    the probe has seen it copy exactly here."""
    if method == "auto":
        if gpu.device.type != "cuda" or cpu is None:
            return {"out": "runs", "in": "runs"}, {}
        try:
            return probe(gpu, cpu, boundary)
        except Exception as exc:  # a measurement at startup must not stop the engine
            log.warning("the KV copy probe failed (%s: %s); copies go as runs", type(exc).__name__, exc)
            return {"out": "runs", "in": "runs"}, {}
    if method not in METHODS:
        raise ValueError(f"unknown KV copy method {method!r}; choose auto or one of {', '.join(METHODS)}")
    if method != "runs" and gpu.device.type != "cuda":
        raise ValueError(f"--kv-copy-method {method} needs a CUDA device; on the CPU the copies are runs")
    if method == "runs" or cpu is None:
        return {"out": method, "in": method}, {}
    _, report = probe(gpu, cpu, boundary, (method,))  # fail at startup, not in the first rotation
    for seconds in report.values():
        if not isinstance(seconds[method], float):
            raise ValueError(f"--kv-copy-method {method} cannot run here: {seconds[method]}")
    return {"out": method, "in": method}, report


def describe(chosen: dict[str, CopyMethod], report: dict[str, dict[str, float | str]]) -> str:
    """One line for the log: the choice per direction and what each method measured."""
    names = {"out": "GPU->CPU", "in": "CPU->GPU"}
    parts = []
    for direction, methods in report.items():
        figures = ", ".join(f"{m} {v * 1e6:.0f} us" if isinstance(v, float) else f"{m} {v}" for m, v in methods.items())
        parts.append(f"{names[direction]} {chosen[direction]} ({figures})")
    return "; ".join(parts)
