"""A fleet run's figures: per-class attainment and stall-aware goodput (workload/goodput.py), cost in
replica-seconds, the scale events, a timeline by arrival window, and how long each scale-down left
a class under its attainment target."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from superinfer.sim.fleet.fleet import FleetResult, Sample
from superinfer.workload.goodput import RequestTiming, summarize, summarize_classes

KEYS = (
    "requests",
    "failed",
    "ttft_attainment",
    "tbt_attainment",
    "goodput_share",
    "goodput_p99_share",
    "stalled_1s_share",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tbt_p99_ms",
    "worst_gap_p99_ms",
    "goodput_rps",
    "throughput_tok_s",
)


def _pick(report: dict[str, float]) -> dict[str, float]:
    return {k: report[k] for k in KEYS if k in report}


def by_window(timings: Sequence[RequestTiming], start: float, end: float, width: float) -> list[list[RequestTiming]]:
    """Requests grouped by the window of `width` seconds their arrival falls in."""
    n = max(1, math.ceil((end - start) / width))
    out: list[list[RequestTiming]] = [[] for _ in range(n)]
    for t in timings:
        i = int((t.arrival - start) // width)
        if 0 <= i < n:
            out[i].append(t)
    return out


def good(t: RequestTiming) -> bool:
    return t.ttft_met and t.tbt_met


def class_shares(group: Sequence[RequestTiming]) -> dict[str, float]:
    """Each class's goodput share (stall-aware) among `group`."""
    classes: dict[str, list[bool]] = {}
    for t in group:
        classes.setdefault(t.slo_class or "default", []).append(good(t))
    return {name: sum(v) / len(v) for name, v in classes.items()}


def timeline(result: FleetResult, width: float) -> list[dict[str, Any]]:
    """Per window of arrivals: the request rate, each class's goodput share, and the fleet's mean
    desired and ready replicas over the window."""
    end = result.end_s
    windows = by_window(result.timings, 0.0, end, width)
    rows = []
    for i, group in enumerate(windows):
        lo, hi = i * width, (i + 1) * width
        inside = [s for s in result.samples if lo <= s.time < hi] or [_last_before(result.samples, lo)]
        rows.append(
            {
                "t": lo,
                "rate": len(group) / width,
                "goodput_share": sum(map(good, group)) / len(group) if group else math.nan,
                "classes": class_shares(group),
                "desired": sum(s.desired for s in inside) / len(inside),
                "ready": sum(s.ready for s in inside) / len(inside),
            }
        )
    return rows


def _last_before(samples: Sequence[Sample], t: float) -> Sample:
    before = [s for s in samples if s.time <= t]
    return before[-1] if before else samples[0]


def scale_down_breaches(result: FleetResult, target: float, window_s: float) -> list[dict[str, Any]]:
    """For each scale-down: how many consecutive windows of `window_s` (by arrival, from the
    scale-down on) had some class's goodput share under `target`, and which classes."""
    out = []
    for event in result.events:
        if event.to_replicas >= event.from_replicas:
            continue
        windows = by_window(result.timings, event.time, result.end_s, window_s)
        below, worst = 0, {}
        for group in windows:
            shares = class_shares(group)
            under = {name: share for name, share in shares.items() if share < target}
            if not under:
                break
            below += 1
            worst = under
        out.append({"time": event.time, "to": event.to_replicas, "windows_below": below, "classes": worst})
    return out


def fleet_report(
    result: FleetResult, target: float = 0.95, window_s: float = 120.0, timeline_s: float = 30.0
) -> dict[str, Any]:
    """Everything a run measured, JSON-ready."""
    timings = result.timings
    arrivals = [t.arrival for t in timings]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    duration = max(result.end_s, 1e-9)
    overall = _pick(summarize(timings, duration))
    breaches = scale_down_breaches(result, target, window_s)
    return {
        "overall": overall,
        "classes": {name: _pick(r) for name, r in summarize_classes(timings, duration).items()},
        "replica_seconds": result.replica_seconds,
        "mean_replicas": result.replica_seconds / duration,
        "peak_replicas": max((s.desired for s in result.samples), default=0),
        "replicas_created": result.replicas_created,
        "scale_ups": sum(e.to_replicas > e.from_replicas for e in result.events),
        "scale_downs": sum(e.to_replicas < e.from_replicas for e in result.events),
        "events": [asdict(e) for e in result.events],
        "scale_down_breaches": breaches,
        "worst_scale_down_windows_below": max((b["windows_below"] for b in breaches), default=0),
        "killed_at_drain": result.killed,
        "rejected": result.rejected,
        "routed": result.routed,
        "arrival_span_s": span,
        "end_s": result.end_s,
        "wall_s": result.wall_s,
        "timeline": timeline(result, timeline_s),
    }
