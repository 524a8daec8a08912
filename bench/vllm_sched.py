"""vllm_sched: vLLM v1 scheduler host time per step (schedule + update_from_output), no model.

The counterpart of bench/sched.py for the real vLLM: its `Scheduler` (and, with --async, its
`AsyncScheduler`) built directly from a VllmConfig, with no engine, workers or weights. The
situations are the same as ours: `live` requests with seeded random prompts of 64..256 tokens,
one full-attention KV group of 16-token blocks with prefix caching, and blocks for: every prompt
and all the tokens of the run, plus `live` spare ("fits"); half of what every prompt + 64 tokens
take ("contention", where vLLM preempts by recompute); every prompt + 256 tokens, plus `live`
spare, with each request ending after 32-256 tokens and a new one with a new prompt taking its
place before the next step ("churn": the first ones end after 1-256 tokens; adding a request, its
prompt's block hashes included, is not timed). Each step's model output is made up: every
scheduled request whose prefill is complete gets token 7. 5 warm-up steps, then `--steps` timed ones.

Runs in the vLLM venv (the CPU build), not ours, from the repository root:

    .venv-vllm/bin/python bench/vllm_sched.py --model-dir ~/.cache/superinfer/tiny-v2 [--live 256,1024,4096]
        [--steps 50] [--async] [--no-log-stats]

Prints one line per case on stderr, then a JSON object with every figure on stdout (what
`python -m bench.sched --vllm-python .venv-vllm/bin/python` reads to put vLLM beside ours).
"""

from __future__ import annotations

import os
import sys

# Run as a file (python bench/vllm_sched.py), bench/ would lead sys.path, and bench/sched.py would
# shadow the standard library's sched module: drop it before anything imports one.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams, __version__  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK = 16
MAX_MODEL_LEN = 4096
MAX_BATCHED_TOKENS = 1 << 20
WARMUP = 5
TOKEN = 7


@dataclass
class StepTimes:
    """Per timed step: seconds in schedule(), in building the output + update_from_output(), and counts."""

    schedule: list[float]
    update: list[float]
    scheduled_reqs: list[int]
    scheduled_tokens: list[int]
    preemptions: int  # requests preempted during the timed steps

    @property
    def total(self) -> list[float]:
        return [s + u for s, u in zip(self.schedule, self.update, strict=True)]


SITUATIONS = ("fits", "contention", "churn")


def new_request(rng: random.Random, i: int, churn: bool, hasher: Callable, fewest_tokens: int = 32) -> Request:
    """bench/sched.py's request (the same draws from the same seed), as vLLM's."""
    prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(64, 256))]
    max_tokens = rng.randint(fewest_tokens, 256) if churn else 10_000
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(f"r{i}", prompt, params, None, arrival_time=0.0, block_hasher=hasher)


def build(
    model_dir: Path, live: int, situation: str, steps: int, use_async: bool, log_stats: bool, seed: int = 0
) -> tuple[Scheduler, Callable[[], Request] | None]:
    """A vLLM scheduler with `live` waiting requests, sized like bench/sched.py's (with `fits`,
    every request fits for all `steps`), and with churn what makes each replacement."""
    rng = random.Random(seed)
    # As EngineCore does with prefix caching on: block hashes are computed as tokens arrive.
    hash_fn = get_hash_fn_by_name(CacheConfig(block_size=BLOCK).prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    churn = situation == "churn"
    requests = [new_request(rng, i, churn, hasher, fewest_tokens=1) for i in range(live)]
    grow = max(64, steps + WARMUP + 9) if situation == "fits" else 64
    need = sum(-(-(r.num_prompt_tokens + grow) // BLOCK) for r in requests)
    if churn:
        need += 12 * live  # the longest output, 256 tokens, on top of 64
    usable = need // 2 if situation == "contention" else need + live
    num_blocks = usable + 1  # vLLM's block pool keeps block 0 as its null block

    model_config = ModelConfig(
        model=str(model_dir), dtype="float32", seed=seed, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=live,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        async_scheduling=use_async,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        hash_block_size=BLOCK,
    )
    cls = AsyncScheduler if use_async else Scheduler
    sched = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        log_stats=log_stats,
    )
    assert sched.max_num_scheduled_tokens == MAX_BATCHED_TOKENS, sched.max_num_scheduled_tokens

    for req in requests:
        sched.add_request(req)
    if not churn:
        return sched, None
    rng, ids = random.Random(seed + 1), itertools.count(live)
    return sched, lambda: new_request(rng, next(ids), churn=True, hasher=hasher)


def runner_output(sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """What the model runner would return: token 7 for each scheduled request whose prefill is done.

    After schedule(), a request's num_computed_tokens already counts this step's tokens; the
    scheduler marks the ones that do not reach the end of their prompt `is_prefill_chunk`."""
    req_ids = list(out.num_scheduled_tokens)
    requests = sched.requests
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[] if requests[r].is_prefill_chunk else [TOKEN] for r in req_ids],
    )


def time_steps(sched: Scheduler, steps: int, replace: Callable[[], Request] | None = None) -> StepTimes:
    """With `replace`, the finished requests get new ones in their place between steps (untimed)."""
    live = len(sched.requests)

    def refill() -> None:
        if replace is not None:
            for _ in range(live - len(sched.requests)):
                sched.add_request(replace())

    for _ in range(WARMUP):  # prefill everything that fits
        out = sched.schedule()
        sched.update_from_output(out, runner_output(sched, out))
        refill()
    times = StepTimes([], [], [], [], 0)
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        sched.update_from_output(out, runner_output(sched, out))
        t2 = clock()
        refill()
        times.schedule.append(t1 - t0)
        times.update.append(t2 - t1)
        times.scheduled_reqs.append(len(out.num_scheduled_tokens))
        times.scheduled_tokens.append(out.total_num_scheduled_tokens)
        times.preemptions += len(out.preempted_req_ids or ())
    return times


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * len(xs))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--live", default="256,1024,4096")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--async", dest="use_async", action="store_true", help="also time the AsyncScheduler")
    parser.add_argument(
        "--no-log-stats", action="store_true", help="build the scheduler with log_stats=False (vllm serve has it on)"
    )
    parser.add_argument("--model-dir", required=True, help="a model folder with a config.json (no weights read)")
    args = parser.parse_args()
    lives = [int(n) for n in args.live.split(",")]
    variants = [False, True] if args.use_async else [False]
    figures: dict[str, dict[str, float]] = {}
    model_dir = Path(args.model_dir)
    for use_async in variants:
        for situation in SITUATIONS:
            for live in lives:
                sched, replace = build(model_dir, live, situation, args.steps, use_async, not args.no_log_stats)
                t = time_steps(sched, args.steps, replace)
                name = "vllm-async" if use_async else "vllm"
                key = f"{name}-{situation}-{live}"
                figures[key] = {
                    "median_ms": 1000 * statistics.median(t.total),
                    "p90_ms": 1000 * p90(t.total),
                    "schedule_median_ms": 1000 * statistics.median(t.schedule),
                    "schedule_p90_ms": 1000 * p90(t.schedule),
                    "update_median_ms": 1000 * statistics.median(t.update),
                    "update_p90_ms": 1000 * p90(t.update),
                    "scheduled_reqs_median": statistics.median(t.scheduled_reqs),
                    "scheduled_tokens_median": statistics.median(t.scheduled_tokens),
                    "preemptions_timed": t.preemptions,
                    "preemptions_total": sum(r.num_preemptions for r in sched.requests.values()),
                }
                f = figures[key]
                print(
                    f"{key:28s} median {f['median_ms']:7.2f} ms  p90 {f['p90_ms']:7.2f} ms"
                    f"   (schedule {f['schedule_median_ms']:6.2f} + update {f['update_median_ms']:6.2f} ms;"
                    f" {f['scheduled_reqs_median']:.0f} reqs, {f['scheduled_tokens_median']:.0f} tokens/step;"
                    f" {t.preemptions} preemptions)",
                    file=sys.stderr,
                    flush=True,
                )
    result = {
        "bench": "vllm_sched",
        "vllm_version": __version__,
        "python": sys.version.split()[0],
        "steps": args.steps,
        "log_stats": not args.no_log_stats,
        "figures": figures,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
