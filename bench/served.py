"""served: TPOT, TBT and throughput of `superinfer serve` under an open-loop Poisson load, per
torch thread count, and optionally against an older checkout, each server a fresh process.

    python -m bench.served [--threads 1,2] [--rate 4] [--duration 30] [--against /old/checkout]

The server and the load generator share the machine, as in the issue's measurement; the thread
count reaches the server as OMP_NUM_THREADS (which the engine follows, and an older torch-only
checkout too). Runs alternate between settings, `--rounds` times each; the median run is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from superinfer.engine.slo import SLO
from superinfer.workload.arrivals import poisson_workload
from superinfer.workload.loadgen import bench_endpoint

KEYS = ("tpot_p50_ms", "tpot_p99_ms", "tbt_p50_ms", "tbt_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(checkout: Path, threads: int, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [str(checkout / ".venv" / "bin" / "superinfer"), "serve", "--model", "tiny", "--device", "cpu"]
    cmd += ["--port", str(port), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready in 120 s")


def run_one(checkout: Path, threads: int, args: argparse.Namespace) -> dict[str, float]:
    port = _free_port()
    proc = _serve(checkout, threads, port, args.serve_args.split())
    try:
        items = poisson_workload(
            args.rate, args.duration, SLO(5000, 100), seed=0, prompt_median=args.prompt_median, output_median=100
        )
        return asyncio.run(bench_endpoint(f"http://127.0.0.1:{port}", "tiny", items))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--prompt-median", type=float, default=150.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--serve-args", default="", help="extra `superinfer serve` flags, space-separated")
    parser.add_argument("--against", type=Path, default=None, help="an older checkout with its own .venv")
    args = parser.parse_args()

    here = Path(__file__).resolve().parent.parent
    checkouts = {"new": here} if args.against is None else {"old": args.against.resolve(), "new": here}
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for threads in (int(t) for t in args.threads.split(",")):
            for label, checkout in checkouts.items():
                report = run_one(checkout, threads, args)
                runs.setdefault((label, threads), []).append(report)
                shown = "  ".join(f"{k} {report[k]:.1f}" for k in KEYS)
                print(f"{label} threads {threads}: {shown}", flush=True)
    figures: dict[str, float] = {}
    for (label, threads), reports in runs.items():
        median_run = sorted(reports, key=lambda r: r["tpot_p50_ms"])[len(reports) // 2]
        for k in (*KEYS, "requests", "output_tokens"):
            figures[f"{label}_t{threads}_{k}"] = median_run[k]
        figures[f"{label}_t{threads}_tpot_p50_ms_runs"] = statistics.median(r["tpot_p50_ms"] for r in reports)

    from superinfer.workload.record import write_result

    goal = {"tpot_p50_ms": "vLLM 0.32 CPU on the same load shape: batch TPOT ~8 ms (the issue's measurement)"}
    extra = {
        "model": "tiny",
        "rate": args.rate,
        "duration_s": args.duration,
        "prompt_median": args.prompt_median,
        "output_median": 100,
        "serve_args": args.serve_args,
        "against": str(args.against) if args.against else None,
    }
    print(f"wrote {write_result('served', 'cpu', figures, goal, extra)}")


if __name__ == "__main__":
    sys.exit(main())
