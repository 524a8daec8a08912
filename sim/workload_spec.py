"""The simulated load: Poisson/gamma arrivals at a rate for a duration, lengths synthetic or from a
trace (bench/workload.py's generators, so `superinfer bench` and `simulate` see the same requests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from superinfer.bench.workload import WorkItem, gamma_arrivals, load_trace, lognormal_lengths
from superinfer.engine.slo import SLO


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
    trace: Path | None = None  # JSONL {"prompt","generated"} or ShareGPT JSON: lengths from it


def make_workload(spec: WorkloadSpec, rate: float) -> list[WorkItem]:
    """`rate` x `duration_s` requests (their arrivals within the duration), same seed at every rate."""
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
