"""Attainment and goodput of a run, from each request's client-side token times (see engine/slo.py
for the definitions)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from superinfer.engine.slo import SLO, meets_tbt, meets_ttft, p99_gap, percentile, tpot


@dataclass(frozen=True)
class RequestTiming:
    """Wall-clock times (seconds) of one request: arrival and each output token."""

    arrival: float
    token_times: tuple[float, ...]
    slo: SLO = field(default_factory=SLO)
    error: str | None = None  # why the request failed (HTTP error, dropped connection): it met no SLO

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        t = self.token_times
        return tpot(t[0], t[-1], len(t)) if t else None

    @property
    def ttft_met(self) -> bool:
        return self.error is None and meets_ttft(self.ttft, self.slo)

    @property
    def tbt_met(self) -> bool:
        return meets_tbt(p99_gap(self.gaps), self.slo)

    @property
    def tbt_mean_met(self) -> bool:
        return meets_tbt(self.tpot, self.slo)


def summarize(timings: Sequence[RequestTiming], duration_s: float | None = None) -> dict[str, float]:
    """Attainment, goodput and latency percentiles of finished requests (milliseconds for latencies).

    `tbt_attainment` and `goodput_share` judge TBT by each request's p99 gap; the `_mean_` keys by
    its mean gap. With `duration_s`: throughput and goodput per second.
    """
    n = len(timings)
    ttfts = [t.ttft * 1000.0 for t in timings if t.ttft is not None]
    tpots = [t.tpot * 1000.0 for t in timings if t.tpot is not None]
    gaps_ok = 0
    all_gaps: list[float] = []
    for t in timings:
        gaps = [g * 1000.0 for g in t.gaps]
        gaps_ok += sum(g <= t.slo.tbt_ms for g in gaps)
        all_gaps += gaps
    good = sum(t.ttft_met and t.tbt_met for t in timings)

    def share(count: int) -> float:
        return count / n if n else math.nan

    out = {
        "requests": float(n),
        "failed": float(sum(t.error is not None for t in timings)),
        "output_tokens": float(sum(len(t.token_times) for t in timings)),
        "ttft_attainment": share(sum(t.ttft_met for t in timings)),
        "tbt_attainment": share(sum(t.tbt_met for t in timings)),
        "tbt_mean_attainment": share(sum(t.tbt_mean_met for t in timings)),
        "goodput_share": share(good),
        "goodput_mean_share": share(sum(t.ttft_met and t.tbt_mean_met for t in timings)),
        "tbt_token_attainment": gaps_ok / len(all_gaps) if all_gaps else math.nan,
    }
    for q in (50, 90, 99):
        out[f"ttft_p{q}_ms"] = percentile(ttfts, q)
        out[f"tpot_p{q}_ms"] = percentile(tpots, q)
        out[f"tbt_p{q}_ms"] = percentile(all_gaps, q)
    if duration_s:
        out["throughput_tok_s"] = out["output_tokens"] / duration_s
        out["goodput_rps"] = good / duration_s
    return out
