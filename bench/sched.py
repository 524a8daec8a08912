"""sched: scheduler host time per step (schedule + update) with many live requests, per policy.

Pure control plane (no model): each step's sampled tokens are made up. Two situations: every
request fits (decode steady state) and memory contention (half the requests cannot fit, so the
rotary policy ranks, rotates and swaps every step).

    python -m bench.sched [--live 256,1024,4096] [--steps 50] [--tag T]
    python -m bench.sched --vllm-python .venv-vllm/bin/python   # vLLM's v1 scheduler beside ours

With --vllm-python, bench/vllm_sched.py runs the same situations through vLLM's own scheduler
in that venv (`make vllm-env`), in the same run, and the record holds both.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

from superinfer.bench.record import write_result
from superinfer.engine.core.kv import KVCacheManager
from superinfer.engine.core.policies import make_policy
from superinfer.engine.core.request import Request, SamplingParams
from superinfer.engine.core.scheduler import Scheduler, SchedulerConfig
from superinfer.engine.model.tiny import ensure_tiny_model

BLOCK = 16


def build(policy: str, live: int, contention: bool, seed: int = 0) -> Scheduler:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randint(64, 256))] for _ in range(live)]
    need = sum(-(-(len(p) + 64) // BLOCK) for p in prompts)
    kv = KVCacheManager(need // 2 if contention else need + live, BLOCK, True, num_cpu_blocks=2 * need)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=live, max_num_batched_tokens=1 << 20, max_model_len=4096),
        kv,
        make_policy(policy, num_gpu_blocks=kv.num_blocks),
    )
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=10_000, temperature=0), arrival_time=0.0))
    return sched


def time_steps(sched: Scheduler, steps: int) -> tuple[list[float], list[int]]:
    """Seconds per step (schedule + update), and the requests each step scheduled."""
    for _ in range(5):  # warm up: prefill everything that fits
        plan = sched.schedule()
        sched.update(plan, dict.fromkeys(plan.sampled_ids(), 7))
    seconds, scheduled = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        sched.update(plan, dict.fromkeys(plan.sampled_ids(), 7))
        seconds.append(time.perf_counter() - t0)
        scheduled.append(plan.num_seqs)
    return seconds, scheduled


def vllm_figures(python: str, live: str, steps: int) -> dict[str, dict[str, float]]:
    """vLLM's scheduler in the same situations (bench/vllm_sched.py, run by a vLLM venv's python)."""
    script = Path(__file__).with_name("vllm_sched.py")
    model_dir = ensure_tiny_model()  # vLLM reads its config.json only
    cmd = [python, str(script), "--model-dir", str(model_dir), "--live", live, "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    print("".join(line for line in out.stderr.splitlines(keepends=True) if line.startswith("vllm")), end="")
    return json.loads(out.stdout)["figures"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--live", default="256,1024,4096")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tag", default="", help="names a variant run's results file (sched-TAG-cpu-DATE.json)")
    parser.add_argument("--vllm-python", help="python of a venv with vLLM: time its scheduler too")
    args = parser.parse_args()
    figures: dict[str, dict[str, float]] = {}
    for contention in (False, True):
        for policy in ("fcfs", "rotary"):
            for live in (int(n) for n in args.live.split(",")):
                times, scheduled = time_steps(build(policy, live, contention), args.steps)
                key = f"{policy}-{'contention' if contention else 'fits'}-{live}"
                f = figures[key] = {
                    "median_ms": 1000 * statistics.median(times),
                    "p90_ms": 1000 * sorted(times)[int(0.9 * len(times))],
                    "scheduled_reqs_median": statistics.median(scheduled),
                }
                print(
                    f"{key:28s} median {f['median_ms']:7.2f} ms  p90 {f['p90_ms']:7.2f} ms"
                    f"   ({f['scheduled_reqs_median']:.0f} reqs/step)",
                    flush=True,
                )
    if args.vllm_python:
        figures |= vllm_figures(args.vllm_python, args.live, args.steps)
    goal = {"median_ms_at_1024": "<= 0.5 (the reference spends 7.6 ms)"}
    print(f"wrote {write_result('sched', 'cpu', figures, goal, tag=args.tag)}")


if __name__ == "__main__":
    main()
