"""sched: scheduler host time per step (schedule + update) with many live requests, per policy.

Pure control plane (no model): each step's sampled tokens are made up. Three situations: every
request fits (decode steady state), memory contention (half the requests cannot fit, so the
rotary policy ranks, rotates and swaps every step), and churn (every request fits; each stops
after 32-256 tokens and a new one with a new prompt takes its place before the next step, so
each step also finishes and admits a few, ~7 at 1024 live: their prompts' and outputs' blocks
hashed, the finished ones' blocks registered in the prefix cache). Time is virtual: each step
takes STEP_S (2 ms) between its plan and its update, so the rotary policy's residencies expire at
the same steps on any machine and in any checkout (on the wall clock a slower run rotated more
per step). Under contention most steps rotate a few requests and every ~60th a wave of ~150: the
median is the first kind, the mean counts both.

    python -m bench.sched [--live 256,1024,4096] [--steps 200] [--tag T]
    python -m bench.sched --vllm-python .venv-vllm/bin/python   # vLLM's v1 scheduler beside ours
    python -m bench.sched --against /path/to/old/checkout       # old and new, interleaved

With --vllm-python, bench/vllm_sched.py runs the same situations through vLLM's own scheduler
in that venv (`make vllm-env`), in the same run, and the record holds both. With --against, each
situation runs `--rounds` times in each checkout (this file, under that checkout's `.venv`, so it
imports that checkout's scheduler), alternating, and the record holds both, the ratio of their
medians and the median (and range) of each round's ratio (`paired_speedup`: the two runs of a
round share the machine's hour): these machines' speed varies by 2-3x from day to day and
within a run, so only figures of one run compare. Every record
also holds `python_reference_us`, a fixed pure-Python loop timed in the same run, for scale.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import random
import statistics
import subprocess
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.policies import make_policy
from superinfer.engine.core.request import Request, SamplingParams
from superinfer.engine.core.scheduler import Scheduler, SchedulerConfig
from superinfer.engine.model.tiny import ensure_tiny_model
from superinfer.workload.record import write_result
from superinfer.workload.replay import VirtualClock

BLOCK = 16
_UPDATE_TAKES = inspect.signature(Scheduler.update).parameters
_UPDATE_TAKES_DICT = "sampled" in _UPDATE_TAKES
_UPDATE_TAKES_ARRAY = "ndarray" in str(_UPDATE_TAKES.get("tokens", inspect.Parameter("x", 1)).annotation)


SITUATIONS = ("fits", "contention", "churn")
Replacer = Callable[[], Request]  # a new request, with an id of its own


def new_request(rng: random.Random, i: int, churn: bool, fewest_tokens: int = 32) -> Request:
    prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(64, 256))]
    max_tokens = rng.randint(fewest_tokens, 256) if churn else 10_000
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0), arrival_time=0.0)


STEP_S = 0.002  # what a step takes on the device, between the plan and its update


def build(policy: str, live: int, situation: str, steps: int, seed: int = 0) -> tuple[Scheduler, Replacer | None]:
    """The scheduler with `live` requests added, and with churn what makes each replacement.
    With `fits`, every request fits for all `steps`; under contention half of them, 64 tokens on."""
    rng = random.Random(seed)
    # (with churn the first ones end after 1 to 256 tokens: finishes from the first steps on)
    requests = [new_request(rng, i, situation == "churn", fewest_tokens=1) for i in range(live)]
    grow = max(64, steps + 14) if situation == "fits" else 64
    need = sum(-(-(len(r.prompt_token_ids) + grow) // BLOCK) for r in requests)
    if situation == "churn":
        need += 12 * live  # the longest output, 256 tokens, on top of 64
    kv = KVCacheManager(need // 2 if situation == "contention" else need + live, BLOCK, True, num_cpu_blocks=2 * need)
    # (a context no longer than the pool: below ~40 live requests it would not hold one of 4096)
    max_model_len = min(4096, kv.num_blocks * BLOCK)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=live, max_num_batched_tokens=1 << 20, max_model_len=max_model_len),
        kv,
        make_policy(policy, num_gpu_blocks=kv.num_blocks),
        VirtualClock(),  # STEP_S a step, whatever this machine's speed (module docstring)
    )
    for req in requests:
        sched.add(req)
    if situation != "churn":
        return sched, None
    rng, ids = random.Random(seed + 1), itertools.count(live)
    return sched, lambda: new_request(rng, next(ids), churn=True)


def made_up_tokens(plan: StepPlan) -> np.ndarray | list[int] | dict[str, int]:
    """Token 7 for each sampled row, as the runner hands them over: an int64 array in row order
    (for a checkout from before `Scheduler.update` took one, a list, or before it took a list, a
    dict by request id: --against)."""
    if _UPDATE_TAKES_DICT:
        return dict.fromkeys(plan.sampled_ids(), 7)
    if _UPDATE_TAKES_ARRAY:
        return np.full(plan.num_sampled, 7, dtype=np.int64)
    return [7] * plan.num_sampled


def time_steps(sched: Scheduler, steps: int, replace: Replacer | None = None) -> tuple[list[float], list[int]]:
    """Seconds per step (schedule + update), and the requests each step scheduled. With
    `replace`, each request that finished gets a new one in its place between steps (not
    timed: a server thread adds requests)."""
    seconds, scheduled = [], []
    for step in range(5 + steps):  # the first 5 untimed: they prefill everything that fits
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        sched.clock.now += STEP_S
        t2 = time.perf_counter()
        touched = sched.update(plan, made_up_tokens(plan))
        if step >= 5:
            seconds.append(time.perf_counter() - t2 + t1 - t0)
            scheduled.append(plan.num_seqs)
        if replace is not None:
            for _ in range(sum(1 for r in touched if r.is_finished)):
                sched.add(replace())
    return seconds, scheduled


class _Row:
    __slots__ = ("a", "b", "c")

    def __init__(self) -> None:
        self.a, self.b, self.c = 0, 0, []


def python_reference_us() -> float:
    """Microseconds for three attribute reads of 1024 objects (best of 20): this machine's speed
    at the kind of work the scheduler does per request. (Plain slots, as Request's fields were
    until its counters became properties: the figure stays comparable across records.)"""
    rows = [_Row() for _ in range(1024)]

    def reads() -> None:
        for r in rows:
            r.a, r.b, r.c  # noqa: B018

    return 1e6 * min(timeit.repeat(reads, number=1, repeat=20))


def situations(live: str) -> list[tuple[str, str, int]]:
    return [(p, s, int(n)) for s in SITUATIONS for p in ("fcfs", "rotary") for n in live.split(",")]


def key(policy: str, situation: str, live: int) -> str:
    return f"{policy}-{situation}-{live}"


def summary(times: list[float], scheduled: list[int]) -> dict[str, float]:
    return {
        "median_ms": 1000 * statistics.median(times),
        "p90_ms": 1000 * sorted(times)[int(0.9 * len(times))],
        "mean_ms": 1000 * statistics.mean(times),  # (under contention: with the steps that rotate many)
        "scheduled_reqs_median": statistics.median(scheduled),
    }


def in_checkout(checkout: Path, policy: str, situation: str, live: int, steps: int) -> tuple[list[float], list[int]]:
    """This file's `--child` run under another checkout's venv (-P: this folder, which holds a
    copy.py, must not shadow the standard library)."""
    python = checkout / ".venv" / "bin" / "python"
    cmd = [str(python), "-P", __file__, "--child", policy, situation, str(live), "--steps", str(steps)]
    out = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} in {checkout} failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["seconds"], got["scheduled"]


def against(old: Path, live: str, steps: int, rounds: int) -> dict[str, dict[str, Any]]:
    here = Path(__file__).resolve().parent.parent
    figures: dict[str, dict[str, Any]] = {}
    for policy, situation, n in situations(live):
        runs: dict[str, tuple[list[float], list[int]]] = {"old": ([], []), "new": ([], [])}
        ratios = []  # each round's old median over its new median: a pair shares the machine's hour
        for r in range(rounds):  # alternating which goes first: the second of a pair tends to run faster
            pair = (("old", old), ("new", here))
            medians = {}
            for label, checkout in pair if r % 2 == 0 else pair[::-1]:
                times, scheduled = in_checkout(checkout, policy, situation, n, steps)
                runs[label][0].extend(times)
                runs[label][1].extend(scheduled)
                medians[label] = statistics.median(times)
            ratios.append(medians["old"] / medians["new"])
        k = key(policy, situation, n)
        figures[k], figures[f"{k}-old"] = summary(*runs["new"]), summary(*runs["old"])
        figures[k]["speedup"] = figures[f"{k}-old"]["median_ms"] / figures[k]["median_ms"]
        figures[k]["paired_speedup"] = statistics.median(ratios)
        figures[k]["paired_speedup_range"] = [min(ratios), max(ratios)]
        print(
            f"{k:28s} old {figures[f'{k}-old']['median_ms']:7.2f} ms  new {figures[k]['median_ms']:7.2f} ms"
            f"  speedup {figures[k]['speedup']:.2f}x  paired {figures[k]['paired_speedup']:.2f}x"
            f" ({min(ratios):.2f}-{max(ratios):.2f})",
            flush=True,
        )
    return figures


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
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tag", default="", help="names a variant run's results file (sched-TAG-cpu-DATE.json)")
    parser.add_argument("--vllm-python", help="python of a venv with vLLM: time its scheduler too")
    parser.add_argument("--against", type=Path, help="an older checkout with its own .venv: time both, interleaved")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: runs per situation and checkout")
    parser.add_argument("--child", nargs=3, metavar=("POLICY", "SITUATION", "LIVE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        policy, situation, live = args.child
        sched, replace = build(policy, int(live), situation, args.steps)
        times, scheduled = time_steps(sched, args.steps, replace)
        print(json.dumps({"seconds": times, "scheduled": scheduled}))
        return
    figures: dict[str, dict[str, Any]] = {}
    if args.against:
        figures = against(args.against.resolve(), args.live, args.steps, args.rounds)
    else:
        for policy, situation, n in situations(args.live):
            sched, replace = build(policy, n, situation, args.steps)
            f = figures[key(policy, situation, n)] = summary(*time_steps(sched, args.steps, replace))
            print(
                f"{key(policy, situation, n):28s} median {f['median_ms']:7.2f} ms  p90 {f['p90_ms']:7.2f} ms"
                f"  mean {f['mean_ms']:7.2f} ms"
                f"   ({f['scheduled_reqs_median']:.0f} reqs/step)",
                flush=True,
            )
    if args.vllm_python:
        figures |= vllm_figures(args.vllm_python, args.live, args.steps)
    reference = python_reference_us()
    print(f"python reference (3 attribute reads x 1024): {reference:.1f} us")
    goal = {"median_ms_at_1024": "<= 0.5 (the reference spends 7.6 ms)"}
    extra = {"python_reference_us": reference, "against": str(args.against) if args.against else None}
    print(f"wrote {write_result('sched', 'cpu', figures, goal, extra, tag=args.tag)}")


if __name__ == "__main__":
    main()
