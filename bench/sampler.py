"""sampler: the batched sampler's time per step, per sampling mode, at (batch, vocab) shapes of
the tiny model (vocab 3072) and of real vocabularies (32k, Llama-3's 128k).

Logits are seeded normal scores (scale 3, so the top tokens dominate as in a real model); each
mode's params are the same for every row. Medians over `--repeats` calls, after one warm-up. On
the CPU the process keeps freed memory in its heap first, as the engine's CPU ranks do. On
the CPU it also times the tiny engine's whole model step (forward and sampling, `host_time`'s
`model`) at `--engine-batches` with top-p sampling, for scale.

    python -m bench.sampler [--shapes 1024x3072,256x32000,64x128256] [--device cpu] [--tag T]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from superinfer.bench.host_time import measure
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.worker.malloc_heap import retain_freed_heap
from superinfer.engine.worker.sampling import sample
from superinfer.workload.record import write_result

MODES = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=0.7, top_k=50),
    "top_p": SamplingParams(temperature=0.7, top_p=0.9),
    "top_p_seeded": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    "all": SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
}


def time_mode(logits: torch.Tensor, params: SamplingParams, repeats: int) -> float:
    n = logits.shape[0]
    generators = [torch.Generator(logits.device).manual_seed(i) if params.seed is not None else None for i in range(n)]
    seconds = []
    for _ in range(repeats + 1):
        if logits.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens, _ = sample(logits, [params] * n, generators)
        tokens.tolist()  # the runner reads them
        seconds.append(time.perf_counter() - t0)
    return 1000 * statistics.median(seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1024x3072,256x32000,64x128256")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's default on 2 cores)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine-batches", default="256,1024", help="CPU only; '' skips the engine steps")
    parser.add_argument("--tag", default="", help="names a variant run's results file (sampler-TAG-DEVICE-DATE.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        retain_freed_heap()
    figures: dict[str, dict[str, float]] = {}
    for shape in args.shapes.split(","):
        batch, vocab = map(int, shape.split("x"))
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(args.device)
        row = figures[shape] = {mode: time_mode(logits, p, args.repeats) for mode, p in MODES.items()}
        print(f"{shape:>10}  " + "  ".join(f"{mode} {ms:7.1f}" for mode, ms in row.items()) + "  ms", flush=True)
    if args.device == "cpu" and args.engine_batches:
        for batch in map(int, args.engine_batches.split(",")):
            greedy = measure(batch, 10, False)["model"]
            top_p = measure(batch, 10, False, MODES["top_p"])["model"]
            figures[f"engine_step_b{batch}"] = {"greedy": greedy, "top_p": top_p}
            print(f"tiny engine model step, B={batch}: greedy {greedy:.1f} ms, top_p {top_p:.1f} ms", flush=True)
    goal = {"random_modes": "close to greedy: no sort of [batch, vocab] and no noise per token on the CPU"}
    print(f"wrote {write_result('sampler', args.device, figures, goal, tag=args.tag)}")


if __name__ == "__main__":
    main()
