"""peer: engine tokens/s against transformers `generate` on the same model, prompts and device.

Both run in one process, one after the other, on the same token ids (greedy, fixed output length).
A preset (`--model llama-3-8b`) runs on random weights: transformers builds the architecture from
the same config, so the token streams differ but every step does the same work.

    python -m bench.peer [--model tiny] [--device cpu] [--prompts 32] [--output-tokens 64]
    python -m bench.peer --model llama-3-8b --device cuda --dtype bfloat16 --prompts 256 --output-tokens 128
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.model.loader import PRESETS_DIR
from superinfer.workload.record import write_result


def make_prompts(n: int, vocab: int, seed: int = 0, lo: int = 16, hi: int = 128) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(core: EngineCore, prompts: list[list[int]], output_tokens: int) -> tuple[float, list[list[int]]]:
    sampling = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, sampling)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    sync(core.device.type)
    t0 = time.perf_counter()
    while core.has_work:
        for o in core.step():
            outs[o.request_id] += o.token_ids
    sync(core.device.type)
    return time.perf_counter() - t0, list(outs.values())


def run_transformers(
    model: torch.nn.Module, prompts: list[list[int]], output_tokens: int, device: str
) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=output_tokens,
            min_new_tokens=output_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    sync(device)
    return time.perf_counter() - t0, out[:, width:].tolist()


def run_generate_batch(
    model: torch.nn.Module, prompts: list[list[int]], output_tokens: int, device: str
) -> tuple[float, list[list[int] | None]]:
    """transformers' continuous-batching `generate_batch` (transformers >= 4.54)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=output_tokens, min_new_tokens=output_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    model.generate_batch(prompts[:2], generation_config=config)  # warm up
    sync(device)
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, warmup=False)
    sync(device)
    seconds = time.perf_counter() - t0
    by_prompt = {tuple(o.prompt_ids): list(o.generated_tokens) for o in out.values()}
    return seconds, [by_prompt.get(tuple(p)) for p in prompts]


def transformers_model(path: Path | None, model: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The engine's model in transformers: its weights folder, or for a preset (no folder) the
    same architecture with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    preset = json.loads((PRESETS_DIR / f"{model.removeprefix('dummy://')}.json").read_text())
    config = AutoConfig.for_model(**preset)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.5, help="the engine's share (transformers' runs after it)"
    )
    parser.add_argument(
        "--no-generate-batch",
        dest="generate_batch",
        action="store_false",
        help="skip transformers' generate_batch (it sizes its cache to the free memory)",
    )
    args = parser.parse_args()

    core = EngineCore(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=max(256, args.prompts),
        )
    )
    prompts = make_prompts(args.prompts, core.model_config.vocab_size)
    run_engine(core, prompts[:2], 4)  # warm up
    engine_s, engine_out = run_engine(core, prompts, args.output_tokens)
    model_path, dtype = core.model_path, core.dtype
    core.close()
    del core  # its weights and KV cache make room for transformers'
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        print(f"GPU memory still allocated after the engine: {torch.cuda.memory_allocated() / 2**30:.2f} GiB")

    hf = transformers_model(model_path, args.model, dtype, args.device)
    run_transformers(hf, prompts[:2], 4, args.device)
    hf_s, hf_out = run_transformers(hf, prompts, args.output_tokens, args.device)

    tokens = args.prompts * args.output_tokens
    same = sum(a == b for a, b in zip(engine_out, hf_out, strict=True)) / len(prompts)
    figures = {
        "prompts": args.prompts,
        "output_tokens": args.output_tokens,
        "prompt_tokens": sum(map(len, prompts)),
        "engine_tok_s": tokens / engine_s,
        "transformers_generate_tok_s": tokens / hf_s,
        "speedup": hf_s / engine_s,
    }
    if model_path is not None:  # random weights differ between the two: their tokens do too
        figures["greedy_outputs_identical_share"] = same
    if args.generate_batch and hasattr(hf, "generate_batch"):
        batch_s, batch_out = run_generate_batch(hf, prompts, args.output_tokens, args.device)
        figures["transformers_generate_batch_tok_s"] = tokens / batch_s
        figures["speedup_vs_generate_batch"] = batch_s / engine_s
        if model_path is not None:
            figures["generate_batch_identical_share"] = sum(
                a == b for a, b in zip(engine_out, batch_out, strict=True)
            ) / len(prompts)
    goal = {"speedup": ">= 3 on GPU (docs/benchmarks.md, peer)"}
    out = write_result(
        "peer", args.device, figures, goal, {"model": args.model, "dtype": str(dtype).removeprefix("torch.")}
    )
    for k, v in figures.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
