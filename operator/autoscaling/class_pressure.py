"""Latency pressure per SLO class: each class's p90 TTFT and TBT against that class's own targets.

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
        out.append(ClassLatency(name, c.requests, c.ttft_p90_ms, c.tbt_p90_ms, targets))
    return out


def over_targets(c: ClassLatency) -> list[tuple[float, str]]:
    """(p90 / target, why) for each of the class's p90s above its target."""
    out = []
    for kind, p90, target in (("TTFT", c.ttft_p90_ms, c.targets.ttft_ms), ("TBT", c.tbt_p90_ms, c.targets.tbt_ms)):
        if p90 is not None and p90 > target:
            out.append((p90 / target, f"p90 {kind} {p90:.0f}ms > {target:g}ms (class {c.name})"))
    return out
