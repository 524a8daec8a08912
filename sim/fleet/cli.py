"""`superinfer simulate --fleet`: replicas behind a router with an autoscaler, on one load.

The replica flags are simulate's (--model, --hardware, --gpu-kv-gib, ...; the engine policy is the
first of --policies, rotary unless given); the load is an Azure --trace at its own arrivals
(compressed to the first of --rates, if given), or --scenario flash (base rate: the first of
--rates) or diurnal (--rates LOW,HIGH over --duration); each of --autoscalers runs with each of
--routers on the same requests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SIMULATE_DEFAULT_POLICIES = "fcfs,rotary,watermark"  # simulate's --policies default: rotary alone here
COLUMNS = (
    ("goodput", lambda r: r["overall"]["goodput_share"], "{:.3f}"),
    ("TTFT att", lambda r: r["overall"]["ttft_attainment"], "{:.3f}"),
    ("TBT att+stall", lambda r: r["overall"]["tbt_attainment"], "{:.3f}"),
    ("TTFT p99 ms", lambda r: r["overall"]["ttft_p99_ms"], "{:.0f}"),
    ("stall>1s", lambda r: r["overall"]["stalled_1s_share"], "{:.3f}"),
    ("replica-s", lambda r: r["replica_seconds"], "{:.0f}"),
    ("mean repl", lambda r: r["mean_replicas"], "{:.2f}"),
    ("peak", lambda r: r["peak_replicas"], "{:d}"),
    ("ups/downs", lambda r: f"{r['scale_ups']}/{r['scale_downs']}", "{}"),
    ("windows<target after down", lambda r: r["worst_scale_down_windows_below"], "{:d}"),
    ("killed", lambda r: r["killed_at_drain"], "{:d}"),
    ("wall s", lambda r: r["wall_s"], "{:.0f}"),
)


def add_fleet_flags(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("fleet")
    f.add_argument("--fleet", action="store_true", help="simulate a fleet of replicas behind a router, autoscaled")
    f.add_argument("--scenario", choices=("flash", "diurnal"), default="flash", help="the load without a CSV --trace")
    f.add_argument("--routers", default="epp", help="round-robin, least-outstanding, epp, epp-rotary, slo")
    f.add_argument("--autoscalers", default="slo,hpa,fixed-peak,fixed-mean", help="slo, slo-profile, hpa, fixed-*")
    f.add_argument("--min-replicas", type=int, default=1)
    f.add_argument("--max-replicas", type=int, default=8)
    f.add_argument(
        "--ready-delay", type=float, default=None, help="seconds from a replica's creation to ready (default 120)"
    )
    f.add_argument("--scrape-ms", type=float, default=50.0, help="the router's metrics refresh (the EPP's: 50)")
    f.add_argument(
        "--rate-per-replica",
        type=float,
        default=None,
        help="one replica's capacity at the 0.95 target (req/s; default: bisected on one simulated replica)",
    )
    f.add_argument("--hpa-target-waiting", type=float, default=5.0, help="the HPA's vllm:num_requests_waiting per pod")
    f.add_argument("--flash-factor", type=float, default=5.0)
    f.add_argument("--flash-start", type=float, default=180.0)
    f.add_argument("--flash-length", type=float, default=120.0)
    f.add_argument("--timeline-s", type=float, default=30.0, help="the timeline's window (seconds)")
    f.add_argument("--record", default=None, metavar="TAG", help="also write bench/results/sim-fleet-TAG-*.json")


def fleet_policy(args: argparse.Namespace) -> str:
    if args.policies == SIMULATE_DEFAULT_POLICIES:
        return "rotary"
    return args.policies.split(",")[0].strip()


def load(args: argparse.Namespace, slo: Any) -> tuple[list, str]:
    """The requests and a line saying what they are."""
    from superinfer.sim.fleet import scenarios
    from superinfer.workload.arrivals import is_arrival_trace

    lengths = scenarios.Lengths(args.prompt_median, args.output_median, args.max_prompt, args.max_output)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else []
    if args.trace is not None:
        if not is_arrival_trace(args.trace):
            raise ValueError("--fleet replays an Azure CSV --trace (TIMESTAMP,ContextTokens,GeneratedTokens)")
        if rates:
            items = scenarios.trace_at_rate(args.trace, rates[0], slo, args.trace_start, args.trace_duration, lengths)
        else:
            from superinfer.workload.arrivals import azure_trace

            items = azure_trace(args.trace, start_s=args.trace_start, duration_s=args.trace_duration,
                                max_prompt=args.max_prompt, max_output=args.max_output, slo=slo)  # fmt: skip
        return items, f"trace {args.trace.name}, {len(items)} requests"
    if args.scenario == "diurnal":
        low, high = (rates + [2.0, 10.0][len(rates) :])[:2] if len(rates) < 2 else rates[:2]
        items = scenarios.diurnal(low, high, args.duration, slo, lengths, args.seed)
        return items, f"diurnal day in {args.duration:g} s, {low:g}-{high:g} req/s, {len(items)} requests"
    base = rates[0] if rates else 5.0
    items = scenarios.flash_crowd(base, args.duration, slo, args.flash_factor, args.flash_start, args.flash_length,
                                  lengths, args.seed)  # fmt: skip
    return items, (
        f"flash crowd: {base:g} req/s, x{args.flash_factor:g} for {args.flash_length:g} s at {args.flash_start:g} s, "
        f"{args.duration:g} s, {len(items)} requests"
    )


def table(reports: dict[str, dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title, caption="goodput: TTFT and TBT met with stalls judged (stall-aware), share of requests")
    t.add_column("set-up")
    for name, _, _ in COLUMNS:
        t.add_column(name, justify="right")
    for label, r in reports.items():
        t.add_row(label, *(fmt.format(get(r)) for _, get, fmt in COLUMNS))
        for cls, c in r["classes"].items():
            if len(r["classes"]) > 1:
                t.add_row(f"  class {cls}", f"{c['goodput_share']:.3f}", f"{c['ttft_attainment']:.3f}",
                          f"{c['tbt_attainment']:.3f}", *[""] * (len(COLUMNS) - 3))  # fmt: skip
    return t


def run_fleet_cli(args: argparse.Namespace) -> dict[str, Any]:
    import dataclasses

    from rich.console import Console

    from superinfer.engine.slo import SLO
    from superinfer.sim.config import SimConfig
    from superinfer.sim.fleet.fleet import DEFAULT_READY_DELAY_S, FleetConfig
    from superinfer.sim.fleet.setups import SPEC_TARGET, Run, replica_capacity, run_setup, sizing_for

    console = Console(width=200)
    slo = SLO(args.ttft_slo_ms, args.tbt_slo_ms, args.stall_slo_ms)
    replica = dataclasses.replace(SimConfig.from_flags(args), policy=fleet_policy(args))
    items, what = load(args, slo)
    rate_per_replica = args.rate_per_replica
    if rate_per_replica is None:
        console.print("measuring one replica's capacity (bisection on Poisson loads of these requests) ...")
        rate_per_replica = replica_capacity(replica, items, SPEC_TARGET)
    sizing = sizing_for(items, rate_per_replica, args.min_replicas, args.max_replicas)
    ready_delay = DEFAULT_READY_DELAY_S if args.ready_delay is None else args.ready_delay
    config = FleetConfig(replica, ready_delay_s=ready_delay, scrape_s=args.scrape_ms / 1000, default_slo=slo,
                         seed=args.seed)  # fmt: skip
    header = (
        f"{replica.model} on {replica.hardware}, {replica.policy}; {what}; one replica {rate_per_replica:.2f} req/s, "
        f"peak {sizing.peak_rate:.1f}, mean {sizing.mean_rate:.1f} req/s; ready delay {ready_delay:g} s"
    )
    console.print(header)
    runs = [Run(a.strip(), r.strip()) for a in args.autoscalers.split(",") for r in args.routers.split(",")]
    reports: dict[str, dict[str, Any]] = {}
    for run in runs:
        reports[run.label] = run_setup(run, items, config, sizing, args.hpa_target_waiting, SPEC_TARGET,
                                       args.timeline_s)  # fmt: skip
        console.print(f"  {run.label}: goodput {reports[run.label]['overall']['goodput_share']:.3f}")
    console.print(table(reports, f"fleet: SLO TTFT ≤ {args.ttft_slo_ms:g} ms, TBT ≤ {args.tbt_slo_ms:g} ms"))
    out: dict[str, Any] = {
        "header": header,
        "replica": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(replica).items()},
        "sizing": dataclasses.asdict(sizing),
        "ready_delay_s": ready_delay,
        "scrape_s": config.scrape_s,
        "runs": reports,
    }
    if args.plot:
        from superinfer.sim.fleet.plot import plot_timeline

        console.print(f"plot: {plot_timeline(reports, args.plot, header, SPEC_TARGET)}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
        console.print(f"wrote {args.json}")
    if args.record:
        from superinfer.workload.record import write_result

        figures = {label: {k: v for k, v in r.items() if k != "timeline"} for label, r in reports.items()}
        path = write_result("sim-fleet", "cpu", figures, {}, {"header": header, "settings": out["sizing"]}, args.record)
        console.print(f"record: {path}")
    return out
