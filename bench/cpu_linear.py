"""cpu_linear: the CPU engine step with its linear layers on oneDNN's packed weights against torch's
matmul, in one process, the two alternating.

Decode steps at B requests (the whole step: forward, sampling, scheduling, outputs) and one
prefill, each `--rounds` times per mode; the medians and their ratio.

    python -m bench.cpu_linear [--model tiny] [--batches 1,4,16,64] [--context 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from superinfer.bench.step import decode, prefill
from superinfer.engine.config import EngineConfig
from superinfer.engine.engine import EngineCore
from superinfer.engine.model.packed_linear import Linear
from superinfer.workload.record import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    core = EngineCore(
        EngineConfig(
            model=args.model,
            dummy_weights=args.model != "tiny",
            device="cpu",
            torch_threads=args.threads,
            engine_process=False,
            num_gpu_blocks=2048,
            max_num_seqs=256,
            max_num_batched_tokens=max(args.prefill_tokens, 512),
        )
    )
    layers = [m for m in core.runner.model.modules() if isinstance(m, Linear)]
    packed = [m.packed for m in layers]
    if not all(p is not None for p in packed):
        raise SystemExit("the engine did not pack its linear layers here (see the startup log)")
    seconds: dict[str, list[float]] = defaultdict(list)
    for round_ in range(args.rounds):
        for mode in ("packed", "torch"):
            for m, p in zip(layers, packed, strict=True):
                m.packed = p if mode == "packed" else None
            for b in (int(x) for x in args.batches.split(",")):
                seconds[f"decode_b{b}_ms_{mode}"].append(1000 * decode(core, b, args.context, args.steps, False))
            seed = 2 * round_ + (mode == "torch")  # a prompt of its own: no prefix-cache hit
            seconds[f"prefill_{args.prefill_tokens}_ms_{mode}"].append(1000 * prefill(core, args.prefill_tokens, seed))
    figures: dict[str, float] = {key: statistics.median(values) for key, values in seconds.items()}
    for key in [k for k in figures if k.endswith("_packed")]:
        case = key.removesuffix("_ms_packed")
        figures[f"{case}_speedup"] = figures[f"{case}_ms_torch"] / figures[key]
        print(
            f"{case:14s} packed {figures[key]:8.2f} ms  torch {figures[f'{case}_ms_torch']:8.2f} ms  "
            f"speedup {figures[f'{case}_speedup']:.2f}x",
            flush=True,
        )
    extra = {"model": args.model, "context": args.context, "threads": args.threads, "torch": torch.__version__}
    goal = {"speedup": "> 1 from a few rows on, none lost at batch 1 (the packed weights are the CPU default)"}
    print(f"wrote {write_result('cpu_linear', 'cpu', figures, goal, extra, tag=args.tag)}")


if __name__ == "__main__":
    main()
