"""The paper's SLO experiment on simulated replicas, as one command.

Llama-3-8B, ShareGPT-like synthetic lengths, Poisson arrivals at 35-60 req/s (Qwen2.5-32B and
Mixtral-8x7B: 5-20 req/s, `--model`), SLO 5 s / 100 ms,
`fcfs` vs `rotary` vs `watermark`, on the GH200 profile (NVLink-C2C) and the H100 profile (PCIe
Gen5 host link); then rotary's transfer budget (B_xfer) and alpha sweeps at the top rate on GH200.
The GPU KV pool is set to `--gpu-kv-gib` (default 8 GiB, 65k tokens): the paper's regime is KV
memory exhausted, which a whole GH200 (~860k tokens of KV for Llama-3-8B) never reaches at these
rates. Results: bench/results/sim-paper[-<model>]-cpu-<date>.json and one plot per profile.

    python -m bench.sim_paper                          # Llama-3-8B, 60 s per point, 2 processes
    python -m bench.sim_paper --model mixtral-8x7b     # the larger models at 5-20 req/s
    python -m bench.sim_paper --quick                  # 20 s per point, 3 rates, no ablations
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from superinfer.engine.slo import SLO
from superinfer.sim.config import SimConfig
from superinfer.sim.plot import plot_sweep
from superinfer.sim.sweep import Sweep, Variant, run_sweep, variants
from superinfer.sim.workload_spec import WorkloadSpec
from superinfer.workload.record import results_dir, write_result

POLICIES = ("fcfs", "rotary", "watermark")
RATES = {"llama-3-8b": (35.0, 40.0, 45.0, 50.0, 55.0, 60.0)}
LARGE_MODEL_RATES = (5.0, 10.0, 15.0, 20.0)  # the paper's range for Qwen2.5-32B and Mixtral-8x7B
PROFILES = ("gh200", "h100")
ABLATIONS = ("transfer_budget_blocks=300,600,1200,2400,4800", "alpha=0.5,1,3,10")


def headline(points: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """rotary against fcfs at the top rate."""
    r, f = points["rotary"][-1], points["fcfs"][-1]
    return {
        "ttft_gain_points": 100 * (r["ttft_attainment"] - f["ttft_attainment"]),
        "tbt_delta_points": 100 * (r["tbt_attainment"] - f["tbt_attainment"]),
        "goodput_gain_points": 100 * (r["goodput_share"] - f["goodput_share"]),
        "throughput_ratio": r["throughput_tok_s"] / f["throughput_tok_s"],
    }


def log_point(label: str, rate: float, r: dict[str, float]) -> None:
    print(
        f"  {label:34s} {rate:5.1f} req/s: TTFT att {r['ttft_attainment']:.3f}  TBT att {r['tbt_attainment']:.3f}  "
        f"goodput {r['goodput_share']:.3f}  TTFT p99 {r['ttft_p99_ms']:7.0f} ms"
        f"  tput {r['throughput_tok_s']:5.0f} tok/s  "
        f"swap out/in {r['swap_gb_s_gpu_to_cpu']:5.2f}/{r['swap_gb_s_cpu_to_gpu']:5.2f} GB/s  "
        f"rotations {r['rotations']:.0f}  ({r['wall_s']:.1f} s)",
        flush=True,
    )


def sweep_profile(
    base: SimConfig, workload: WorkloadSpec, runs: list[Variant], rates: tuple[float, ...], jobs: int
) -> Sweep:
    print(f"{base.model} on {base.profile().description}: {base.num_gpu_blocks_sized()} GPU KV blocks", flush=True)
    return run_sweep(base, workload, runs, rates, log_point, jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per point (protocol: 120)")
    parser.add_argument("--gpu-kv-gib", type=float, default=8.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 s per point, 3 rates, no ablations")
    parser.add_argument("--no-ablations", dest="ablations", action="store_false")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.ablations = min(args.duration, 20.0), False
    rates = RATES.get(args.model, LARGE_MODEL_RATES)
    if args.quick:
        rates = (rates[0], rates[len(rates) // 2], rates[-1])
    suffix = "" if args.model == "llama-3-8b" else f"-{args.model}"  # Llama keeps the paper's file names
    workload = WorkloadSpec(duration_s=args.duration, seed=args.seed, slo=SLO(5000.0, 100.0))
    t0 = time.perf_counter()
    figures: dict[str, Any] = {"profiles": {}}
    results = results_dir()
    for profile in PROFILES:
        base = SimConfig(model=args.model, hardware=profile, gpu_kv_gib=args.gpu_kv_gib)
        sweep = sweep_profile(base, workload, variants(POLICIES, []), rates, args.jobs)
        plot = plot_sweep(sweep, results / f"sim-paper{suffix}-{profile}.png", f"{args.model} on {profile} (simulated)")
        figures["profiles"][profile] = {
            "points": sweep.points,
            "top_rate": headline(sweep.points),
            "plot": str(plot.relative_to(results.parent.parent)),
        }
        print(f"{profile} top rate, rotary vs fcfs: {figures['profiles'][profile]['top_rate']}", flush=True)
    if args.ablations:
        base = SimConfig(model=args.model, hardware="gh200", gpu_kv_gib=args.gpu_kv_gib)
        sweep = sweep_profile(base, workload, variants(["rotary"], ABLATIONS), rates[-1:], args.jobs)
        figures["ablations_gh200_top_rate"] = {label: reports[0] for label, reports in sweep.points.items()}
    figures["wall_s"] = time.perf_counter() - t0
    goal = {
        "gh200": "rotary TTFT attainment >= fcfs + 75 points at the top rate, TBT attainment and throughput no worse",
        "h100": "rotary TTFT attainment >= fcfs + 40 points at the top rate",
    }
    extra = {
        "model": args.model,
        "clock": "simulated: engine scheduler + KV manager, roofline cost model on DeviceTimeline",
        "config": {
            k: str(v) for k, v in dataclasses.asdict(SimConfig(model=args.model, gpu_kv_gib=args.gpu_kv_gib)).items()
        },
        "workload": {"rates": list(rates), **{k: str(v) for k, v in dataclasses.asdict(workload).items()}},
    }
    print(
        f"wrote {write_result('sim', 'cpu', figures, goal, extra, tag='paper' + suffix)} in {figures['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
