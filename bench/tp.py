"""tp: what tensor parallelism costs per decode step on the CPU: the tiny model at `-tp 2` against `-tp 1`.

Each configuration serves the same greedy requests (B prompts of 32 tokens, 64 new tokens each)
through EngineCore; a decode step's time is the wall time of the steps after every request has its
first token, over their count (median of the repeats). `-tp 2` runs its two ranks with one torch
thread each; `-tp 1` runs with one thread (the same compute per rank) and with two (the same cores).
A `-tp 2` decode step adds the plan's pickling and pipe, 2 all-reduces per layer, one for the
embedding, the logits' gather and the tokens' broadcast (gloo over localhost TCP). Outputs compared.

    python -m bench.tp [--batches 1,16] [--decode-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.workload.record import write_result

# name -> (tensor-parallel size, torch threads per rank)
CONFIGS = {"tp1_1thread": (1, 1), "tp1_2threads": (1, 2), "tp2_1thread_per_rank": (2, 1)}


class CollectiveClock:
    """Rank 0's seconds inside torch.distributed collectives (waiting for the other rank included)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        for name in ("all_reduce", "gather", "broadcast"):
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 3000) for _ in range(length)] for _ in range(batch)]


def decode_step_seconds(
    core: EngineCore, batch: list[list[int]], tokens: int, clock: CollectiveClock
) -> tuple[float, float, list[list[int]]]:
    """Seconds per decode step (after the prefill and first token of every prompt), seconds in
    collectives per decode step, and the outputs."""
    sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    for rid, prompt in zip(outs, batch, strict=True):
        core.add_request(rid, prompt, sampling)

    def step() -> int:
        for o in core.step():
            outs[o.request_id] += o.token_ids
        return 1

    while not all(outs.values()):
        step()
    t0, in_collectives = time.perf_counter(), clock.seconds
    steps = 0
    while core.has_work:
        steps += step()
    return (time.perf_counter() - t0) / steps, (clock.seconds - in_collectives) / steps, list(outs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    clock = CollectiveClock()
    figures: dict[str, float] = {}
    outputs: dict[str, dict[int, list[list[int]]]] = {}
    for name, (size, threads) in CONFIGS.items():
        core = EngineCore(
            EngineConfig(model="tiny", device="cpu", dtype="float32", tensor_parallel_size=size, torch_threads=threads)
        )
        try:
            decode_step_seconds(core, prompts(2, 8, seed=99), 4, clock)  # warm up
            outputs[name] = {}
            for b in batches:
                batch = prompts(b, args.prompt_tokens, seed=b)
                runs = [decode_step_seconds(core, batch, args.decode_tokens, clock) for _ in range(args.repeats)]
                step_ms = 1000 * statistics.median(r[0] for r in runs)
                figures[f"b{b}_{name}_decode_step_ms"] = step_ms
                if size > 1:
                    figures[f"b{b}_{name}_in_collectives_ms"] = 1000 * statistics.median(r[1] for r in runs)
                outputs[name][b] = runs[-1][2]
                print(f"{name:22s} B={b:3d}: {step_ms:7.2f} ms per decode step", flush=True)
        finally:
            core.close()
    for b in batches:
        tp2 = figures[f"b{b}_tp2_1thread_per_rank_decode_step_ms"]
        figures[f"b{b}_tp2_overhead_ms_vs_tp1_1thread"] = tp2 - figures[f"b{b}_tp1_1thread_decode_step_ms"]
        figures[f"b{b}_tp2_speedup_vs_tp1_2threads"] = figures[f"b{b}_tp1_2threads_decode_step_ms"] / tp2
        same = outputs["tp2_1thread_per_rank"][b] == outputs["tp1_1thread"][b]
        figures[f"b{b}_greedy_outputs_identical"] = float(same)
    goal = {
        "greedy_outputs_identical": 1.0,
        "tp2_overhead_ms_vs_tp1_1thread": "about the time in collectives: a tiny model's step is latency, not compute",
    }
    extra = {
        "model": "tiny (4 layers, hidden 256, 4 heads / 2 KV heads, vocab 3072), float32",
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "collectives_per_decode_step": "2 per layer + 1 all-reduces, 1 gather (logits), 1 broadcast (tokens)",
        "load_average_1min_at_end": os.getloadavg()[0],
        "cores": os.cpu_count(),
    }
    print(f"wrote {write_result('tp', 'cpu', figures, goal, extra)}")


if __name__ == "__main__":
    main()
