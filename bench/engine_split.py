"""engine_split: the engine core on a thread of the server (`--no-engine-process`) against in a
process of its own (`--engine-process`), under the same loads, with where each one's time goes.

Both servers (the tiny model, the vLLM peer benchmark's matched settings, ample KV) are up at once;
the loads alternate between them (A B B A ...), so drift on a shared machine hits both alike.
Besides tokens/s, each run reads the scheduler's per-thread accounting (/proc/<pid>/task/<tid>/
schedstat: time on a CPU, time runnable but waiting for one) of the engine's thread (or process)
and the server's event loop. The rest of the engine's wall time it was blocked: with the engine on
a thread that is mostly the GIL, held by the HTTP side, which is what a process of its own removes;
time waiting for a CPU is other work on the machine, which neither mode can help.

    python -m bench.engine_split [--rounds 6] [--loads saturation,batch1] [--policy fcfs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from superinfer.bench.peer_loads import SEQUENTIAL, LoadShape, items
from superinfer.bench.peer_settings import Matched, superinfer_command
from superinfer.bench.server_process import Launch, free_port, serving
from superinfer.bench.vllm_peer import requests, run_sequential, warm_up
from superinfer.workload.goodput import summarize
from superinfer.workload.loadgen import run_load
from superinfer.workload.record import write_result

MODES = {"thread": False, "proc": True}


@dataclass(frozen=True)
class ThreadTimes:
    on_cpu: float  # seconds
    waiting: float  # runnable, waiting for a CPU


def tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


def thread_times(pids: Sequence[int]) -> dict[tuple[int, int], ThreadTimes]:
    """(pid, tid) -> times so far, for every thread of `pids`."""
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                on_cpu, waiting, _ = (int(x) for x in (task / "schedstat").read_text().split())
            except (OSError, ValueError):
                continue
            out[(pid, int(task.name))] = ThreadTimes(on_cpu / 1e9, waiting / 1e9)
    return out


def split(server_pid: int, before: dict, after: dict, wall: float) -> dict[str, float]:
    """Shares of `wall` for the engine (its thread, or its process's busiest thread) and the
    server's event loop (the server's main thread), and the cores the whole tree used."""
    delta = {
        key: ThreadTimes(t.on_cpu - before[key].on_cpu, t.waiting - before[key].waiting)
        for key, t in after.items()
        if key in before
    }
    loop = delta.get((server_pid, server_pid), ThreadTimes(0.0, 0.0))
    others = {key: t for key, t in delta.items() if key != (server_pid, server_pid)}
    engine_key = max(others, key=lambda k: others[k].on_cpu)  # thread mode: the engine thread; else the child's
    engine = others[engine_key]
    return {
        "engine_on_cpu": engine.on_cpu / wall,
        "engine_waiting_for_cpu": engine.waiting / wall,
        "engine_blocked": max(0.0, 1.0 - (engine.on_cpu + engine.waiting) / wall),
        "loop_on_cpu": loop.on_cpu / wall,
        "cores": sum(t.on_cpu for t in delta.values()) / wall,
        "engine_in_child": float(engine_key[0] != server_pid),
    }


async def measure(url: str, pid: int, load: str, shape: LoadShape, seed: int, vocab: int) -> dict[str, float]:
    work = items(load, shape, seed)
    reqs = requests(work, vocab, seed)
    pids = tree(pid)
    before, t0 = thread_times(pids), time.monotonic()
    if load in SEQUENTIAL:
        timings, duration = await run_sequential(url, "tiny", reqs)
    else:
        timings, duration = await run_load(url, "tiny", reqs)
    wall = time.monotonic() - t0
    after = thread_times(pids)
    s = summarize(timings, duration)
    return {
        "output_tok_s": s["throughput_tok_s"],
        "ttft_p50_ms": s["ttft_p50_ms"],
        "tpot_p50_ms": s["tpot_p50_ms"],
        **split(pid, before, after, wall),
    }


def table(results: dict[str, dict[str, dict[str, list[float]]]], loads: Sequence[str]) -> str:
    keys = (
        ("output_tok_s", "{:.0f}"),
        ("ttft_p50_ms", "{:.1f}"),
        ("tpot_p50_ms", "{:.2f}"),
        ("engine_on_cpu", "{:.0%}"),
        ("engine_waiting_for_cpu", "{:.0%}"),
        ("engine_blocked", "{:.0%}"),
        ("loop_on_cpu", "{:.0%}"),
        ("cores", "{:.2f}"),
    )
    modes = list(results)
    lines = ["| | " + " | ".join(f"`{m}`" for m in modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for load in loads:
        for key, fmt in keys:
            cells = []
            for m in modes:
                runs = results[m][load][key]
                med, lo, hi = statistics.median(runs), min(runs), max(runs)
                cells.append(f"{fmt.format(med)} ({fmt.format(lo).rstrip('%')}–{fmt.format(hi)})")
            lines.append(f"| {load}: {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    from superinfer.engine.model.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    matched = Matched(model_dir, args.blocks)
    modes = args.modes.split(",")
    loads = args.loads.split(",")
    launches = []
    for mode in modes:
        port = free_port()
        cmd = superinfer_command(args.superinfer, matched, port, args.policy, args.threads, engine_process=MODES[mode])
        launches.append(Launch(cmd, port, args.log_dir / f"{mode}.log"))
    shape = LoadShape()
    results: dict[str, dict[str, dict[str, list[float]]]] = {m: {ld: {} for ld in loads} for m in modes}
    procs: list[subprocess.Popen] = []
    async with serving(launches, 420.0, procs) as urls:
        for url in urls:
            await warm_up(url, "tiny", vocab)
        servers = list(zip(modes, urls, [p.pid for p in procs], strict=True))
        for run in range(args.rounds):
            order = servers if run % 2 == 0 else servers[::-1]  # A B, B A, A B, ...
            for load in loads:
                for mode, url, pid in order:
                    figs = await measure(url, pid, load, shape, args.seed * 1000 + run, vocab)
                    for key, value in figs.items():
                        results[mode][load].setdefault(key, []).append(value)
                    shown = ", ".join(f"{k} {v:.3g}" for k, v in figs.items())
                    print(f"run {run + 1} {mode:6s} {load:10s} {shown}", flush=True)
    md = table(results, loads)
    print(md)
    if not args.no_record:
        figures = {
            m: {ld: {k: {"median": statistics.median(v), "runs": v} for k, v in f.items()} for ld, f in r.items()}
            for m, r in results.items()
        }
        extra = {
            "policy": args.policy,
            "threads": args.threads,
            "rounds": args.rounds,
            "blocks": args.blocks,
            "table_markdown": md,
        }
        goal = {"saturation_output_tok_s": "proc >= 1.1x thread, without a worse batch-1 TTFT"}
        out = write_result("engine_split", "cpu", figures, goal, extra, tag=args.tag)
        print(f"wrote {out}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--superinfer", default=str(Path(sys.executable).parent / "superinfer"))
    parser.add_argument("--modes", default="thread,proc")
    parser.add_argument("--loads", default="saturation,batch1")
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (OMP_NUM_THREADS) of each server")
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="engine_split-"))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
