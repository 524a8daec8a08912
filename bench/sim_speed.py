"""sim_speed: how long `superinfer simulate` takes for the protocol's point, per policy.

Llama-3-8B on the GH200 profile, 8 GiB KV pool, 120 s of Poisson arrivals at 60 req/s (goal: under
30 s on one core). The policies run in turn, `--runs` times each, so drift on a shared machine hits
them alike; every run of a policy must give the same report (its digest is recorded).

    python -m bench.sim_speed [--runs 2] [--policies fcfs,rotary] [--duration 120] [--tag T]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics

from superinfer.sim.config import SimConfig
from superinfer.sim.sweep import run_point
from superinfer.sim.workload_spec import WorkloadSpec
from superinfer.workload.record import write_result

RATE = 60.0


def run_once(policy: str, duration_s: float) -> tuple[float, str]:
    """Wall seconds of one simulated point, and a digest of its report (wall time left out)."""
    config = SimConfig(model="llama-3-8b", hardware="gh200", gpu_kv_gib=8, policy=policy)
    report, _ = run_point(config, WorkloadSpec(duration_s=duration_s), RATE)
    wall = report.pop("wall_s")
    return wall, hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--policies", default="fcfs,rotary")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    parser.add_argument("--tag", default="", help="names a variant run's results file (sim-speed-TAG-cpu-DATE.json)")
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    walls: dict[str, list[float]] = {p: [] for p in policies}
    digests: dict[str, set[str]] = {p: set() for p in policies}
    for _ in range(args.runs):
        for policy in policies:
            wall, digest = run_once(policy, args.duration)
            walls[policy].append(wall)
            digests[policy].add(digest)
            print(f"{policy:10s} {wall:6.1f} s  report {digest}", flush=True)
    figures = {
        p: {"wall_s": walls[p], "median_s": statistics.median(walls[p]), "reports_identical": len(digests[p]) == 1}
        for p in policies
    }
    goal = {"wall_s": f"< 30 for {args.duration:g} s x {RATE:g} req/s on one core (issue: simulate)"}
    point = {"model": "llama-3-8b", "hardware": "gh200", "gpu_kv_gib": 8, "rate": RATE, "duration_s": args.duration}
    tag = "speed" + (f"-{args.tag}" if args.tag else "")
    print(f"wrote {write_result('sim', 'cpu', figures, goal, {'point': point}, tag=tag)}")


if __name__ == "__main__":
    main()
