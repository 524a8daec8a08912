"""DuplexKV: one step's block copies between the GPU and CPU tiers, both directions at once.

Block-first layout makes one block (all layers) one contiguous region, so a copy is a slice of
the cache tensor. Runs of consecutive blocks on both sides are coalesced into one copy each.
On CUDA each direction has its own stream, so GPU->CPU and CPU->GPU are in flight together,
ordered against the model with events only (no host sync until a step's results are read):
- copy-out (GPU->CPU) waits on the compute of the step submitted before it (blocks that step
  wrote are final), then overlaps this step's compute;
- copy-in (CPU->GPU) waits on that same compute (its destinations may have been freed since that
  step was submitted) and on the previous copy-out (it may read CPU blocks that copy-out writes);
  the compute stream waits on the copy-in event before the model reads the blocks;
- `computed()` records the step's compute event once its model work is enqueued; `finish()`
  waits for it and both copies before the step counts as done (only then may the scheduler
  retire the blocks it quarantined for this step).
With async scheduling the host plans and submits step t+1 while the GPU still runs step t; the
events above are what keeps the two apart. On CPU the same calls are plain, synchronous copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def coalesce(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs -> (src_start, dst_start, count) runs, consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> int:
    """Copy whole blocks src[s] -> dst[d]; returns the number of copy calls issued."""
    runs = coalesce(pairs)
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
    return len(runs)


@dataclass
class CopyStats:
    blocks_out: int = 0
    blocks_in: int = 0
    seconds_out: float = 0.0
    seconds_in: float = 0.0


Span = tuple[torch.cuda.Event, torch.cuda.Event]


@dataclass
class StepCopies:
    """One submitted step's copies and, on CUDA, the events that tell when they and its compute end."""

    stats: CopyStats
    copy_out: Span | None = None
    copy_in: Span | None = None
    compute: torch.cuda.Event | None = None


def _copy_on(
    stream: torch.cuda.Stream,
    waits: list[torch.cuda.Event],
    src: torch.Tensor,
    dst: torch.Tensor,
    pairs: list[tuple[int, int]],
) -> Span:
    """Copy blocks on `stream` once `waits` have happened; returns the copy's (begin, end) events."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        for event in waits:
            stream.wait_event(event)
        begin.record()
        copy_blocks(src, dst, pairs)
        end.record()
    return begin, end


class DuplexKV:
    def __init__(self, gpu_cache: torch.Tensor, cpu_cache: torch.Tensor | None) -> None:
        self.gpu = gpu_cache
        self.cpu = cpu_cache
        self.cuda = gpu_cache.device.type == "cuda"
        if self.cuda:
            self.out_stream = torch.cuda.Stream(gpu_cache.device)
            self.in_stream = torch.cuda.Stream(gpu_cache.device)
            self._last_compute = torch.cuda.Event()
            self._last_compute.record()
        self._last_out: torch.cuda.Event | None = None

    def start(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> StepCopies:
        """Issue this step's copies; on return the compute stream may run the model."""
        step = StepCopies(CopyStats(blocks_out=len(swap_out), blocks_in=len(swap_in)))
        if not swap_out and not swap_in:
            return step
        if self.cpu is None:
            raise RuntimeError("the plan moves blocks between tiers but there is no CPU tier (--cpu-kv-gib)")
        if not self.cuda:
            t0 = time.perf_counter()
            copy_blocks(self.gpu, self.cpu, swap_out)
            t1 = time.perf_counter()
            copy_blocks(self.cpu, self.gpu, swap_in)
            step.stats.seconds_out, step.stats.seconds_in = t1 - t0, time.perf_counter() - t1
            return step
        if swap_in:
            waits = [self._last_compute] + ([self._last_out] if self._last_out is not None else [])
            step.copy_in = _copy_on(self.in_stream, waits, self.cpu, self.gpu, swap_in)
            torch.cuda.current_stream(self.gpu.device).wait_event(step.copy_in[1])
        if swap_out:
            step.copy_out = _copy_on(self.out_stream, [self._last_compute], self.gpu, self.cpu, swap_out)
            self._last_out = step.copy_out[1]
        return step

    def computed(self, step: StepCopies) -> None:
        """The step's model work (and the copy of its results to the host) is enqueued."""
        if self.cuda:
            step.compute = self._last_compute = torch.cuda.Event()
            step.compute.record()

    def finish(self, step: StepCopies) -> CopyStats:
        """Wait for the step's compute and copies; returns what moved and how long it took."""
        if step.compute is not None:
            step.compute.synchronize()
        if step.copy_out is not None:
            step.copy_out[1].synchronize()
            step.stats.seconds_out = step.copy_out[0].elapsed_time(step.copy_out[1]) / 1000.0
        if step.copy_in is not None:
            step.copy_in[1].synchronize()
            step.stats.seconds_in = step.copy_in[0].elapsed_time(step.copy_in[1]) / 1000.0
        return step.stats
