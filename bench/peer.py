"""peer: engine tokens/s against transformers `generate` on the same model, prompts and device.

Both run in one process, one after the other, on the same token ids (greedy, fixed output length).

    python -m bench.peer [--model tiny] [--device cpu] [--prompts 32] [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from superinfer.bench.record import write_result
from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore


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
        "--no-generate-batch",
        dest="generate_batch",
        action="store_false",
        help="skip transformers' generate_batch (it sizes its cache to the free memory)",
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    core = EngineCore(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    prompts = make_prompts(args.prompts, core.model_config.vocab_size)
    run_engine(core, prompts[:2], 4)  # warm up
    engine_s, engine_out = run_engine(core, prompts, args.output_tokens)

    if core.model_path is None:
        raise SystemExit(f"{args.model!r} has no weights folder for transformers to load; use tiny or an HF folder")
    hf = AutoModelForCausalLM.from_pretrained(core.model_path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
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
        "greedy_outputs_identical_share": same,
    }
    if args.generate_batch and hasattr(hf, "generate_batch"):
        batch_s, batch_out = run_generate_batch(hf, prompts, args.output_tokens, args.device)
        figures["transformers_generate_batch_tok_s"] = tokens / batch_s
        figures["speedup_vs_generate_batch"] = batch_s / engine_s
        figures["generate_batch_identical_share"] = sum(
            a == b for a, b in zip(engine_out, batch_out, strict=True)
        ) / len(prompts)
    goal = {"speedup": ">= 3 on GPU (docs/benchmarks.md, peer)"}
    out = write_result("peer", args.device, figures, goal, {"model": args.model, "dtype": args.dtype})
    for k, v in figures.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
