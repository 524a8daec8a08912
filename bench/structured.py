"""structured: the step-time cost of grammar-constrained decoding (structured outputs).

B requests decode side by side, all under a JSON schema (a long free string, so no row finishes
early), against the same batch unconstrained, in one run: a warm-up pair, then `--rounds` pairs
alternating the two. The median time of the steps in which all B rows decode is compared. The
grammar masks are filled by llguidance on a thread while the model runs, so `mask_fill_ms` (the
fill alone, measured on the same matchers) shows how much of it the forward pass hides.

    python -m bench.structured --device cpu --model tiny --batches 1,32,256
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.grammar import GrammarMatcher, fill_bitmasks
from superinfer.engine.output_constraint import GuidedSpec
from superinfer.workload.record import write_result

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 4000}},
    "required": ["answer"],
    "additionalProperties": False,
}


def step_times(core: EngineCore, batch: int, steps: int, guided: GuidedSpec | None) -> list[tuple[float, float]]:
    """(wall time, engine-thread CPU time) of each step in which all `batch` requests decode. The
    thread's CPU time leaves out the mask thread and time lost to other processes on a shared
    machine; torch runs its kernels on this thread with one torch thread (the 2-core default)."""
    rng = random.Random(batch)
    vocab = core.model_config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(16)]
        sampling = SamplingParams(max_tokens=steps, temperature=1.0, seed=i, ignore_eos=guided is None, guided=guided)
        core.add_request(f"b{batch}-{i}-{guided is not None}", prompt, sampling)
    times = []
    while core.has_work:
        decoding = sum(1 for r in core.scheduler.running if r.in_decode)
        t0, c0 = time.perf_counter(), time.thread_time()
        core.step()
        if decoding == batch:
            times.append((time.perf_counter() - t0, time.thread_time() - c0))
    return times


def fill_ms(core: EngineCore, batch: int, guided: GuidedSpec, repeats: int = 20) -> float:
    """Median time to fill `batch` masks a few tokens into the schema, without a model step."""
    assert core.grammars is not None
    grammar = core.grammars.compile(guided)
    prefix = core.tokenizer.encode('{"answer": "the', add_special_tokens=False)
    matchers = []
    for _ in range(batch):
        matcher = GrammarMatcher(grammar)
        for token in prefix:
            matcher.accept(token)
        matchers.append(matcher)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fill_bitmasks(matchers)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    core = EngineCore(EngineConfig(model=args.model, device=args.device, max_num_seqs=512, max_num_batched_tokens=8192))
    guided = GuidedSpec.for_json_schema(SCHEMA)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        plain: list[tuple[float, float]] = []
        constrained: list[tuple[float, float]] = []
        for r in range(args.rounds + 1):
            p, c = step_times(core, batch, args.steps, None), step_times(core, batch, args.steps, guided)
            if r:  # the first pair warms up
                plain += p
                constrained += c

        def ms(times: list[tuple[float, float]], k: int) -> float:
            return statistics.median(t[k] for t in times) * 1000

        row = {
            "batch": batch,
            "plain_step_ms": ms(plain, 0),
            "structured_step_ms": ms(constrained, 0),
            "plain_thread_cpu_ms": ms(plain, 1),
            "structured_thread_cpu_ms": ms(constrained, 1),
            "mask_fill_ms": fill_ms(core, batch, guided),
            "steps_measured": [len(plain), len(constrained)],
        }
        row["overhead"] = row["structured_step_ms"] / row["plain_step_ms"] - 1
        row["thread_cpu_overhead"] = row["structured_thread_cpu_ms"] / row["plain_thread_cpu_ms"] - 1
        rows.append(row)
        print(
            f"batch {batch:4d}: wall plain {row['plain_step_ms']:7.2f} ms, structured {row['structured_step_ms']:7.2f}"
            f" ms ({row['overhead']:+.1%}); engine-thread CPU {row['plain_thread_cpu_ms']:7.2f} vs "
            f"{row['structured_thread_cpu_ms']:7.2f} ms ({row['thread_cpu_overhead']:+.1%}); "
            f"mask fill alone {row['mask_fill_ms']:.2f} ms"
        )
    write_result(
        "structured",
        args.device,
        {"rows": rows},
        {"overhead_at_batch_32": "< 5% (mask work hidden under the forward pass)"},
        {"model": args.model, "steps": args.steps, "rounds": args.rounds, "schema": SCHEMA},
    )


if __name__ == "__main__":
    main()
