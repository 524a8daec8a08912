"""DuplexKV: one step's block copies between the GPU and CPU tiers, overlapped with the model.

Block-first layout makes one block (all layers) one contiguous region, so a copy is a slice of
the cache tensor. How a direction's copies are issued (runs of consecutive blocks, one Triton
kernel, or one batched memcpy call) is its copy method (`copy_methods.py`), measured at startup.

Each step has up to three ops (`streams.py`): copy-in (CPU -> GPU), copy-out (GPU -> CPU) and
compute (the model step). They wait only for what they depend on:
- copy-in waits only where the plan says so: for the copy-out that wrote a CPU block it reads
  (`swap_in_after_copy`), and for the compute of an unfinished step that still touches one of
  its destination blocks (`swap_in_after`; the KV manager hands such blocks to copies last);
- copy-out waits for the compute of the step that wrote its blocks (`swap_out_after`);
- compute waits for its copy-in (it reads those blocks), and for the copy-out of a step that
  still reads a block it writes (`compute_after_copy`: the KV manager hands such blocks out last).
With async scheduling, step t+1's copy-in therefore runs while step t computes.

Modes (`--duplex`): `full` puts the directions on two lanes (both at once); `half` on one lane
(in turn, copy-in first so it never queues behind a copy-out that waits for the running step);
`serial` on the compute lane itself (copies before compute, no overlap): the ablation baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from superinfer.engine.core.plan import StepPlan
from superinfer.engine.worker.copy_methods import COPIERS, CopyMethod
from superinfer.engine.worker.host_memory import slab_bytes
from superinfer.engine.worker.streams import Access, HostStreams, Lane, Span, Streams

DuplexMode = Literal["full", "half", "serial"]
COPY_LANES: dict[str, tuple[Lane, Lane]] = {  # mode -> (copy-out lane, copy-in lane)
    "full": ("copy_out", "copy_in"),
    "half": ("copy_out", "copy_out"),
    "serial": ("compute", "compute"),
}


def tier_boundary(gpu_cache: torch.Tensor, cpu_cache: torch.Tensor | None) -> int:
    """CPU-tier blocks per registration of the pinned tier (no copy may span two); 0: unpinned."""
    if cpu_cache is None or not cpu_cache.is_pinned():
        return 0
    block_bytes = gpu_cache[0].nbytes
    return slab_bytes(block_bytes) // block_bytes


def copy_access(pairs: list[tuple[int, int]], src_tier: str, dst_tier: str) -> Access:
    return Access(frozenset((src_tier, s) for s, _ in pairs), frozenset((dst_tier, d) for _, d in pairs))


def _unfinished(spans: dict[int, Span], step_id: int) -> list[Span]:
    """The op of `step_id` to wait for: none when that step has finished (or had no such op)."""
    span = spans.get(step_id)
    return [span] if span is not None else []


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


@dataclass
class CopyStats:
    """What one step's copies moved and how they went (seconds; 0 where nothing moved).

    `latency_*`: from the step's submission to the copy's end (the blocks resident in the other
    tier); `queue_*`: from submission to the copy's start; `hidden_seconds`: the part of the
    copies' time that ran while a model step computed. Beside them, the step's compute itself:
    `compute_queue` from submission to its start (behind earlier steps and the copies it waits
    for), `compute_seconds` from its start to its end on the device (on a GPU, as long as the
    host takes to launch it if that is longer)."""

    blocks_out: int = 0
    blocks_in: int = 0
    seconds_out: float = 0.0
    seconds_in: float = 0.0
    latency_out: float = 0.0
    latency_in: float = 0.0
    queue_out: float = 0.0
    queue_in: float = 0.0
    hidden_seconds: float = 0.0
    compute_queue: float = 0.0
    compute_seconds: float = 0.0

    @property
    def copy_seconds(self) -> float:
        return self.seconds_out + self.seconds_in

    @property
    def hidden_ratio(self) -> float | None:
        """Share of the copies' time hidden under compute; None without copies."""
        return self.hidden_seconds / self.copy_seconds if self.copy_seconds > 0 else None


@dataclass
class StepCopies:
    """One submitted step's ops: its copies (if any) and its compute."""

    step_id: int
    stats: CopyStats
    submitted: object  # marker: the host's "now" when the step was submitted
    copy_out: Span | None = None
    copy_in: Span | None = None
    compute: Span | None = None
    compute_after: list[Span] = field(default_factory=list)  # copies the compute must wait for


class DuplexKV:
    def __init__(
        self,
        gpu_cache: torch.Tensor,
        cpu_cache: torch.Tensor | None,
        streams: Streams | None = None,
        mode: DuplexMode = "full",
        methods: dict[str, CopyMethod] | None = None,
    ) -> None:
        """`methods`: the copy method per direction, "out" (GPU -> CPU) and "in"; runs by default."""
        if mode not in COPY_LANES:
            raise ValueError(f"unknown duplex mode {mode!r}; choose one of {', '.join(COPY_LANES)}")
        self.gpu = gpu_cache
        self.cpu = cpu_cache
        self.boundary = tier_boundary(gpu_cache, cpu_cache)
        self.streams = streams or HostStreams()
        self.mode = mode
        self.out_lane, self.in_lane = COPY_LANES[mode]
        self.methods: dict[str, CopyMethod] = {"out": "runs", "in": "runs", **(methods or {})}
        self._copy_out, self._copy_in = COPIERS[self.methods["out"]], COPIERS[self.methods["in"]]
        self._computes: dict[int, Span] = {}  # unfinished steps' compute
        self._copy_outs: dict[int, Span] = {}  # unfinished steps' copy-out
        self._previous: StepCopies | None = None  # the step submitted before the newest

    def start(self, plan: StepPlan) -> StepCopies:
        """Issue the plan's copies; the step's compute goes through `compute`."""
        step = StepCopies(plan.step_id, CopyStats(len(plan.swap_out), len(plan.swap_in)), self.streams.mark())
        step.compute_after = self._copy_out_of(plan.compute_after_copy)
        if (plan.swap_out or plan.swap_in) and self.cpu is None:
            raise RuntimeError("the plan moves blocks between tiers but there is no CPU tier (--cpu-kv-gib)")
        if plan.swap_in:
            after = self._compute_of(plan.swap_in_after) + self._copy_out_of(plan.swap_in_after_copy)
            step.copy_in = self.streams.run(
                self.in_lane,
                lambda: self._copy_in(self.cpu, self.gpu, plan.swap_in, self.boundary, 0),
                after,
                lambda: copy_access(plan.swap_in, "cpu", "gpu"),
                f"copy_in {plan.step_id}",
            )
        if plan.swap_out:
            step.copy_out = self._copy_outs[plan.step_id] = self.streams.run(
                self.out_lane,
                lambda: self._copy_out(self.gpu, self.cpu, plan.swap_out, 0, self.boundary),
                self._compute_of(plan.swap_out_after),
                lambda: copy_access(plan.swap_out, "gpu", "cpu"),
                f"copy_out {plan.step_id}",
            )
        return step

    def compute(self, step: StepCopies, fn: Callable[[], None], access: Callable[[], Access] | None = None) -> None:
        """Enqueue the step's model work behind its copy-in."""
        after = step.compute_after + ([step.copy_in] if step.copy_in is not None else [])
        step.compute = self.streams.run("compute", fn, after, access, f"compute {step.step_id}")
        self._computes[step.step_id] = step.compute

    def finish(self, step: StepCopies) -> CopyStats:
        """Wait for the step's ops; returns what its copies moved and how long they took."""
        spans = [s for s in (step.compute, step.copy_out, step.copy_in) if s is not None]
        for span in spans:
            self.streams.wait(span)
        self._measure(step)
        self._computes.pop(step.step_id, None)
        self._copy_outs.pop(step.step_id, None)
        self._previous = step
        return step.stats

    def _compute_of(self, step_id: int) -> list[Span]:
        return _unfinished(self._computes, step_id)

    def _copy_out_of(self, step_id: int) -> list[Span]:
        return _unfinished(self._copy_outs, step_id)

    def _measure(self, step: StepCopies) -> None:
        if step.compute is not None:
            step.stats.compute_queue = self.streams.seconds(step.submitted, step.compute.begin)
            step.stats.compute_seconds = self.streams.seconds(step.compute.begin, step.compute.end)
        if step.copy_out is None and step.copy_in is None:
            return
        # Offsets from a marker taken before anything that can overlap this step's copies: the
        # previous step's submission (its compute may still have been running).
        ref = self._previous.submitted if self._previous is not None else step.submitted
        s = self.streams.seconds

        def interval(span: Span) -> tuple[float, float]:
            return s(ref, span.begin), s(ref, span.end)

        computes = [interval(c) for c in (step.compute,) if c is not None]
        if self._previous is not None and self._previous.compute is not None:
            computes.append(interval(self._previous.compute))
        stats, submitted = step.stats, s(ref, step.submitted)
        for span, direction in ((step.copy_out, "out"), (step.copy_in, "in")):
            if span is None:
                continue
            begin, end = interval(span)
            setattr(stats, f"seconds_{direction}", end - begin)
            setattr(stats, f"latency_{direction}", end - submitted)
            setattr(stats, f"queue_{direction}", max(0.0, begin - submitted))
            if self.out_lane != "compute":
                stats.hidden_seconds += sum(overlap((begin, end), c) for c in computes)
