"""Capacity planning: the highest rate one replica sustains at an attainment target (bisection),
and how many replicas a rate needs (requests spread evenly: each replica sees a Poisson load of
rate / N, since thinning a Poisson process leaves a Poisson process)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class MaxRate:
    rate: float  # the highest rate found to meet the target (0 if none did)
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, metric) in probe order
    bounded: bool = True  # False: even `hi` met the target after expanding


def max_rate(
    metric_at: Callable[[float], float],
    target: float,
    lo: float = 1.0,
    hi: float = 64.0,
    rel_tol: float = 0.02,
    max_expand: int = 6,
) -> MaxRate:
    """Bisect for the highest rate whose metric (e.g. goodput share) is at least `target`, assuming
    the metric does not rise with the rate. `hi` doubles while it still meets the target."""
    out = MaxRate(0.0)

    def ok(rate: float) -> bool:
        value = metric_at(rate)
        out.probes.append((rate, value))
        return value >= target

    lo_ok = False  # known to meet the target (it was a `hi` that did)
    for _ in range(max_expand):
        if not ok(hi):
            break
        lo, hi, lo_ok = hi, hi * 2, True
    else:
        out.rate, out.bounded = lo, False
        return out
    if not lo_ok and not ok(lo):
        while lo > 1e-3:  # walk down until something meets it
            hi, lo = lo, lo / 2
            if ok(lo):
                break
        else:
            return out
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    out.rate = lo
    return out


def replicas_for(rate: float, per_replica: float) -> int:
    """Replicas needed for `rate` when one sustains `per_replica`."""
    if per_replica <= 0:
        raise ValueError("one replica sustains no load at this target: no replica count meets it")
    return max(1, math.ceil(rate / per_replica - 1e-9))
