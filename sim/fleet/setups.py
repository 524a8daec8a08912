"""The autoscaling set-ups compared: the SLO autoscaler (with or without a capacity profile), the
HPA-on-queue recipe, and fixed fleets sized for the peak and for the mean from one replica's
capacity (the highest rate a single simulated replica serves at the attainment target)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from superinfer.sim.capacity import max_rate
from superinfer.sim.config import SimConfig
from superinfer.sim.fleet.autoscaler import Autoscaler, Fixed, HPAQueue, SLOAutoscaler, slo_spec
from superinfer.sim.fleet.fleet import FleetConfig, run_fleet
from superinfer.sim.fleet.report import fleet_report
from superinfer.sim.fleet.router import make_router
from superinfer.sim.fleet.scenarios import average_rate, peak_rate
from superinfer.sim.simulator import simulate
from superinfer.workload.arrivals import WorkItem
from superinfer.workload.goodput import summarize

AUTOSCALERS = ("slo", "slo-profile", "hpa", "fixed-peak", "fixed-mean")
SPEC_TARGET = 0.95  # the InferenceService's slo.attainmentTarget default: the autoscaler's and the reports'


@dataclass(frozen=True)
class Sizing:
    """What the set-ups are sized from."""

    min_replicas: int
    max_replicas: int
    rate_per_replica: float  # one replica's capacity at the target (req/s)
    peak_rate: float  # the load's highest 60 s rate
    mean_rate: float
    start_rate: float = 0.0  # the first minute's rate: what an autoscaled fleet is deployed for

    def for_rate(self, rate: float) -> int:
        return max(1, math.ceil(rate / self.rate_per_replica - 1e-9))


def make_autoscaler(
    name: str, sizing: Sizing, ttft_ms: float, tbt_ms: float, max_num_seqs: int, hpa_target: float = 5.0
) -> Autoscaler:
    lo, hi = sizing.min_replicas, sizing.max_replicas
    if name in ("slo", "slo-profile"):
        overrides = {"capacity": {"maxRatePerReplica": sizing.rate_per_replica}} if name == "slo-profile" else {}
        scaler = SLOAutoscaler(slo_spec(lo, hi, ttft_ms, tbt_ms, max_num_seqs, overrides))
        scaler.name = name
        return scaler
    if name == "hpa":
        return HPAQueue(target_waiting=hpa_target, min_replicas=lo, max_replicas=hi)
    if name == "fixed-peak":
        return Fixed(min(hi, sizing.for_rate(sizing.peak_rate)), name)
    if name == "fixed-mean":
        return Fixed(min(hi, sizing.for_rate(sizing.mean_rate)), name)
    raise ValueError(f"unknown autoscaler {name!r}; choose one of {', '.join(AUTOSCALERS)}")


def initial_replicas(scaler: Autoscaler, sizing: Sizing) -> int:
    """Fixed fleets start at their size; the others at the size the first minute's rate needs
    (as deployed for the load at hand, not cold from minReplicas)."""
    if isinstance(scaler, Fixed):
        return scaler.replicas
    return max(sizing.min_replicas, min(sizing.max_replicas, sizing.for_rate(sizing.start_rate)))


def poisson_like(items: Sequence[WorkItem], rate: float, duration_s: float, seed: int = 0) -> list[WorkItem]:
    """The load's requests (lengths and SLOs) resampled onto Poisson arrivals at `rate`."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(replace(rng.choice(items), arrival_s=t))


def replica_capacity(
    config: SimConfig, items: Sequence[WorkItem], target: float, duration_s: float = 60.0, hi: float = 48.0
) -> float:
    """The highest Poisson rate at which one replica keeps the stall-aware goodput share at
    `target`, on requests like the load's (bisection, as `simulate --max-rate`)."""

    def share(rate: float) -> float:
        load = poisson_like(items, rate, duration_s)
        return summarize(simulate(config, load).timings)["goodput_share"]

    return max_rate(share, target, lo=1.0, hi=hi, rel_tol=0.05, max_expand=1).rate


def sizing_for(items: Sequence[WorkItem], rate_per_replica: float, min_replicas: int, max_replicas: int) -> Sizing:
    items = list(items)
    first = min((i.arrival_s for i in items), default=0.0)
    start = sum(i.arrival_s < first + 60.0 for i in items) / 60.0
    return Sizing(min_replicas, max_replicas, rate_per_replica, peak_rate(items), average_rate(items), start)


@dataclass(frozen=True)
class Run:
    """One set-up on one load: an autoscaler with a router."""

    autoscaler: str
    router: str

    @property
    def label(self) -> str:
        return f"{self.autoscaler}/{self.router}"


def run_setup(
    run: Run,
    items: Sequence[WorkItem],
    config: FleetConfig,
    sizing: Sizing,
    hpa_target: float = 5.0,
    target: float = SPEC_TARGET,
    timeline_s: float = 30.0,
) -> dict[str, Any]:
    """Simulate the fleet under one set-up; its report (sim/fleet/report.py) with the set-up."""
    slo = config.default_slo
    scaler = make_autoscaler(run.autoscaler, sizing, slo.ttft_ms, slo.tbt_ms, config.replica.max_num_seqs, hpa_target)
    fleet_config = replace(config, initial_replicas=initial_replicas(scaler, sizing))
    result = run_fleet(fleet_config, make_router(run.router, config.seed), scaler, items)
    report = fleet_report(result, target=target, timeline_s=timeline_s)
    report["setup"] = {
        "autoscaler": run.autoscaler,
        "router": run.router,
        "initial_replicas": fleet_config.initial_replicas,
    }
    return report
