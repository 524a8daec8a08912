"""slo: the paper's protocol, every policy at several request rates, on the same workload.

Poisson arrivals (fixed seed), synthetic ShareGPT-like lengths (or --trace), fixed output length
per request, greedy with ignore_eos, SLO 5 s / 100 ms by default. On CPU the tiny model runs for
real on a virtual clock (reproducible; a step cost model stands for time); on a GPU the wall clock
is used with dummy weights of a real architecture. `--wall-clock` times a CPU run on the wall clock
too (host time counts, as on a GPU; record tagged `wall`).

    python -m bench.slo                                       # CPU: tiny, small KV budget
    python -m bench.slo --device cuda --model llama-3-8b --rates 35,45,60 --duration 60 \\
        --gpu-memory-utilization 0.5
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import math
import re
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, generate_latest

from superinfer.bench.transfers import summarize_copies
from superinfer.bench.vllm_peer import parse_counters
from superinfer.engine.config import EngineConfig
from superinfer.engine.engine import EngineCore
from superinfer.engine.gc_freeze import freeze_startup_heap
from superinfer.engine.slo import SLO, p99_gap
from superinfer.engine.worker.duplex import CopyStats
from superinfer.workload.arrivals import WorkItem, load_trace, poisson_workload, prompt_tokens
from superinfer.workload.device_timeline import DeviceTimeline
from superinfer.workload.goodput import RequestTiming, summarize
from superinfer.workload.record import result_stem, write_result
from superinfer.workload.replay import StepLogLine, VirtualClock, replay

# The DuplexKV ablation (rotary, `--ablation`): each copy mode, and write-through off.
ABLATION = {
    "rotary[duplex=half]": {"duplex": "half"},
    "rotary[duplex=serial]": {"duplex": "serial"},
    "rotary[no-write-through]": {"write_through": False},
}
# Also named in --policies: rotary without its TBT guard (SLO-aware admission), rotary with each
# request kept on the GPU at least a second once in (on an H100 at 60 req/s the guard's residency
# came to ~0.3 s, and each step rotated 6-21 requests), and either policy with steps of prompt
# tokens through piecewise CUDA graphs.
VARIANTS = ABLATION | {
    "rotary[no-slo-admission]": {"slo_admission": False},
    "rotary[min-residency=1s]": {"rotary_min_residency_ms": 1000.0},
    "rotary[piecewise-graphs]": {"piecewise_graphs": True},
    "fcfs[piecewise-graphs]": {"piecewise_graphs": True},
}


def step_phases(registry: CollectorRegistry) -> dict[str, float]:
    """Where a step's wall time went (ms per step): schedule, submit, wait (for the device: the
    step in flight) and update, from the engine's own step-phase histogram."""
    counted = parse_counters(generate_latest(registry).decode(), vllm=False)
    steps = max(1.0, counted.steps)
    return {f"{phase}_ms_per_step": 1000 * seconds / steps for phase, seconds in counted.phase_seconds.items()}


def write_step_log(path: Path, steps: list[StepLogLine], timings: list[RequestTiming], items: list[WorkItem]) -> None:
    """The run's steps (replay's step log) and requests (arrival, TTFT, largest and p99 gap
    between tokens, how many gaps exceeded its TBT SLO, lengths) as JSON columns, for reading a
    run step by step after it (a GPU's lease is short)."""
    step_columns = {key: [step.get(key, math.nan) for step in steps] for key in steps[0]} if steps else {}
    gaps = [t.gaps for t in timings]
    requests = {
        "arrival": [t.arrival for t in timings],
        "ttft": [t.ttft for t in timings],
        "max_gap": [max(g, default=0.0) for g in gaps],
        "p99_gap": [p99_gap(g) for g in gaps],  # what its TBT is judged by (None: under two tokens)
        "slow_gaps": [sum(x * 1000.0 > t.slo.tbt_ms for x in g) for t, g in zip(timings, gaps, strict=True)],
        "prompt_len": [item.prompt_len for item in items],
        "output_len": [item.output_len for item in items],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"steps": step_columns, "requests": requests}).replace("NaN", "null")
    path.write_bytes(gzip.compress(text.encode()))


def run_point(
    args: argparse.Namespace, policy: str, rate: float, step_log: Path | None = None, **variant: object
) -> dict[str, float]:
    slo = SLO(args.ttft_slo_ms, args.tbt_slo_ms, args.stall_slo_ms)
    cpu = args.device == "cpu"
    virtual = cpu and not args.wall_clock
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dummy_weights=not cpu,
        # On the virtual clock the device timeline stands for a GPU, whose executor schedules async.
        async_scheduling=True if virtual else None,
        **variant,
        policy=policy,
        num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_gib=args.cpu_kv_gib,
        max_model_len=args.max_model_len,
        ttft_slo_ms=slo.ttft_ms,
        tbt_slo_ms=slo.tbt_ms,
    )
    core = EngineCore(config, clock=VirtualClock()) if virtual else EngineCore(config)
    if args.trace:
        items = load_trace(args.trace, rate, slo, seed=args.seed)
    else:
        items = poisson_workload(
            rate,
            args.duration,
            slo,
            seed=args.seed,
            prompt_median=args.prompt_median,
            output_median=args.output_median,
            max_prompt=args.max_prompt,
            max_output=args.max_output,
        )
    prompts = prompt_tokens(items, core.model_config.vocab_size, seed=args.seed)
    timeline = DeviceTimeline(duplex=core.config.duplex, async_scheduling=core.async_scheduling) if virtual else None
    copies: list[CopyStats] = []
    steps: list[StepLogLine] | None = [] if step_log else None
    freeze_startup_heap(f"{policy} at {rate:g} req/s")  # as `superinfer serve` does; undone below
    timings, duration = replay(core, items, prompts, timeline, copies, steps)
    if step_log:
        write_step_log(step_log, steps or [], timings, items)
    report = summarize(timings, duration)
    if timeline is not None:  # the copies' cost on the modelled device, not the CPU's own copies
        report.update(copy_seconds=timeline.copy_seconds, copy_hidden_ratio=timeline.hidden_ratio or 0.0)
    else:
        report.update(summarize_copies(copies, core.block_bytes))
    counters = core.scheduler.counters
    reg, name = core.metrics.registry, core.config.model_name
    for direction in ("gpu_to_cpu", "cpu_to_gpu"):
        moved = (
            reg.get_sample_value("superinfer_engine_kv_swap_bytes_total", {"model_name": name, "direction": direction})
            or 0.0
        )
        report[f"swap_gb_s_{direction}"] = moved / duration / 1e9
    # (the replay count, not the graphs: they hold the model and cache, which the cleanup below frees)
    replays = core.runner.graphs.replays if core.runner.graphs is not None else None
    piecewise = core.runner.piecewise.replays if core.runner.piecewise is not None else 0
    report.update(
        rate=rate,
        steps=len(copies),
        # on a GPU, the decode-only steps replayed as CUDA graphs; the rest (prefill chunks) ran op by op
        graph_step_share=replays / max(1, len(copies)) if replays is not None else 0.0,
        piecewise_step_share=piecewise / max(1, len(copies)),  # the steps with prompt tokens in piecewise graphs
        rotations=counters.rotations,
        rotations_per_request=counters.rotations / max(1.0, report["requests"]),
        recomputes=counters.preemptions["recompute"],
        num_gpu_blocks=core.kv.num_blocks,
        **core.scheduler.guard_figures(),
        **counters.by_reason(),
        **step_phases(reg),
    )
    label = policy + (str(variant) if variant else "")
    phases = " ".join(
        f"{k.removesuffix('_ms_per_step')} {v:.2f}" for k, v in report.items() if k.endswith("_ms_per_step")
    )
    print(
        f"{label:9s} rate {rate:6.1f}: TTFT att {report['ttft_attainment']:.2f}  TBT att "
        f"{report['tbt_attainment']:.2f}  goodput {report['goodput_share']:.2f} ({report['goodput_rps']:.2f} req/s)  "
        f"TTFT p99 {report['ttft_p99_ms']:.0f} ms  worst gap p99 {report['worst_gap_p99_ms']:.0f} ms, "
        f"stalled >1 s {report['stalled_1s_share']:.0%}  tput {report['throughput_tok_s']:.0f} tok/s  "
        f"rotations {counters.rotations} ({report['rotations_per_request']:.1f}/request)  "
        f"copies hidden {report.get('copy_hidden_ratio', math.nan):.2f}  "
        f"graph steps {report['graph_step_share']:.0%} (piecewise {report['piecewise_step_share']:.0%}) "
        f"of {len(copies)}  guard held/capped "
        f"{report['guard_held_step_share']:.0%} (overdue {report['guard_overdue_step_share']:.0%})/"
        f"{report['guard_capped_step_share']:.0%} of steps, step model off by "
        f"{report['step_model_error']:.0%}; ms a step: {phases}",
        flush=True,
    )
    # The next point's engine sizes its KV cache from the device memory free after loading.
    core.close()
    gc.unfreeze()  # (a frozen cycle is never collected: the engine's device memory would stay)
    del core
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="default: tiny on CPU, llama-3-8b on GPU")
    parser.add_argument(
        "--policies", default="fcfs,rotary,watermark", help=f"comma-separated; also {', '.join(VARIANTS)}"
    )
    parser.add_argument("--rates", default=None, help="requests per second, comma-separated")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals per point")
    parser.add_argument("--trace", type=Path, default=None, help="JSONL {prompt, generated} or ShareGPT JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo-ms", type=float, default=5000.0)
    parser.add_argument("--tbt-slo-ms", type=float, default=100.0)
    parser.add_argument(
        "--stall-slo-ms",
        type=float,
        default=None,
        help="stall budget: the longest gap a stream may have and meet its TBT SLO (default 5x --tbt-slo-ms)",
    )
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--cpu-kv-gib", type=float, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--prompt-median", type=float, default=None)
    parser.add_argument("--output-median", type=float, default=None)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--max-output", type=int, default=8192)
    parser.add_argument(
        "--wall-clock",
        action="store_true",
        help="on CPU, time on the wall clock (the model's and the host's real time count, as on a GPU)",
    )
    parser.add_argument("--tag", default="", help="names the record (bench/results/slo-TAG-...)")
    parser.add_argument(
        "--step-log", type=Path, default=None, help="a folder: each point's steps and requests there (gzip JSON)"
    )
    parser.add_argument(
        "--ablation", action="store_true", help="also rotary with --duplex half, serial and --no-write-through"
    )
    args = parser.parse_args()
    cpu = args.device == "cpu"
    # CPU defaults: the tiny model with a 64-block KV budget; lengths scaled down ~4x.
    defaults = (
        {
            "model": "tiny",
            "rates": "4,8,12",
            "duration": 20.0,
            "num_gpu_blocks": 64,
            "cpu_kv_gib": 1.0,
            "max_model_len": 1024,
            "prompt_median": 40.0,
            "output_median": 60.0,
        }
        if cpu
        else {
            "model": "llama-3-8b",
            "rates": "35,45,60",
            "duration": 60.0,
            "prompt_median": 150.0,
            "output_median": 200.0,
        }
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if cpu:
        args.max_prompt, args.max_output = min(args.max_prompt, 256), min(args.max_output, 512)

    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")
    if unknown := [p for p in policies if "[" in p and p not in VARIANTS]:
        parser.error(f"unknown variant {', '.join(unknown)}: the variants are {', '.join(VARIANTS)}")
    runs = [(p, p.partition("[")[0], VARIANTS.get(p, {})) for p in policies]
    if args.ablation:
        runs += [(name, "rotary", v) for name, v in ABLATION.items()]
    goal = {
        "ttft_gain_points": ">= +75 on the GH200 profile, >= +40 on PCIe H100/H200",
        "tbt": "no worse than fcfs",
        "throughput_ratio": ">= 1.0",
    }
    extra = {
        "model": args.model,
        "clock": "virtual: device timeline (workload/device_timeline.py defaults, async scheduling)"
        if cpu and not args.wall_clock
        else "wall",
        "workload": {
            "rates": rates,
            "duration_s": args.duration,
            "seed": args.seed,
            "trace": str(args.trace) if args.trace else "synthetic lognormal",
            "prompt_median": args.prompt_median,
            "output_median": args.output_median,
            "slo_ms": [args.ttft_slo_ms, args.tbt_slo_ms],
        },
    }
    tag = "-".join(filter(None, [args.tag, "wall" if cpu and args.wall_clock else ""]))
    points: dict[str, list[dict[str, float]]] = {}
    for name, policy, variant in runs:
        for rate in rates:
            label = re.sub(r"[^\w.]+", "-", name).strip("-")  # rotary[no-slo-admission]: rotary-no-slo-admission
            stem = result_stem("slo", args.device, "-".join(filter(None, (tag, label, f"{rate:g}"))))
            log = args.step_log / f"{stem}.json.gz" if args.step_log else None
            points.setdefault(name, []).append(run_point(args, policy, rate, log, **variant))
            path = write_result("slo", args.device, {"points": points}, goal, extra, tag)  # kept if a later point dies
    figures = {"points": points}
    top = {p: pts[-1] for p, pts in points.items()}
    if "fcfs" in top and "rotary" in top:
        figures["top_rate_ttft_gain_points"] = 100 * (top["rotary"]["ttft_attainment"] - top["fcfs"]["ttft_attainment"])
        figures["top_rate_tbt_delta_points"] = 100 * (top["rotary"]["tbt_attainment"] - top["fcfs"]["tbt_attainment"])
        figures["top_rate_throughput_ratio"] = top["rotary"]["throughput_tok_s"] / top["fcfs"]["throughput_tok_s"]
        figures["top_rate_goodput_ratio"] = top["rotary"]["goodput_rps"] / max(1e-9, top["fcfs"]["goodput_rps"])
        print(
            f"top rate: rotary vs fcfs TTFT attainment {figures['top_rate_ttft_gain_points']:+.1f} points, "
            f"TBT {figures['top_rate_tbt_delta_points']:+.1f} points, "
            f"throughput x{figures['top_rate_throughput_ratio']:.2f}, goodput x{figures['top_rate_goodput_ratio']:.2f}"
        )
        path = write_result("slo", args.device, figures, goal, extra, tag)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
