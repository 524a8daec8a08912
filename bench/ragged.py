"""ragged: one engine step of a ragged mixed batch, as a served load produces it.

Decodes at contexts spread over a range beside prefill chunks of different lengths (some
continuing an earlier chunk), their blocks scattered over a KV cache filled with random values;
the runner executes the same StepPlan again and again (copies, forward, sampling: the whole step)
and the median step time is reported per case and torch thread count. The sampled tokens are
hashed, so two checkouts can be checked token for token on the same plan.

    python -m bench.ragged                                  # this checkout, every case
    python -m bench.ragged --against /path/to/old/checkout  # old and new back to back, interleaved
    python -m bench.ragged --backends torch,cpu             # two attention backends, interleaved

`--against` runs the same cases in that checkout (its own `.venv`; this file is copied into its
`bench/` when missing) and in this one, alternating, each run in a fresh process, and records both
with the speedup; `--backends A,B` does the same with two attention backends of this checkout
(the speedup is A's time over B's). Cases: `tiny` (hidden 256, 4 layers, block 16 and 32) and `llama-3.2-1b` with its
layers cut to a few (dummy weights), both float32.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SPEC = {
    "tiny-b16": {"model": "tiny", "block_size": 16},
    "tiny-b32": {"model": "tiny", "block_size": 32},
    "llama1b-l2-b16": {"model": "llama-3.2-1b", "layers": 2, "block_size": 16},
}
DECODE_CONTEXT = (50, 400)
PREFILL_CHUNK = (64, 256)


@dataclass(frozen=True)
class Mix:
    decodes: int = 32
    prefills: int = 3


def _model_spec(name: str, layers: int | None, tmp: Path) -> tuple[str, bool]:
    """(model spec, dummy weights): a preset cut to `layers` layers is written as a config-only folder."""
    if layers is None:
        return name, name != "tiny"
    from superinfer.engine.model.loader import PRESETS_DIR

    raw = json.loads((PRESETS_DIR / f"{name}.json").read_text())
    raw["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(raw))
    return str(tmp), True


def build_plan(mix: Mix, block_size: int, num_blocks: int, vocab: int, seed: int = 0):  # -> StepPlan
    from superinfer.engine.core.plan import ScheduledSeq, StepPlan
    from superinfer.engine.core.request import SamplingParams

    rng = random.Random(seed)
    greedy = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    free = list(range(num_blocks))
    random.Random(seed + 1).shuffle(free)  # a served cache is fragmented: no sequence owns neighbouring blocks
    seqs = []

    def blocks(n_tokens: int) -> list[int]:
        return [free.pop() for _ in range(-(-n_tokens // block_size))]

    for i in range(mix.prefills):
        start = rng.choice([0, 0, 128, 256])  # a first chunk or the continuation of an earlier one
        n = rng.randint(*PREFILL_CHUNK)
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        seqs.append(ScheduledSeq(f"p{i}", ids, start, blocks(start + n), True, greedy))
    for i in range(mix.decodes):
        ctx = rng.randint(*DECODE_CONTEXT)
        seqs.append(ScheduledSeq(f"d{i}", [rng.randrange(3, vocab)], ctx - 1, blocks(ctx), True, greedy))
    rng.shuffle(seqs)  # decodes and prefills interleaved in the flat batch
    return StepPlan(step_id=1, seqs=seqs)


def run_case(case: str, threads: int, steps: int, mix: Mix, backend: str | None = None) -> dict:
    """Time `steps` executions of the case's plan in this process; returns the figures."""
    import torch

    from superinfer.engine.config import EngineConfig
    from superinfer.engine.engine import EngineCore

    torch.set_num_threads(threads)
    spec = SPEC[case]
    with tempfile.TemporaryDirectory() as tmp:
        model, dummy = _model_spec(spec["model"], spec.get("layers"), Path(tmp))
        bs = spec["block_size"]
        need = mix.prefills * (-(-(256 + PREFILL_CHUNK[1]) // bs)) + mix.decodes * (-(-DECODE_CONTEXT[1] // bs))
        core = EngineCore(
            EngineConfig(
                model=model,
                device="cpu",
                dtype="float32",
                dummy_weights=dummy,
                block_size=bs,
                num_gpu_blocks=2 * need,
                num_cpu_blocks=0,
                max_model_len=1024,
                **({"attention_backend": backend} if backend else {}),
            )
        )
    runner = core.runner
    torch.manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, dtype=runner.kv_cache.dtype))
    plan = build_plan(mix, bs, runner.kv_cache.shape[0], core.model_config.vocab_size)
    for _ in range(2):
        runner.execute(plan)  # warm up
    times, tokens = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        out = runner.execute(plan)
        times.append(time.perf_counter() - t0)
        sampled = out.sampled  # an array; a list or a dict in older checkouts (--against)
        if not isinstance(sampled, dict):
            sampled = dict(zip(plan.sampled_ids(), list(map(int, sampled)), strict=True))
        tokens = sampled
    digest = hashlib.sha256(json.dumps(sorted((tokens or {}).items())).encode()).hexdigest()[:16]
    return {
        "case": case,
        "threads": threads,
        "step_ms": 1000 * statistics.median(times),
        "tokens": plan.num_tokens,
        "tokens_sha": digest,
    }


def _child(args: argparse.Namespace) -> None:
    mix = Mix(args.decodes, args.prefills)
    print(json.dumps(run_case(args.case, args.threads, args.steps, mix, args.attention_backend)))


def _spawn(checkout: Path, backend: str | None, case: str, threads: int, args: argparse.Namespace) -> dict:
    python = checkout / ".venv" / "bin" / "python"
    cmd = [str(python), "-m", "bench.ragged", "--child", "--case", case, "--threads", str(threads)]
    cmd += ["--steps", str(args.steps), "--decodes", str(args.decodes), "--prefills", str(args.prefills)]
    if backend:
        cmd += ["--attention-backend", backend]
    out = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} in {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(SPEC))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run (median)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per case and checkout, alternating (median)")
    parser.add_argument("--decodes", type=int, default=Mix.decodes)
    parser.add_argument("--prefills", type=int, default=Mix.prefills)
    parser.add_argument("--against", type=Path, default=None, help="an older checkout with its own .venv")
    parser.add_argument("--backends", default=None, help="A,B: two attention backends of this checkout")
    parser.add_argument("--tag", default="", help="names the results file (bench/results/ragged-TAG-...)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--attention-backend", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.threads = int(args.threads)
        _child(args)
        return

    here = Path(__file__).resolve().parent.parent
    # label -> (checkout, attention backend or None for its default); a pair is compared first / last
    contenders: dict[str, tuple[Path, str | None]] = {"new": (here, None)}
    if args.against is not None:
        target = args.against.resolve() / "bench" / "ragged.py"
        if not target.exists():
            shutil.copy(__file__, target)
        contenders = {"old": (args.against.resolve(), None), "new": (here, None)}
    elif args.backends:
        contenders = {b: (here, b) for b in args.backends.split(",")}
    labels = list(contenders)
    figures: dict[str, float | str] = {}
    for case in args.cases.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            runs: dict[str, list[dict]] = {k: [] for k in contenders}
            for _ in range(args.rounds):
                for label, (checkout, backend) in contenders.items():
                    runs[label].append(_spawn(checkout, backend, case, threads, args))
            for label, got in runs.items():
                key = f"{case}_t{threads}" + ("" if label == "new" else f"_{label}")
                figures[f"{key}_step_ms"] = statistics.median(r["step_ms"] for r in got)
                figures[f"{key}_tokens_sha"] = got[0]["tokens_sha"]
            line = f"{case:16s} threads {threads}: " + "  ".join(
                f"{label} {statistics.median(r['step_ms'] for r in got):8.2f} ms" for label, got in runs.items()
            )
            if len(labels) == 2:
                key = f"{case}_t{threads}"
                first, last = (key + ("" if label == "new" else f"_{label}") for label in labels)
                figures[f"{key}_speedup"] = figures[f"{first}_step_ms"] / figures[f"{last}_step_ms"]
                same = runs[labels[0]][0]["tokens_sha"] == runs[labels[1]][0]["tokens_sha"]
                figures[f"{key}_tokens_identical"] = same
                line += f"  speedup {figures[f'{key}_speedup']:.2f}x  tokens identical: {same}"
            print(line + f"  ({got[0]['tokens']} tokens/step)", flush=True)

    from superinfer.workload.record import write_result

    goal = {"step_ms": "the issue: vLLM's CPU build runs this kind of batch at ~1/3 of our time before the change"}
    extra = {
        "mix": {
            "decodes": args.decodes,
            "decode_context": DECODE_CONTEXT,
            "prefill_chunks": args.prefills,
            "prefill_chunk_tokens": PREFILL_CHUNK,
            "prefill_start": [0, 128, 256],
        },
        "cases": {k: SPEC[k] for k in args.cases.split(",")},
        "against": str(args.against) if args.against else None,
        "backends": args.backends,
    }
    print(f"wrote {write_result('ragged', 'cpu', figures, goal, extra, tag=args.tag)}")


if __name__ == "__main__":
    sys.exit(main())
