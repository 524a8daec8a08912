"""Where a step's device work runs: ops on lanes, ordered by their lane and by waits on other ops.

A lane is an in-order queue (a CUDA stream): `compute` (the model step), `copy_out` (GPU -> CPU)
and `copy_in` (CPU -> GPU); the duplex mode decides which lanes a copy uses (`duplex.py`). An op
waits for the end of the ops named in `after`; the host waits for an op with `wait`. Each op has a
begin and an end marker on the device's clock; `mark()` is the host's "now" on that clock.

Three backends:
- `CudaStreams`: one CUDA stream per lane, timing events as markers (no host sync until `wait`);
- `HostStreams`: runs each op at once on the host (CPU); markers are `perf_counter` times;
- `RecordingStreams`: defers every op and records the dependency graph and the KV blocks each op
  reads and writes; when the host waits, it runs pending ops in a random order that respects the
  graph. A dependency the executor forgets then shows up as wrong KV or tokens, and the graph
  itself can be checked (`happens_before.py` in the tests).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

Lane = Literal["compute", "copy_out", "copy_in"]
LANES: tuple[Lane, ...] = ("compute", "copy_out", "copy_in")
Block = tuple[str, int]  # ("gpu" | "cpu", block id)


@dataclass(frozen=True)
class Access:
    """The KV blocks an op reads and writes."""

    reads: frozenset[Block] = frozenset()
    writes: frozenset[Block] = frozenset()


@dataclass(frozen=True)
class Span:
    """An op's begin and end markers (backend-specific)."""

    begin: Any
    end: Any


class Streams(Protocol):
    def run(
        self,
        lane: Lane,
        fn: Callable[[], None],
        after: Sequence[Span] = (),
        access: Callable[[], Access] | None = None,
        label: str = "",
    ) -> Span:
        """Enqueue `fn` (which issues the op's device work) on `lane`, behind the ends of `after`."""
        ...

    def wait(self, span: Span) -> None:
        """Block the host until the op is done."""
        ...

    def mark(self) -> Any:
        """A marker for the host's "now" on the device clock."""
        ...

    def seconds(self, a: Any, b: Any) -> float:
        """Device time from marker `a` to marker `b` (both done)."""
        ...


class HostStreams:
    """Every op runs at once, in the order it is enqueued (CPU)."""

    def run(
        self,
        lane: Lane,
        fn: Callable[[], None],
        after: Sequence[Span] = (),
        access: Callable[[], Access] | None = None,
        label: str = "",
    ) -> Span:
        begin = time.perf_counter()
        fn()
        return Span(begin, time.perf_counter())

    def wait(self, span: Span) -> None:
        pass

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a


class CudaStreams:
    """One CUDA stream per lane (`compute` is the current stream); waits are event waits."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams: dict[str, torch.cuda.Stream] = {
            "compute": torch.cuda.current_stream(device),
            "copy_out": torch.cuda.Stream(device),
            "copy_in": torch.cuda.Stream(device),
        }
        self._marker_stream = torch.cuda.Stream(device)  # idle: an event there completes at once

    def run(
        self,
        lane: Lane,
        fn: Callable[[], None],
        after: Sequence[Span] = (),
        access: Callable[[], Access] | None = None,
        label: str = "",
    ) -> Span:
        stream = self.streams[lane]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            for span in after:
                stream.wait_event(span.end)
            begin.record()
            fn()
            end.record()
        return Span(begin, end)

    def wait(self, span: Span) -> None:
        span.end.synchronize()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._marker_stream)
        return event

    def seconds(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        return a.elapsed_time(b) / 1000.0


@dataclass
class Op:
    id: int
    lane: Lane
    label: str
    fn: Callable[[], None]
    deps: frozenset[int]
    access: Access
    begin: float = 0.0
    end: float = 0.0
    done: bool = False


@dataclass
class RecordingStreams:
    """Deferred ops, a recorded dependency graph, and execution in a random valid order."""

    seed: int = 0
    ops: list[Op] = field(default_factory=list)
    _pending: list[Op] = field(default_factory=list)
    _tail: dict[str, int] = field(default_factory=dict)  # lane -> its newest op
    _host_waited: dict[str, set[int]] = field(default_factory=dict)  # lane -> ops its next op comes after
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def run(
        self,
        lane: Lane,
        fn: Callable[[], None],
        after: Sequence[Span] = (),
        access: Callable[[], Access] | None = None,
        label: str = "",
    ) -> Span:
        deps = {span.end for span in after} | self._host_waited.pop(lane, set())
        if lane in self._tail:
            deps.add(self._tail[lane])
        op = Op(len(self.ops), lane, label, fn, frozenset(deps), access() if access else Access())
        self.ops.append(op)
        self._pending.append(op)
        self._tail[lane] = op.id
        return Span(("begin", op.id), op.id)

    def wait(self, span: Span) -> None:
        """Run pending ops, choosing at random among those whose dependencies are done, until
        the op is done."""
        target = self.ops[span.end]
        while not target.done:
            ready = [op for op in self._pending if all(self.ops[d].done for d in op.deps)]
            self._execute(self._rng.choice(ready))
        for lane in LANES:  # whatever the host enqueues from now on comes after this op
            self._host_waited.setdefault(lane, set()).add(target.id)

    def drain(self) -> None:
        while self._pending:
            self.wait(Span(None, self._pending[-1].id))

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        return self._time(b) - self._time(a)

    def _time(self, marker: Any) -> float:
        if isinstance(marker, tuple):
            return self.ops[marker[1]].begin
        return self.ops[marker].end if isinstance(marker, int) else marker

    def _execute(self, op: Op) -> None:
        op.begin = time.perf_counter()
        op.fn()
        op.end = time.perf_counter()
        op.done = True
        self._pending.remove(op)
