"""SLO definitions, in one place: used by the engine's metrics, the benchmarks and the simulator.

TTFT = first output token time - arrival time.
TBT  = gap between consecutive output tokens. A request meets its TBT SLO when the 99th percentile
       of its gaps is within the SLO *and* its worst gap (its longest stall) within its stall
       budget (default DEFAULT_STALL_FACTOR x the TBT SLO): a p99 alone lets a 256-token stream
       stop twice for 20 s and still pass. Reports also give the p99-only and mean-gap judgements
       (TPOT = (last - first) / (n - 1)), per-token TBT attainment and percentiles.
Goodput = the requests meeting both SLOs: as a share of finished requests and per second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from superinfer.engine.contract import DEFAULT_STALL_FACTOR, DEFAULT_TBT_SLO_MS, DEFAULT_TTFT_SLO_MS, MAX_SLO_MS


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = DEFAULT_TTFT_SLO_MS
    tbt_ms: float = DEFAULT_TBT_SLO_MS
    stall_ms: float | None = None  # the stall budget; None: DEFAULT_STALL_FACTOR x tbt_ms

    def __post_init__(self) -> None:
        if not (0 < self.ttft_ms <= MAX_SLO_MS and 0 < self.tbt_ms <= MAX_SLO_MS):
            raise ValueError(
                f"SLO targets must be in (0, {MAX_SLO_MS:g}] ms, got ttft_ms={self.ttft_ms} tbt_ms={self.tbt_ms}"
            )
        if self.stall_ms is not None and not self.tbt_ms <= self.stall_ms <= MAX_SLO_MS:
            raise ValueError(f"a stall budget must be in [tbt_ms, {MAX_SLO_MS:g}] ms, got stall_ms={self.stall_ms}")

    @property
    def stall_budget_ms(self) -> float:
        """The longest gap between two tokens a stream may have and still meet its TBT SLO."""
        return self.stall_ms if self.stall_ms is not None else min(MAX_SLO_MS, DEFAULT_STALL_FACTOR * self.tbt_ms)


def meets_ttft(ttft_s: float | None, slo: SLO) -> bool:
    return ttft_s is not None and ttft_s * 1000.0 <= slo.ttft_ms


def meets_tbt(gap_s: float | None, slo: SLO) -> bool:
    """A gap statistic of a request (its p99 gap, or its mean) within the TBT SLO; no gap (one
    token) meets it trivially."""
    return gap_s is None or gap_s * 1000.0 <= slo.tbt_ms


def meets_stall(worst_gap_s: float | None, slo: SLO) -> bool:
    """A request's worst gap between tokens within its stall budget; no gap meets it trivially."""
    return worst_gap_s is None or worst_gap_s * 1000.0 <= slo.stall_budget_ms


def tpot(first_token: float, last_token: float, num_tokens: int) -> float | None:
    return (last_token - first_token) / (num_tokens - 1) if num_tokens > 1 else None


def p99_gap(gaps: Sequence[float]) -> float | None:
    """The request's 99th-percentile gap between tokens; None with fewer than two tokens."""
    return percentile(gaps, 99) if gaps else None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def histogram_buckets(slo_s: float, base: Sequence[float]) -> list[float]:
    """Histogram bucket bounds that include the SLO threshold itself (so attainment is exact)."""
    return sorted(set(base) | {slo_s})


def slo_lag_seconds(t_arrival: float, t_last_token: float | None, slo: SLO, now: float) -> float:
    """How far a request that is not running is behind its SLO right now (0 when it is not): past
    its TTFT target while it has no token yet, else past its TBT target since its last token."""
    if t_last_token is None:
        return max(0.0, now - t_arrival - slo.ttft_ms / 1000.0)
    return max(0.0, now - t_last_token - slo.tbt_ms / 1000.0)
