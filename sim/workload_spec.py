"""The simulated load: Poisson/gamma arrivals at a rate for a duration, lengths synthetic or from a
trace (workload/arrivals.py's generators, so `superinfer bench` and `simulate` see the same requests).

A CSV trace in Azure's LLM inference format replays its own arrivals instead (`azure_trace`): over
a window of the trace, compressed by a speed-up, and at a given rate compressed further to reach it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

from superinfer.engine.slo import SLO
from superinfer.workload.arrivals import (
    WorkItem,
    azure_trace,
    gamma_arrivals,
    is_arrival_trace,
    load_trace,
    lognormal_lengths,
    mean_rate,
)


@dataclass(frozen=True)
class WorkloadSpec:
    duration_s: float = 60.0
    seed: int = 0
    slo: SLO = field(default_factory=lambda: SLO(5000.0, 100.0))
    prompt_median: float = 150.0
    output_median: float = 200.0
    max_prompt: int = 1024
    max_output: int = 8192
    burstiness: float = 1.0  # gamma shape of inter-arrival times: 1 is Poisson, below 1 burstier
    # JSONL {"prompt","generated"} or ShareGPT JSON: lengths from it; an Azure CSV: arrivals too
    trace: Path | None = None
    trace_speedup: float = 1.0  # arrival-trace replay: arrivals compressed by this factor
    length_scale: float = 1.0  # arrival-trace replay: lengths times this, clamped to [1, max]
    trace_start_s: float = 0.0  # arrival-trace window, in trace seconds from its first row
    trace_duration_s: float | None = None  # None: to the trace's end

    @property
    def replays_arrivals(self) -> bool:
        return self.trace is not None and is_arrival_trace(self.trace)


def replayed(spec: WorkloadSpec) -> tuple[WorkItem, ...]:
    """The arrival trace's window at the spec's speed-up (read once per spec, file version and process)."""
    if spec.trace is None:
        raise ValueError("the workload has no trace")
    return _replayed(spec, spec.trace.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _replayed(spec: WorkloadSpec, mtime_ns: int) -> tuple[WorkItem, ...]:
    assert spec.trace is not None
    items = azure_trace(
        spec.trace,
        speedup=spec.trace_speedup,
        length_scale=spec.length_scale,
        start_s=spec.trace_start_s,
        duration_s=spec.trace_duration_s,
        max_prompt=spec.max_prompt,
        max_output=spec.max_output,
        slo=spec.slo,
    )
    return tuple(items)


def trace_rate(spec: WorkloadSpec) -> float:
    """The replayed trace's mean arrival rate at the spec's speed-up (requests per second)."""
    rate = mean_rate(replayed(spec))
    if not math.isfinite(rate):
        raise ValueError(f"every request of {spec.trace}'s window arrives at once: it has no rate")
    return rate


def trace_speedup(spec: WorkloadSpec, rate: float) -> float:
    """The speed-up over the trace's own time that replays it at `rate`."""
    return spec.trace_speedup * rate / trace_rate(spec)


def compressed(items: tuple[WorkItem, ...], factor: float) -> list[WorkItem]:
    """Arrivals `factor` times closer together (lengths kept)."""
    if not factor > 0:
        raise ValueError(f"a trace replays at a positive rate, not {factor:g} times its own")
    if factor == 1.0:
        return list(items)
    return [dataclasses.replace(i, arrival_s=i.arrival_s / factor) for i in items]


def make_workload(spec: WorkloadSpec, rate: float) -> list[WorkItem]:
    """`rate` x `duration_s` requests (their arrivals within the duration), same seed at every rate.

    An arrival trace is replayed whole (its window), compressed so its mean rate is `rate`.
    """
    if spec.replays_arrivals:
        return compressed(replayed(spec), rate / trace_rate(spec))
    n = max(1, round(rate * spec.duration_s))
    if spec.trace is not None:
        items = load_trace(spec.trace, rate, spec.slo, seed=spec.seed, limit=n)
        if spec.burstiness != 1.0:  # load_trace draws Poisson arrivals
            arrivals = gamma_arrivals(rate, len(items), spec.seed, spec.burstiness)
            items = [dataclasses.replace(i, arrival_s=t) for i, t in zip(items, arrivals, strict=True)]
        return [i for i in items if i.arrival_s <= spec.duration_s] or items[:1]
    arrivals = [t for t in gamma_arrivals(rate, n, spec.seed, spec.burstiness) if t <= spec.duration_s] or [0.0]
    prompts = lognormal_lengths(len(arrivals), spec.prompt_median, 0.9, 4, spec.max_prompt, spec.seed + 1)
    outputs = lognormal_lengths(len(arrivals), spec.output_median, 0.9, 4, spec.max_output, spec.seed + 2)
    return [WorkItem(t, p, o, spec.slo) for t, p, o in zip(arrivals, prompts, outputs, strict=True)]
