"""Attainment and goodput of a run, from each request's client-side token times (see engine/slo.py
for the definitions)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from superinfer.engine.slo import SLO, meets_stall, meets_tbt, meets_ttft, p99_gap, percentile, tpot

# Reports give the share of started streams that stopped longer than this once, whatever their SLO:
# past a second a reader sees a stream stop.
VISIBLE_STALL_S = 1.0


@dataclass(frozen=True)
class RequestTiming:
    """Wall-clock times (seconds) of one request: arrival and each output token."""

    arrival: float
    token_times: tuple[float, ...]
    slo: SLO = field(default_factory=SLO)
    error: str | None = None  # why the request failed (HTTP error, dropped connection): it met no SLO
    slo_class: str | None = None  # for the per-class reports (summarize_classes)

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
    def worst_gap(self) -> float | None:
        """The longest stall of the stream after its first token; None with fewer than two tokens."""
        t = self.token_times
        return max(b - a for a, b in itertools.pairwise(t)) if len(t) > 1 else None

    @property
    def ttft_met(self) -> bool:
        return self.error is None and meets_ttft(self.ttft, self.slo)

    @property
    def tbt_p99_met(self) -> bool:
        return meets_tbt(p99_gap(self.gaps), self.slo)

    @property
    def stall_met(self) -> bool:
        return meets_stall(self.worst_gap, self.slo)

    @property
    def tbt_met(self) -> bool:
        """p99 gap within the TBT SLO and worst gap within the stall budget."""
        return self.tbt_p99_met and self.stall_met

    @property
    def tbt_mean_met(self) -> bool:
        return meets_tbt(self.tpot, self.slo)


def summarize(timings: Sequence[RequestTiming], duration_s: float | None = None) -> dict[str, float]:
    """Attainment, goodput and latency percentiles of finished requests (milliseconds for latencies).

    `tbt_attainment` and `goodput_share` judge TBT by each request's p99 gap and its worst gap
    (stall budget); `tbt_p99_attainment` by the p99 gap alone, the `_mean_` keys by the mean gap.
    Stalls: each started stream's worst gap (p50/p99/max over the streams), the share of streams
    that stopped over VISIBLE_STALL_S once and the share past their stall budget. With
    `duration_s`: throughput and goodput per second.
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
    worst = [(t.worst_gap, t) for t in timings if t.worst_gap is not None]
    worst_ms = [w * 1000.0 for w, _ in worst]

    def share(count: int) -> float:
        return count / n if n else math.nan

    out = {
        "requests": float(n),
        "failed": float(sum(t.error is not None for t in timings)),
        "output_tokens": float(sum(len(t.token_times) for t in timings)),
        "ttft_attainment": share(sum(t.ttft_met for t in timings)),
        "tbt_attainment": share(sum(t.tbt_met for t in timings)),
        "tbt_p99_attainment": share(sum(t.tbt_p99_met for t in timings)),
        "stall_attainment": share(sum(t.stall_met for t in timings)),
        "tbt_mean_attainment": share(sum(t.tbt_mean_met for t in timings)),
        "goodput_share": share(good),
        "goodput_mean_share": share(sum(t.ttft_met and t.tbt_mean_met for t in timings)),
        "tbt_token_attainment": gaps_ok / len(all_gaps) if all_gaps else math.nan,
        "goodput_p99_share": share(sum(t.ttft_met and t.tbt_p99_met for t in timings)),
        "streams": float(len(worst)),
        "stalled_1s_share": sum(w > VISIBLE_STALL_S for w, _ in worst) / len(worst) if worst else math.nan,
        "stalled_budget_share": sum(not t.stall_met for _, t in worst) / len(worst) if worst else math.nan,
        "worst_gap_p50_ms": percentile(worst_ms, 50),
        "worst_gap_p99_ms": percentile(worst_ms, 99),
        "worst_gap_max_ms": max(worst_ms, default=math.nan),
    }
    for q in (50, 90, 99):
        out[f"ttft_p{q}_ms"] = percentile(ttfts, q)
        out[f"tpot_p{q}_ms"] = percentile(tpots, q)
        out[f"tbt_p{q}_ms"] = percentile(all_gaps, q)
    if duration_s:
        out["throughput_tok_s"] = out["output_tokens"] / duration_s
        out["goodput_rps"] = good / duration_s
    return out


def summarize_classes(timings: Sequence[RequestTiming], duration_s: float | None = None) -> dict[str, dict[str, float]]:
    """`summarize` of each SLO class's requests (RequestTiming.slo_class; unlabelled ones are left out)."""
    classes: dict[str, list[RequestTiming]] = {}
    for t in timings:
        if t.slo_class is not None:
            classes.setdefault(t.slo_class, []).append(t)
    return {name: summarize(group, duration_s) for name, group in sorted(classes.items())}
