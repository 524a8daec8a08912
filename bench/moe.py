"""moe: decode tokens/s of the engine against transformers `generate` on the same small random
mixture-of-experts models (a Mixtral and a Qwen3-MoE), at batch 1 and a larger batch.

Each model is built with transformers from a seed and saved as a Hub-style checkpoint (per-expert
tensors), which both sides load. Prompts have one length, so `generate` needs no padding and both
sides compute the same tokens (greedy, EOS ignored). Decode time: the engine's steps after every
request has its first token; for `generate`, a run of 1 + N new tokens minus a run of 1 (the
prefill cancels). Both in one process, with the same torch threads.

    python -m bench.moe [--batches 1,16] [--prompt-tokens 32] [--decode-tokens 32] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.worker.runner import torch_threads
from superinfer.workload.record import write_result

VOCAB = 3072
_SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
}
# name -> (transformers config class, its MoE settings)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", {"intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "norm_topk_prob": True,
            "head_dim": 32,
        },
    ),
}


def build_checkpoint(arch: str, path: Path, seed: int = 0) -> Path:
    import transformers

    cls_name, moe = MODELS[arch]
    config = getattr(transformers, cls_name)(**_SHAPE, **moe, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routers with some contrast, so tokens spread over the experts unevenly
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def make_prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(batch)]


def engine_decode(core: EngineCore, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for `tokens` - 1 decode steps after the prefill (and first token) of every prompt."""
    sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for rid, prompt in zip(outs, prompts, strict=True):
        core.add_request(rid, prompt, sampling)

    def step() -> None:
        for o in core.step():
            outs[o.request_id] += o.token_ids

    while not all(outs.values()):
        step()
    t0 = time.perf_counter()
    while core.has_work:
        step()
    return time.perf_counter() - t0, list(outs.values())


def generate(model: Any, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()


def generate_decode(model: Any, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for `tokens` - 1 decode steps: a run of `tokens` new tokens minus a run of one."""
    first, _ = generate(model, prompts, 1)
    full, out = generate(model, prompts, tokens)
    return full - first, out


def median_run(fn: Any, repeats: int) -> tuple[float, list[list[int]]]:
    runs = [fn() for _ in range(repeats)]
    return statistics.median(s for s, _ in runs), runs[-1][1]


def bench_model(arch: str, path: Path, args: argparse.Namespace) -> tuple[dict[str, float], str]:
    """Figures per batch size, and which experts implementation transformers ran."""
    import transformers

    core = EngineCore(
        EngineConfig(model=str(path), device="cpu", dtype="float32", torch_threads=args.threads, max_num_seqs=256)
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine_decode(core, make_prompts(2, 8, seed=99), 4)  # warm up
    generate(hf, make_prompts(2, 8, seed=99), 4)
    figures: dict[str, float] = {}
    steps = args.decode_tokens - 1
    for batch in args.batches:
        prompts = make_prompts(batch, args.prompt_tokens, seed=batch)
        ours_s, ours = median_run(lambda p=prompts: engine_decode(core, p, args.decode_tokens), args.repeats)
        hf_s, ref = median_run(lambda p=prompts: generate_decode(hf, p, args.decode_tokens), args.repeats)
        key = f"{arch}_b{batch}"
        figures[f"{key}_engine_decode_tok_s"] = batch * steps / ours_s
        figures[f"{key}_transformers_generate_decode_tok_s"] = batch * steps / hf_s
        figures[f"{key}_speedup"] = hf_s / ours_s
        figures[f"{key}_greedy_outputs_identical_share"] = sum(a == b for a, b in zip(ours, ref, strict=True)) / batch
        print(
            f"{arch:10s} B={batch:3d}: engine {figures[f'{key}_engine_decode_tok_s']:8.0f} tok/s, "
            f"generate {figures[f'{key}_transformers_generate_decode_tok_s']:8.0f} tok/s, "
            f"{figures[f'{key}_speedup']:.2f}x, identical {figures[f'{key}_greedy_outputs_identical_share']:.2f}",
            flush=True,
        )
    return figures, str(hf.config._experts_implementation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=33, help="new tokens per request (the first is prefill)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.threads = torch_threads(args.threads)
    figures: dict[str, float] = {}
    hf_experts: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.models.split(","):
            arch_figures, hf_experts[arch] = bench_model(arch, build_checkpoint(arch, Path(tmp) / arch), args)
            figures.update(arch_figures)
    goal = {"speedup": ">= 1 (same model, same CPU threads)"}
    extra = {
        "models": {arch: {**_SHAPE, **MODELS[arch][1]} for arch in args.models.split(",")},
        "dtype": "float32",
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "experts": "engine/model/moe.py torch reference: pairs sorted by expert, one matmul pair per expert hit",
        "transformers_experts_implementation": hf_experts,
    }
    print(f"wrote {write_result('moe', 'cpu', figures, goal, extra)}")


if __name__ == "__main__":
    main()
