"""Latency pressure per SLO class: each class's p90 TTFT and TBT against that class's own targets,
and its stalled streams (a worst gap past the class's stall budget) against a small share of its
finished requests: a stream that freezes for seconds misses TBT even when the p90 gap looks fine.

Pooling the classes would hold a lenient class (batch: 30 s to the first token) to the strict
targets of the spec and scale up while every request meets its SLO, so the autoscaler looks at
one class at a time. A class's targets are those the engine exports (slo_target_seconds), else
the spec's, else the default class's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from superinfer.engine.contract import BUILTIN_SLO_CLASSES, DEFAULT_SLO_CLASS
from superinfer.operator.api.inference_service import SLOSpec
from superinfer.operator.autoscaling.pod_metrics import WindowStats

# A class is in distress when more of its finished requests than this stalled past their stall
# budget in the window (the engine judges each stream against its own class's budget).
STALLED_SHARE_LIMIT = 0.01


@dataclass(frozen=True)
class Targets:
    ttft_ms: float
    tbt_ms: float


@dataclass(frozen=True)
class ClassLatency:
    """One class's p90s over the window and the targets they are held to."""

    name: str
    requests: float  # finished requests of the class in the window
    ttft_p90_ms: float | None
    tbt_p90_ms: float | None
    targets: Targets
    stalled: float = 0.0  # of `requests`, the streams whose worst gap exceeded the stall budget

    @property
    def stalled_share(self) -> float | None:
        return self.stalled / self.requests if self.requests else None


def spec_targets(slo: SLOSpec) -> dict[str, Targets]:
    """The targets the spec gives each class: slo.classes (the engine's built-ins when unset) and
    `default` (slo.ttftMs/tbtMs)."""
    if slo.classes is not None:
        named = {name: Targets(c.ttft_ms, c.tbt_ms) for name, c in slo.classes.items()}
    else:
        named = {name: Targets(c["ttft_ms"], c["tbt_ms"]) for name, c in BUILTIN_SLO_CLASSES.items()}
    return {**named, DEFAULT_SLO_CLASS: Targets(slo.ttft_ms, slo.tbt_ms)}


def class_latencies(s: WindowStats, known: Mapping[str, Targets], default: Targets) -> list[ClassLatency]:
    """Every class with traffic in the window, with its targets. A window without classes (a
    source that does not label by class) is one class, `default`, of all requests."""
    if not s.classes:
        return [ClassLatency(DEFAULT_SLO_CLASS, s.requests, s.ttft_p90_ms, s.tbt_p90_ms, default)]
    out = []
    for name, c in s.classes.items():
        fallback = known.get(name, default)
        targets = Targets(c.ttft_target_ms or fallback.ttft_ms, c.tbt_target_ms or fallback.tbt_ms)
        out.append(ClassLatency(name, c.requests, c.ttft_p90_ms, c.tbt_p90_ms, targets, c.stalled))
    return out


def over_targets(c: ClassLatency) -> list[tuple[float, str]]:
    """(how far over, why) for each of the class's p90s above its target, and for its stalls."""
    out = []
    for kind, p90, target in (("TTFT", c.ttft_p90_ms, c.targets.ttft_ms), ("TBT", c.tbt_p90_ms, c.targets.tbt_ms)):
        if p90 is not None and p90 > target:
            out.append((p90 / target, f"p90 {kind} {p90:.0f}ms > {target:g}ms (class {c.name})"))
    return out + over_stall_limit(c)


def over_stall_limit(c: ClassLatency) -> list[tuple[float, str]]:
    """(ratio, why) when the class's share of stalled streams is over STALLED_SHARE_LIMIT. The ratio
    is that of the stall-free shares, as attainment's: 10% stalled asks for ~1.1x the replicas."""
    share = c.stalled_share
    if share is None or share <= STALLED_SHARE_LIMIT:
        return []
    ratio = max((1 - STALLED_SHARE_LIMIT) / max(1 - share, 0.05), 1.01)
    why = f"{share:.1%} of requests stalled past the stall budget > {STALLED_SHARE_LIMIT:.0%} (class {c.name})"
    return [(ratio, why)]
