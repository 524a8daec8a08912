"""Rate sweeps: every policy (and knob variant) at every rate on the same workload, with progress."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from superinfer.sim.config import SimConfig
from superinfer.sim.report import point_report
from superinfer.sim.simulator import simulate
from superinfer.sim.workload_spec import WorkloadSpec, make_workload, trace_speedup

# --vary keys: where each one goes (RotaryParams fields, SimConfig fields, or both).
ROTARY_KNOBS = ("alpha", "beta_f", "beta_b", "min_residency_s", "tbt_headroom")
CONFIG_KNOBS = {"duplex": str, "write_through": bool, "max_num_seqs": int, "max_num_batched_tokens": int}


@dataclass(frozen=True)
class Variant:
    """A policy with some knobs set: `rotary`, or `rotary[alpha=1]`."""

    policy: str
    knobs: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        if not self.knobs:
            return self.policy
        return f"{self.policy}[{','.join(f'{k}={v}' for k, v in self.knobs)}]"

    def apply(self, base: SimConfig) -> SimConfig:
        rotary: dict[str, Any] = {}
        config: dict[str, Any] = {"policy": self.policy}
        for key, value in self.knobs:
            if key in ROTARY_KNOBS:
                rotary[key] = float(value)
            elif key == "transfer_budget_blocks":
                config[key] = int(value)
            elif key in CONFIG_KNOBS:
                kind = CONFIG_KNOBS[key]
                config[key] = value.lower() in ("1", "true", "yes", "on") if kind is bool else kind(value)
            else:
                known = [*ROTARY_KNOBS, "transfer_budget_blocks", *CONFIG_KNOBS]
                raise ValueError(f"unknown knob {key!r}; choose one of {', '.join(known)}")
        params = dataclasses.replace(base.rotary, **rotary) if rotary else base.rotary
        return dataclasses.replace(base, rotary=params, **config)


def variants(policies: Sequence[str], vary: Sequence[str]) -> list[Variant]:
    """Each policy; with `vary` (KEY=V1,V2,...), rotary once per value of each knob instead."""
    out = [Variant(p) for p in policies if not (vary and p == "rotary")]
    for spec in vary:
        key, _, values = spec.partition("=")
        if not values:
            raise ValueError(f"--vary takes KEY=V1,V2,..., got {spec!r}")
        out += [Variant("rotary", ((key.strip(), v.strip()),)) for v in values.split(",")]
    return out


@dataclass
class Sweep:
    points: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # label -> report per rate
    ttfts_ms: dict[str, list[float]] = field(default_factory=dict)  # label -> TTFTs at the top rate (CDFs)


def run_point(config: SimConfig, workload: WorkloadSpec, rate: float) -> tuple[dict[str, float], list[float]]:
    result = simulate(config, make_workload(workload, rate), seed=workload.seed)
    report = point_report(result)
    report["rate"] = rate
    if workload.replays_arrivals:
        report["trace_speedup"] = trace_speedup(workload, rate)
    return report, [t.ttft * 1000.0 for t in result.timings if t.ttft is not None]


def run_sweep(
    base: SimConfig,
    workload: WorkloadSpec,
    runs: Sequence[Variant],
    rates: Sequence[float],
    on_point: Callable[[str, float, dict[str, float]], None] | None = None,
    jobs: int = 1,
) -> Sweep:
    """Every variant at every rate; `jobs` > 1 runs points in that many processes (results are the
    same: each point is deterministic)."""
    tasks = [(v.label, v.apply(base), rate) for v in runs for rate in rates]
    done: dict[tuple[str, float], tuple[dict[str, float], list[float]]] = {}

    def finish(label: str, rate: float, out: tuple[dict[str, float], list[float]]) -> None:
        done[label, rate] = out
        if on_point is not None:
            on_point(label, rate, out[0])

    if jobs <= 1:
        for label, config, rate in tasks:
            finish(label, rate, run_point(config, workload, rate))
    else:
        with ProcessPoolExecutor(jobs) as pool:
            futures = {pool.submit(run_point, config, workload, rate): (label, rate) for label, config, rate in tasks}
            for future in as_completed(futures):
                finish(*futures[future], future.result())
    sweep = Sweep()
    for v in runs:
        sweep.points[v.label] = [done[v.label, rate][0] for rate in rates]
        sweep.ttfts_ms[v.label] = done[v.label, rates[-1]][1]
    return sweep
