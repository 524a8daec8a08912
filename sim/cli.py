"""`superinfer simulate`: the SLO benchmark on a simulated replica, rate sweeps and capacity planning.

Flags are added by `add_simulate_flags`; `run_simulate` imports the simulator only when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from superinfer.sim.config import SimConfig

# The columns of the per-point table (the full report goes to --json), explained by its caption.
COLUMNS = (
    ("TTFT att", "ttft_attainment", "{:.3f}"),
    ("TBT att+stall", "tbt_attainment", "{:.3f}"),
    ("TBT p99 att", "tbt_p99_attainment", "{:.3f}"),
    ("worst gap p99 ms", "worst_gap_p99_ms", "{:.0f}"),
    ("stall>1s", "stalled_1s_share", "{:.3f}"),
    ("goodput+stall", "goodput_share", "{:.3f}"),
    ("goodput p99", "goodput_p99_share", "{:.3f}"),
    ("goodput/s", "goodput_rps", "{:.1f}"),
    ("TTFT p50/p90/p99 ms", ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"), "{:.0f}"),
    ("TBT p50/p90/p99 ms", ("tbt_p50_ms", "tbt_p90_ms", "tbt_p99_ms"), "{:.0f}"),
    ("tok/s", "throughput_tok_s", "{:.0f}"),
    ("swap GB/s out/in", ("swap_gb_s_gpu_to_cpu", "swap_gb_s_cpu_to_gpu"), "{:.2f}"),
    ("rotations", "rotations", "{:.0f}"),
    ("recomputes", "recomputes", "{:.0f}"),
)
CAPTION = (
    "+stall: TBT met with the p99 gap within the TBT SLO and the worst gap within the stall budget; "
    "p99: the p99 gap alone; worst gap p99: over the streams; stall>1s: share of streams that stopped over 1 s once"
)
DEFAULT_RATES = "35,40,45,50,55,60"


def add_simulate_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replica")
    g.add_argument(
        "--model",
        default="llama-3-8b",
        help="a preset (llama-3-8b, qwen2.5-32b, mixtral-8x7b, qwen3-30b-a3b, ...) or a config.json",
    )
    g.add_argument("--hardware", default="gh200", help="gh200, h100 (PCIe Gen5 host link), h200, cpu")
    g.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="measured step and copy costs (replace the roofline): a JSON of them, a bench.step record, "
        "or a bench.slo --step-log file (.json or .json.gz)",
    )
    g.add_argument("--policies", default="fcfs,rotary,watermark", help="comma-separated")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument(
        "--gpu-kv-gib", type=float, default=None, help="GPU KV pool (default: what the memory budget leaves)"
    )
    g.add_argument("--num-gpu-blocks", type=int, default=None)
    g.add_argument("--cpu-kv-gib", type=float, default=None, help="CPU KV tier (default: a quarter of host memory)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=8192)
    g.add_argument("--transfer-budget-blocks", type=int, default=2400, help="B_xfer")
    g.add_argument("--duplex", choices=("full", "half", "serial"), default="full")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--write-through", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--slo-admission", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--rotary-alpha", type=float, default=3.0)
    g.add_argument("--rotary-beta-f", type=float, default=0.5)
    g.add_argument("--rotary-beta-b", type=float, default=0.0)
    g.add_argument("--host-ms", type=float, default=None, help="scheduler host time per step (default: the profile's)")
    g.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="rotary once per value (alpha, transfer_budget_blocks, duplex, ...)",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--rates",
        default=None,
        help=f"requests per second, comma-separated (default {DEFAULT_RATES}; with a CSV --trace: the "
        "trace's own mean rate, or each rate the trace's arrivals are compressed to)",
    )
    w.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per point (not with a CSV trace)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 is Poisson")
    w.add_argument(
        "--trace",
        type=Path,
        default=None,
        help='lengths from JSONL {"prompt","generated"} or ShareGPT JSON (Poisson arrivals); or an Azure LLM '
        "inference trace (CSV TIMESTAMP,ContextTokens,GeneratedTokens, .csv or .csv.gz) replayed with its "
        "own arrivals",
    )
    w.add_argument("--trace-speedup", type=float, default=1.0, help="CSV trace: arrivals compressed by this factor")
    w.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="CSV trace: prompt and output lengths times this, clamped to [1, --max-prompt / --max-output]",
    )
    w.add_argument(
        "--trace-start", type=float, default=0.0, help="CSV trace: window start, trace seconds after its first row"
    )
    w.add_argument(
        "--trace-duration",
        type=float,
        default=None,
        help="CSV trace: window length in trace seconds (default: to the end)",
    )
    w.add_argument("--prompt-median", type=float, default=150.0)
    w.add_argument("--output-median", type=float, default=200.0)
    w.add_argument("--max-prompt", type=int, default=1024)
    w.add_argument("--max-output", type=int, default=8192)
    w.add_argument("--ttft-slo-ms", type=float, default=5000.0)
    w.add_argument("--tbt-slo-ms", type=float, default=100.0)
    w.add_argument(
        "--stall-slo-ms",
        type=float,
        default=None,
        help="stall budget: the longest gap a stream may have and meet its TBT SLO (default 5x --tbt-slo-ms)",
    )
    w.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("capacity")
    c.add_argument(
        "--max-rate",
        action="store_true",
        help="bisect for the highest rate meeting --target between the lowest and highest of --rates "
        "(the highest doubled at most twice while it still meets it)",
    )
    c.add_argument("--replicas-for", type=float, default=None, metavar="RATE", help="replicas needed at RATE req/s")
    c.add_argument("--target", type=float, default=0.9, help="attainment target (share of requests)")
    c.add_argument("--target-metric", default="goodput_share", help="goodput_share, ttft_attainment, tbt_attainment")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, help="write every report here")
    o.add_argument("--plot", type=Path, default=None, help="attainment/goodput vs rate and TTFT CDFs (PNG)")
    o.add_argument("--jobs", type=int, default=1, help="simulate this many points at once (processes)")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    from superinfer.sim.fleet.cli import add_fleet_flags

    add_fleet_flags(p)


def workload_spec(args: argparse.Namespace) -> Any:
    from superinfer.engine.slo import SLO
    from superinfer.sim.workload_spec import WorkloadSpec
    from superinfer.workload.arrivals import is_arrival_trace

    replay = (args.trace_speedup, args.length_scale, args.trace_start, args.trace_duration)
    if replay != (1.0, 1.0, 0.0, None) and not (args.trace and is_arrival_trace(args.trace)):
        raise ValueError("--trace-speedup, --length-scale, --trace-start and --trace-duration replay a CSV --trace")
    return WorkloadSpec(
        duration_s=args.duration,
        seed=args.seed,
        slo=SLO(args.ttft_slo_ms, args.tbt_slo_ms, args.stall_slo_ms),
        prompt_median=args.prompt_median,
        output_median=args.output_median,
        max_prompt=args.max_prompt,
        max_output=args.max_output,
        burstiness=args.burstiness,
        trace=args.trace,
        trace_speedup=args.trace_speedup,
        length_scale=args.length_scale,
        trace_start_s=args.trace_start,
        trace_duration_s=args.trace_duration,
    )


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates takes positive requests per second, comma-separated, got {text!r}")
    return rates


def point_rates(args: argparse.Namespace, workload: Any) -> list[float]:
    """--rates; with an arrival trace and no --rates, the trace's own mean rate at its speed-up."""
    if args.rates is None and workload.replays_arrivals:
        from superinfer.sim.workload_spec import trace_rate

        return [trace_rate(workload)]
    return parse_rates(args.rates or DEFAULT_RATES)


def workload_line(args: argparse.Namespace, workload: Any) -> str:
    """What each point replays: the Poisson duration, or the trace's window, speed-up and size."""
    if not workload.replays_arrivals:
        return f"{args.duration:g} s per point"
    from superinfer.sim.workload_spec import replayed, trace_rate

    items = replayed(workload)
    end = "end" if args.trace_duration is None else f"{args.trace_start + args.trace_duration:g} s"
    return (
        f"trace {args.trace.name} [{args.trace_start:g} s, {end}): {len(items)} requests at "
        f"{trace_rate(workload):.2f} req/s (speed-up {args.trace_speedup:g}, lengths x{args.length_scale:g})"
    )


def _cell(report: dict[str, float], key: str | tuple[str, ...], fmt: str) -> str:
    keys = (key,) if isinstance(key, str) else key
    return "/".join(fmt.format(report.get(k, math.nan)) for k in keys)


def rate_cell(report: dict[str, float]) -> str:
    """The point's rate; a replayed trace's with its speed-up over the trace's own time."""
    if "trace_speedup" not in report:
        return f"{report['rate']:g}"
    return f"{report['rate']:.3g} (x{report['trace_speedup']:.3g})"


def points_table(points: dict[str, list[dict[str, float]]], title: str) -> Any:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, caption=CAPTION)
    for name in ("policy", "rate", *(c[0] for c in COLUMNS)):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for label, reports in points.items():
        for r in reports:
            table.add_row(escape(label), rate_cell(r), *(_cell(r, key, fmt) for _, key, fmt in COLUMNS))
    return table


def run_simulate(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "fleet", False):
        from superinfer.sim.fleet.cli import run_fleet_cli

        return run_fleet_cli(args)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from superinfer.sim.capacity import max_rate, replicas_for
    from superinfer.sim.sweep import run_point, run_sweep, variants

    console = Console()
    if not console.is_terminal:
        console = Console(width=240)  # piped or logged: the table keeps its columns
    base, workload = SimConfig.from_flags(args), workload_spec(args)
    runs = variants([p.strip() for p in args.policies.split(",") if p.strip()], args.vary)
    rates = point_rates(args, workload)
    m, hw = base.model_spec(), base.profile()
    gpu_blocks = base.num_gpu_blocks_sized()
    cost = f"calibration {args.calibration}" if args.calibration else "roofline"
    header = (
        f"{m.name} on {hw.description}: {gpu_blocks} GPU KV blocks "
        f"({gpu_blocks * base.block_bytes() / 2**30:.1f} GiB), "
        f"{cost}, {workload_line(args, workload)}, SLO {args.ttft_slo_ms:g} ms / {args.tbt_slo_ms:g} ms"
    )
    console.print(header)
    out: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(base).items()},
        "workload": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(workload).items()},
        "hardware": dataclasses.asdict(hw),
    }
    capacity = args.max_rate or args.replicas_for is not None
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not args.progress,
        transient=True,
    )
    with progress:
        if not capacity:
            task = progress.add_task("simulating", total=len(runs) * len(rates))

            def advance(label: str, rate: float, report: dict[str, float]) -> None:
                progress.update(task, advance=1, description=f"{label} @ {rate:g} req/s")

            sweep = run_sweep(base, workload, runs, rates, advance, args.jobs)
            out["points"] = sweep.points
        else:
            task = progress.add_task("bisecting", total=None)
            found: dict[str, Any] = {}
            for variant in runs:
                config = variant.apply(base)

                def metric_at(rate: float, config: Any = config, label: str = variant.label) -> float:
                    progress.update(task, advance=1, description=f"{label} @ {rate:.2f} req/s")
                    return run_point(config, workload, rate)[0][args.target_metric]

                result = max_rate(metric_at, args.target, lo=min(rates), hi=max(rates), max_expand=2)
                entry: dict[str, Any] = {"max_rate": result.rate, "bounded": result.bounded, "probes": result.probes}
                if args.replicas_for is not None and result.rate > 0:
                    n = replicas_for(args.replicas_for, result.rate)
                    while metric_at(args.replicas_for / n) < args.target:
                        n += 1  # the bisection's tolerance: check the share each replica gets
                    entry["replicas"] = n
                found[variant.label] = entry
            out["capacity"] = {"target": args.target, "metric": args.target_metric, "policies": found}
    if "points" in out:
        console.print(points_table(out["points"], f"SLO: TTFT ≤ {args.ttft_slo_ms:g} ms, TBT ≤ {args.tbt_slo_ms:g} ms"))
        if args.plot:
            from superinfer.sim.plot import plot_sweep

            console.print(f"plot: {plot_sweep(sweep, args.plot, header.split(':')[0])}")
    else:
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=f"highest rate with {args.target_metric} ≥ {args.target:g}")
        table.add_column("policy")
        table.add_column("max rate (req/s)", justify="right")
        if args.replicas_for is not None:
            table.add_column(f"replicas for {args.replicas_for:g} req/s", justify="right")
        for label, entry in out["capacity"]["policies"].items():
            rate = f"{entry['max_rate']:.2f}" + ("" if entry["bounded"] else "+")
            table.add_row(
                escape(label), rate, *([str(entry.get("replicas", "-"))] if args.replicas_for is not None else [])
            )
        console.print(table)
        for label, entry in out["capacity"]["policies"].items():
            if entry["max_rate"] > 0:
                console.print(escape(capacity_snippet(label, entry["max_rate"], header.split(":")[0])), soft_wrap=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
        console.print(f"wrote {args.json}")
    return out


def capacity_snippet(policy: str, rate: float, setup: str) -> str:
    """The InferenceService fields that hand this result to the operator's SLO autoscaler."""
    source = f"superinfer simulate --max-rate, {policy}, {setup}".replace('"', "'")
    return f'{policy}: autoscaling: {{capacity: {{maxRatePerReplica: {rate:.2f}, source: "{source}"}}}}'
