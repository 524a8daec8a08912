"""Stalls on simulated replicas: `rotary` against `fcfs`, judged per stream, as one command.

Llama-3-8B, 8 GiB of GPU KV, SLO 5 s / 100 ms with the default stall budget (500 ms): Poisson
arrivals under capacity (20-40 req/s) and at the paper's overload (60 req/s) on the GH200 and H100
profiles; with `--trace`, a window of an Azure LLM inference trace replayed with its own arrivals
(4 GiB KV, lengths x0.5) under capacity (x4) and past the knee (x10). Each point reports stall-aware
goodput, the share of streams stalled over 1 s and past their budget, each stream's worst gap
(p99 / max) and tokens/s; the goals are issue 47's. Result:
bench/results/sim-stalls-cpu-<date>.json.

    python -m bench.sim_stalls
    python -m bench.sim_stalls --trace ~/data/azure/AzureLLMInferenceTrace_conv.csv
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from superinfer.engine.slo import SLO
from superinfer.sim.config import SimConfig
from superinfer.sim.sweep import run_point
from superinfer.sim.workload_spec import WorkloadSpec
from superinfer.workload.record import write_result

POLICIES = ("fcfs", "rotary")
KEYS = (
    "goodput_share",
    "goodput_p99_share",
    "ttft_attainment",
    "tbt_attainment",
    "stalled_1s_share",
    "stalled_budget_share",
    "worst_gap_p99_ms",
    "worst_gap_max_ms",
    "throughput_tok_s",
    "rotations_per_request",
    "recomputes",
)


@dataclasses.dataclass(frozen=True)
class Point:
    name: str
    config: SimConfig
    workload: WorkloadSpec
    rate: float
    overloaded: bool


def points(args: argparse.Namespace) -> list[Point]:
    slo = SLO(5000.0, 100.0)
    poisson = WorkloadSpec(duration_s=args.duration, seed=args.seed, slo=slo)
    out = []
    for hardware in ("gh200", "h100"):
        config = SimConfig(hardware=hardware, gpu_kv_gib=8.0)
        out += [Point(f"{hardware}-poisson-{r:g}", config, poisson, r, False) for r in (20.0, 40.0)]
        out.append(Point(f"{hardware}-poisson-60", config, poisson, 60.0, True))
    if args.trace is not None:
        config = SimConfig(hardware="gh200", gpu_kv_gib=4.0)
        for speedup, overloaded in ((4.0, False), (10.0, True)):
            trace = dataclasses.replace(
                poisson,
                trace=args.trace,
                trace_speedup=speedup,
                length_scale=0.5,
                trace_start_s=600.0,
                trace_duration_s=600.0,
            )
            out.append(Point(f"gh200-trace-x{speedup:g}", config, trace, 0.0, overloaded))
    return out


def run(point: Point) -> dict[str, dict[str, float]]:
    """Each policy's figures at the point (a trace at its own rate: `rate` 0)."""
    from superinfer.sim.workload_spec import trace_rate

    rate = point.rate or trace_rate(point.workload)
    figures = {}
    for policy in POLICIES:
        report, _ = run_point(dataclasses.replace(point.config, policy=policy), point.workload, rate)
        figures[policy] = {k: report[k] for k in KEYS} | {"rate": rate}
        print(f"  {point.name:22s} {policy:7s} " + "  ".join(f"{k} {figures[policy][k]:.3g}" for k in KEYS), flush=True)
    return figures


def verdict(point: Point, f: dict[str, dict[str, float]]) -> dict[str, float | bool]:
    """Issue 47's lines: under capacity rotary at least as good as fcfs on stall-aware goodput and
    stalls; overloaded, its stalled share within fcfs's + 2 points and (past the knee) its tokens/s
    at least 0.95x fcfs's."""
    r, c = f["rotary"], f["fcfs"]
    out: dict[str, float | bool] = {
        "goodput_ratio": r["goodput_share"] / c["goodput_share"] if c["goodput_share"] else float("inf"),
        "stalled_1s_points_over_fcfs": 100 * (r["stalled_1s_share"] - c["stalled_1s_share"]),
        "throughput_ratio": r["throughput_tok_s"] / c["throughput_tok_s"],
    }
    if point.overloaded:
        out["met"] = out["stalled_1s_points_over_fcfs"] <= 2.0 and out["throughput_ratio"] >= 0.95
    else:
        out["met"] = r["goodput_share"] >= c["goodput_share"] and r["stalled_budget_share"] <= c["stalled_budget_share"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of Poisson arrivals per point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, default=None, help="an Azure LLM inference trace (CSV), read, never kept")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    figures, verdicts = {}, {}
    for point in points(args):
        figures[point.name] = run(point)
        verdicts[point.name] = verdict(point, figures[point.name])
        print(f"  {point.name}: {verdicts[point.name]}", flush=True)
    goal = {
        "under capacity": "rotary's stall-aware goodput >= fcfs's, its streams past budget <= fcfs's",
        "overloaded": "streams stalled over 1 s <= fcfs's + 2 points; tokens/s >= 0.95x fcfs's",
    }
    path = write_result("sim-stalls", "cpu", {"points": figures, "verdicts": verdicts}, goal, tag=args.tag)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
