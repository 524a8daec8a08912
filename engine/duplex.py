"""DuplexKV: one step's block copies between the GPU and CPU tiers, both directions at once.

Block-first layout makes one block (all layers) one contiguous region, so a copy is a slice of
the cache tensor. Runs of consecutive blocks on both sides are coalesced into one copy each.
On CUDA each direction has its own stream, so GPU->CPU and CPU->GPU are in flight together:
- copy-in (CPU->GPU) waits on the previous step's compute event (its destinations may have been
  freed since that step was submitted); the compute stream waits on the copy-in event (a GPU-side
  wait, not a host sync) before the model reads the blocks;
- copy-out (GPU->CPU) waits on the previous step's compute event (blocks it wrote are final),
  then overlaps with this step's compute;
- `finish()` waits for this step's compute and both copies before the step counts as done (only
  then may the scheduler retire the blocks it quarantined for this step).
On CPU the same calls are plain tensor copies.
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


class DuplexKV:
    def __init__(self, gpu_cache: torch.Tensor, cpu_cache: torch.Tensor | None) -> None:
        self.gpu = gpu_cache
        self.cpu = cpu_cache
        self.cuda = gpu_cache.device.type == "cuda"
        if self.cuda:
            self.out_stream = torch.cuda.Stream(gpu_cache.device)
            self.in_stream = torch.cuda.Stream(gpu_cache.device)
            self.compute_done = torch.cuda.Event()
            self.compute_done.record()
        self._pending_out: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._in_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._host: CopyStats = CopyStats()

    def start(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Issue this step's copies; on return the compute stream may run the model."""
        self._host = CopyStats(blocks_out=len(swap_out), blocks_in=len(swap_in))
        if not swap_out and not swap_in:
            return
        if self.cpu is None:
            raise RuntimeError("the plan moves blocks between tiers but there is no CPU tier (--cpu-kv-gib)")
        if not self.cuda:
            t0 = time.perf_counter()
            copy_blocks(self.gpu, self.cpu, swap_out)
            t1 = time.perf_counter()
            copy_blocks(self.cpu, self.gpu, swap_in)
            self._host.seconds_out, self._host.seconds_in = t1 - t0, time.perf_counter() - t1
            return
        compute = torch.cuda.current_stream(self.gpu.device)
        if swap_in:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.in_stream):
                self.in_stream.wait_event(self.compute_done)
                begin.record()
                copy_blocks(self.cpu, self.gpu, swap_in)
                end.record()
            compute.wait_event(end)
            self._in_events = (begin, end)
        if swap_out:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.out_stream):
                self.out_stream.wait_event(self.compute_done)
                begin.record()
                copy_blocks(self.gpu, self.cpu, swap_out)
                end.record()
            self._pending_out = (begin, end)

    def finish(self) -> CopyStats:
        """After the step's compute: wait for its copy-out; returns what moved and how long."""
        stats = self._host
        if self.cuda:
            self.compute_done.record()
            self.compute_done.synchronize()
            if self._pending_out is not None:
                begin, end = self._pending_out
                end.synchronize()
                stats.seconds_out = begin.elapsed_time(end) / 1000.0
                self._pending_out = None
            if self._in_events is not None:
                begin, end = self._in_events
                end.synchronize()
                stats.seconds_in = begin.elapsed_time(end) / 1000.0
                self._in_events = None
        return stats
