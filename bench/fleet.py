"""fleet: the autoscaling set-ups and routers compared on fleet loads, in simulation.

Loads: the Azure LLM inference traces (conversation and code; a window of each, compressed to a
fleet rate; read from --azure-dir, never committed, skipped when absent), a diurnal day
compressed into --day seconds, and a flash crowd (5x the base rate for 2 minutes). Each load runs
the SLO autoscaler, the HPA-on-vllm:num_requests_waiting recipe and fixed fleets sized for the
peak and the mean (behind the endpoint picker's default profile); the flash crowd also runs every
router on the fleet sized for the mean. Sized for a 2-core machine (about 35 minutes with
--jobs 2 on a shared one); the record holds every run's figures and the issue's criteria judged on them.

    python -m bench.fleet [--azure-dir /work/data/azure] [--jobs 2] [--tag T] [--quick]
    python -m bench.fleet --loads flash --setups slo,hpa --min-replicas 2 --no-routers   # headroom
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from superinfer.engine.slo import SLO
from superinfer.sim.config import SimConfig
from superinfer.sim.fleet import scenarios
from superinfer.sim.fleet.fleet import DEFAULT_READY_DELAY_S, FleetConfig
from superinfer.sim.fleet.plot import plot_timeline
from superinfer.sim.fleet.router import ROUTERS
from superinfer.sim.fleet.setups import SPEC_TARGET, Run, Sizing, replica_capacity, run_setup, sizing_for
from superinfer.workload.record import result_stem, results_dir, write_result

SLO_TARGETS = SLO(5000.0, 100.0)  # the paper's: 5 s to the first token, 100 ms between tokens
# A 32B model on a GH200 with a 16 GiB KV pool: ~13 req/s per replica (KV pressure past that, so rotary
# rotates), a fleet of several replicas at rates a 2-core machine simulates in minutes.
REPLICA = SimConfig(model="qwen2.5-32b", hardware="gh200", gpu_kv_gib=16.0, policy="rotary")
SETUPS = ("slo", "hpa", "fixed-peak", "fixed-mean")
DEFAULT_ROUTER = "epp"


@dataclasses.dataclass(frozen=True)
class Load:
    name: str
    items: tuple
    what: str


def loads(args: argparse.Namespace) -> list[Load]:
    out = []
    scale = 0.5 if args.quick else 1.0
    for kind in ("conv", "code"):
        path = args.azure_dir / f"AzureLLMInferenceTrace_{kind}.csv"
        if not path.exists():
            print(f"skipping the {kind} trace: {path} not found")
            continue
        window = args.trace_window * scale
        items = scenarios.trace_at_rate(path, args.trace_rate, SLO_TARGETS, 0.0, window)
        out.append(Load(f"azure-{kind}", tuple(items), f"{path.name}, first {window:g} s at {args.trace_rate:g} req/s"))
    day = args.day * scale
    items = scenarios.diurnal(args.night_rate, args.noon_rate, day, SLO_TARGETS)
    out.append(Load("diurnal", tuple(items), f"a day in {day:g} s, {args.night_rate:g}-{args.noon_rate:g} req/s"))
    flash_s = args.flash_duration * scale
    items = scenarios.flash_crowd(args.base_rate, flash_s, SLO_TARGETS, 5.0, 120.0, 120.0)
    out.append(Load("flash", tuple(items), f"{args.base_rate:g} req/s, 5x for 120 s at 120 s, {flash_s:g} s"))
    return out


def capacity(load: Load) -> float:
    """One replica's capacity on requests like the load's (simulate --max-rate's bisection)."""
    return replica_capacity(REPLICA, load.items, SPEC_TARGET)


def one(job: tuple[Run, Load, FleetConfig, Sizing]) -> tuple[str, str, dict[str, Any]]:
    run, load, config, sizing = job
    return load.name, run.label, run_setup(run, load.items, config, sizing, target=SPEC_TARGET)


def criteria(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The issue's lines, judged where the runs exist."""
    out: dict[str, Any] = {}
    key = f"/{DEFAULT_ROUTER}"
    for load, runs in results.items():
        slo, peak, hpa = runs.get("slo" + key), runs.get("fixed-peak" + key), runs.get("hpa" + key)
        if slo and peak:
            gap = slo["overall"]["goodput_share"] - peak["overall"]["goodput_share"]
            cost = slo["replica_seconds"] / peak["replica_seconds"]
            out[f"{load}: slo goodput within 2 points of fixed-peak"] = {
                "points": round(100 * gap, 1),
                "met": gap >= -0.02,
            }
            out[f"{load}: slo replica-seconds <= 70% of fixed-peak"] = {"ratio": round(cost, 3), "met": cost <= 0.7}
        if slo and hpa and load == "flash":
            gap = slo["overall"]["goodput_share"] - hpa["overall"]["goodput_share"]
            cheaper = slo["replica_seconds"] <= hpa["replica_seconds"]
            out["flash: slo beats hpa by >= 10 points at no more replica-seconds"] = {
                "points": round(100 * gap, 1),
                "replica_seconds_ratio": round(slo["replica_seconds"] / hpa["replica_seconds"], 3),
                "met": gap >= 0.10 and cheaper,
            }
        if slo:
            worst = slo["worst_scale_down_windows_below"]
            out[f"{load}: no scale-down leaves a class under target > 1 window"] = {"windows": worst, "met": worst <= 1}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--azure-dir", type=Path, default=Path("/work/data/azure"))
    parser.add_argument("--trace-window", type=float, default=3600.0, help="trace seconds replayed from its start")
    parser.add_argument("--trace-rate", type=float, default=20.0, help="the trace window's mean rate (req/s)")
    parser.add_argument("--day", type=float, default=600.0, help="seconds the diurnal day is compressed into")
    parser.add_argument("--night-rate", type=float, default=3.0)
    parser.add_argument("--noon-rate", type=float, default=40.0)
    parser.add_argument("--base-rate", type=float, default=8.0, help="the flash crowd's base rate (req/s)")
    parser.add_argument("--flash-duration", type=float, default=600.0)
    parser.add_argument("--min-replicas", type=int, default=1, help="the autoscalers' floor (headroom for bursts)")
    parser.add_argument("--max-replicas", type=int, default=8)
    parser.add_argument("--ready-delay", type=float, default=DEFAULT_READY_DELAY_S)
    parser.add_argument("--rate-per-replica", type=float, default=None, help="skip the capacity bisection")
    parser.add_argument("--setups", default=",".join(SETUPS), help="the autoscaling set-ups to run")
    parser.add_argument("--loads", default="", help="only these loads (azure-conv, azure-code, diurnal, flash)")
    parser.add_argument("--routers", action=argparse.BooleanOptionalAction, default=True,
                        help="also every router on the flash crowd")  # fmt: skip
    parser.add_argument("--capacities-from", type=Path, default=None, help="a fleet record: its capacities")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="half-length loads (a smoke run)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()

    config = FleetConfig(REPLICA, ready_delay_s=args.ready_delay, default_slo=SLO_TARGETS)
    jobs, all_loads = [], [load for load in loads(args) if not args.loads or load.name in args.loads.split(",")]
    with ProcessPoolExecutor(args.jobs) as pool:
        if args.capacities_from:
            capacities = json.loads(args.capacities_from.read_text())["capacities"]
        elif args.rate_per_replica:
            capacities = {load.name: args.rate_per_replica for load in all_loads}
        else:
            rates = pool.map(capacity, all_loads)
            capacities = {load.name: rate for load, rate in zip(all_loads, rates, strict=True)}
    for load in all_loads:
        rate = capacities[load.name]
        sizing = sizing_for(load.items, rate, args.min_replicas, args.max_replicas)
        print(f"{load.name}: {len(load.items)} requests ({load.what}); one replica {rate:.2f} req/s; {sizing}")
        jobs += [(Run(s.strip(), DEFAULT_ROUTER), load, config, sizing) for s in args.setups.split(",")]
        if load.name == "flash" and args.routers:
            jobs += [(Run("fixed-mean", r), load, config, sizing) for r in ROUTERS if r != DEFAULT_ROUTER]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for load_name, label, report in pool.map(one, jobs):
            results.setdefault(load_name, {})[label] = report
            o, r = report["overall"], report
            print(f"{load_name:12s} {label:28s} goodput {o['goodput_share']:.3f} replica-s {r['replica_seconds']:.0f} "
                  f"ups/downs {r['scale_ups']}/{r['scale_downs']} wall {r['wall_s']:.0f}s")  # fmt: skip
    stem = result_stem("fleet", "cpu", args.tag)
    for load_name, runs in results.items():
        setups = {k: v for k, v in runs.items() if k.endswith("/" + DEFAULT_ROUTER)}
        kv = f"{REPLICA.gpu_kv_gib:g} GiB KV"
        title = f"{load_name}: {REPLICA.model} on GH200 ({kv}), rotary, ready delay {args.ready_delay:g} s"
        plot_timeline(setups, results_dir() / f"{stem}-{load_name}.png", title, SPEC_TARGET)
    figures = {
        load: {label: {k: v for k, v in r.items() if k != "timeline"} for label, r in runs.items()}
        for load, runs in results.items()
    }
    timelines = {load: {label: r["timeline"] for label, r in runs.items()} for load, runs in results.items()}
    judged = criteria(results)
    for line, verdict in judged.items():
        print(f"{'met' if verdict['met'] else 'NOT met'}: {line} {verdict}")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    extra = {"settings": settings, "capacities": capacities, "replica": dataclasses.asdict(REPLICA),
             "timelines": timelines}  # fmt: skip
    print(f"record: {write_result('fleet', 'cpu', figures, judged, extra, args.tag)}")


if __name__ == "__main__":
    main()
