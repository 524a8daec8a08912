"""Fleet loads: a compressed diurnal day, a flash crowd, and an Azure trace replayed at fleet scale.

Synthetic arrivals are an inhomogeneous Poisson process (thinning against the peak rate) with
workload/arrivals.py's lognormal lengths, so the same seed gives the same requests at every setup.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from superinfer.engine.slo import SLO
from superinfer.workload.arrivals import WorkItem, azure_trace, lognormal_lengths, mean_rate


@dataclass(frozen=True)
class Lengths:
    prompt_median: float = 150.0
    output_median: float = 200.0
    max_prompt: int = 1024
    max_output: int = 8192


def arrivals(rate_at: Callable[[float], float], peak: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process with rate `rate_at(t)` <= `peak` on [0, duration_s)."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return out
        if rng.random() * peak < rate_at(t):
            out.append(t)


def with_lengths(times: list[float], slo: SLO, lengths: Lengths, seed: int) -> list[WorkItem]:
    n = len(times)
    prompts = lognormal_lengths(n, lengths.prompt_median, 0.9, 4, lengths.max_prompt, seed + 1)
    outputs = lognormal_lengths(n, lengths.output_median, 0.9, 4, lengths.max_output, seed + 2)
    return [WorkItem(t, p, o, slo) for t, p, o in zip(times, prompts, outputs, strict=True)]


def diurnal_rate(low: float, high: float, day_s: float) -> Callable[[float], float]:
    """A day's rate compressed into `day_s`: lowest at the start (night), highest at the middle."""
    return lambda t: low + (high - low) * 0.5 * (1 - math.cos(2 * math.pi * t / day_s))


def diurnal(low: float, high: float, day_s: float, slo: SLO, lengths: Lengths = Lengths(), seed: int = 0):
    return with_lengths(arrivals(diurnal_rate(low, high, day_s), high, day_s, seed), slo, lengths, seed)


def flash_rate(base: float, factor: float, start_s: float, length_s: float) -> Callable[[float], float]:
    return lambda t: base * factor if start_s <= t < start_s + length_s else base


def flash_crowd(
    base: float,
    duration_s: float,
    slo: SLO,
    factor: float = 5.0,
    start_s: float = 180.0,
    length_s: float = 120.0,
    lengths: Lengths = Lengths(),
    seed: int = 0,
) -> list[WorkItem]:
    """`base` req/s, `factor` times that for `length_s` from `start_s`."""
    times = arrivals(flash_rate(base, factor, start_s, length_s), base * factor, duration_s, seed)
    return with_lengths(times, slo, lengths, seed)


def trace_at_rate(
    path: Path,
    rate: float,
    slo: SLO,
    start_s: float = 0.0,
    duration_s: float | None = None,
    lengths: Lengths = Lengths(),
) -> list[WorkItem]:
    """An Azure trace's window with its own arrivals, compressed so its mean rate is `rate`."""
    own = azure_trace(path, start_s=start_s, duration_s=duration_s, max_prompt=lengths.max_prompt,
                      max_output=lengths.max_output, slo=slo)  # fmt: skip
    speedup = rate / mean_rate(own)
    return azure_trace(path, speedup=speedup, start_s=start_s, duration_s=duration_s,
                       max_prompt=lengths.max_prompt, max_output=lengths.max_output, slo=slo)  # fmt: skip


def peak_rate(items: list[WorkItem], window_s: float = 60.0) -> float:
    """The highest arrival rate over any window of `window_s` (sliding over arrivals; a load
    shorter than the window: its mean rate)."""
    times = sorted(i.arrival_s for i in items)
    if not times:
        return 0.0
    width = min(window_s, times[-1] - times[0]) or 1e-9
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > width:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / width


def average_rate(items: list[WorkItem]) -> float:
    times = [i.arrival_s for i in items]
    return len(times) / max(max(times) - min(times), 1e-9) if times else 0.0
