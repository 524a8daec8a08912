"""step: engine decode and prefill throughput against the hardware limits measured in the same run.

Decode: B requests at a given context length; the time per step against the roofline
(weight bytes + KV bytes read) / measured HBM bandwidth: with async scheduling and CUDA graphs
(the defaults on a GPU), without the graphs (`_eager`), and without async scheduling (`_sync`).
Mixed: the same decodes with a new prompt of --mixed-chunk tokens arriving before each step, the
shape of a step under a steady stream of arrivals (the decode graphs cover decode-only steps: a
mixed step runs op by op, or with --piecewise-graphs through those graphs and again op by op,
`_op_by_op`), against the decode step.
Prefill: tokens per second and the share of bf16 peak (2 x active parameters x tokens FLOPs).

    python -m bench.step --device cuda --model llama-3-8b [--batches 1,16,64,256] [--context 2048]
    python -m bench.step --device cpu --model tiny --batches 1,8 --context 128 --prefill-tokens 1024   # smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.workload.record import write_result

BF16_PEAK_FLOPS = 989e12  # H100/H200/GH200 dense bf16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hbm_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(times)


def decode(
    core: EngineCore, batch: int, context: int, steps: int, async_scheduling: bool, chunk: int = 0
) -> tuple[float, float]:
    """(seconds per step, mean context) of `steps` decode steps with all `batch` requests decoding
    (wall time over the steps: with async scheduling the host's work hides behind the GPU's). The
    prompts of `context` tokens are prefilled first, untimed (those done first decode meanwhile:
    contexts differ by a few tokens), and the requests are aborted after the timed steps. With
    `chunk`, a new `chunk`-token prompt arrives before each timed step, so each step is mixed: the
    decodes and a prefill (the shape of a step under a steady stream of arrivals)."""
    rng = random.Random(batch)
    vocab = core.model_config.vocab_size
    ids = [f"d{batch}-{i}" for i in range(batch)]
    sampling = SamplingParams(max_tokens=core.max_model_len - context, temperature=0, ignore_eos=True)
    for rid in ids:
        core.add_request(rid, [rng.randrange(vocab) for _ in range(context)], sampling)
    core.async_scheduling = False
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()  # prefill, not timed
    core.async_scheduling = async_scheduling
    mean_context = statistics.mean(r.num_tokens for r in core.scheduler.requests.values()) + steps / 2
    sync(core.device)
    arrivals = SamplingParams(max_tokens=1, temperature=0)
    t0 = time.perf_counter()
    for i in range(steps):
        if chunk:
            core.add_request(f"m{batch}-{i}", [rng.randrange(vocab) for _ in range(chunk)], arrivals)
        core.step()
    sync(core.device)
    seconds = (time.perf_counter() - t0) / steps
    for rid in ids:
        core.abort(rid)
    while core.has_work:
        core.step()
    return seconds, mean_context


def prefill(core: EngineCore, tokens: int, seed: int = 0) -> float:
    """Seconds to prefill a prompt of `tokens` tokens (a new `seed` for each call on the same
    engine: a prompt seen before is a prefix-cache hit)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(core.model_config.vocab_size) for _ in range(tokens)]
    core.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0))
    sync(core.device)
    t0 = time.perf_counter()
    while core.has_work:
        core.step()
    sync(core.device)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--mixed-chunk", type=int, default=256, help="prompt tokens beside each mixed step's decodes")
    parser.add_argument(
        "--piecewise-graphs",
        action="store_true",
        help="mixed steps through the piecewise CUDA graphs, and again without them (`_op_by_op`)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    core = EngineCore(
        EngineConfig(
            model=args.model,
            device=args.device,
            dummy_weights=args.model != "tiny",
            max_num_seqs=512,
            max_num_batched_tokens=max(args.prefill_tokens, 8192),
            max_model_len=max(2 * args.context, args.context + 512, args.prefill_tokens) + 8,
            gpu_memory_utilization=0.92,
            enforce_eager=args.enforce_eager,
            piecewise_graphs=args.piecewise_graphs,
        )
    )
    mc = core.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in core.runner.model.parameters())
    kv_per_token = mc.kv_bytes_per_token(core.dtype.itemsize)
    bw = hbm_bandwidth(device)
    figures: dict[str, float] = {"hbm_gb_s_measured": bw / 1e9, "weight_gb": weight_bytes / 1e9}
    graphs, piecewise = core.runner.graphs, core.runner.piecewise
    decode(core, 2, 64, 2, True)  # warm-up: every kernel compiled before anything is timed
    for b in (int(x) for x in args.batches.split(",")):
        prefill_steps = -(-b * args.context // core.scheduler.config.max_num_batched_tokens)
        arrivals = 2 * core.kv.blocks_for(args.mixed_chunk) if args.mixed_chunk else 0  # done the step after
        if core.kv.blocks_for(args.context + prefill_steps + args.steps + 4) * b + arrivals > core.kv.num_blocks:
            print(f"B={b}: does not fit in {core.kv.num_blocks} KV blocks, skipped")
            continue
        # (async scheduling, CUDA graphs): the default, without graphs, and synchronous
        for mode, use_graphs, suffix in ((True, True, ""), (True, False, "_eager"), (False, True, "_sync")):
            if not use_graphs and graphs is None:
                continue
            core.runner.graphs = graphs if use_graphs else None
            seconds, mean_context = decode(core, b, args.context, args.steps, mode)
            bound = (weight_bytes + b * mean_context * kv_per_token) / bw
            figures[f"decode_b{b}_ms{suffix}"] = 1000 * seconds
            figures[f"decode_b{b}_tok_s{suffix}"] = b / seconds
            figures[f"decode_b{b}_share_of_roofline{suffix}"] = bound / seconds
            label = ("async" if mode else "sync") + ("" if use_graphs and graphs is not None else " eager")
            print(
                f"decode B={b:4d} {label:11s}: {1000 * seconds:8.2f} ms/step  "
                f"{b / seconds:9.0f} tok/s  roofline share {bound / seconds:.2f}",
                flush=True,
            )
        core.runner.graphs = graphs
        modes = [("", piecewise), ("_op_by_op", None)] if piecewise is not None else [("", None)]
        for suffix, pieces in modes if args.mixed_chunk else []:
            core.runner.piecewise = pieces
            seconds, _ = decode(core, b, args.context, args.steps, True, args.mixed_chunk)
            figures[f"mixed_b{b}_ms{suffix}"] = 1000 * seconds
            figures[f"mixed_b{b}_over_decode{suffix}"] = 1000 * seconds / figures[f"decode_b{b}_ms"]
            print(
                f"mixed  B={b:4d} + {args.mixed_chunk}-token prompt{' (piecewise graphs)' if pieces else ''}: "
                f"{1000 * seconds:8.2f} ms/step ({figures[f'mixed_b{b}_over_decode{suffix}']:.2f}x the decode step)",
                flush=True,
            )
        core.runner.piecewise = piecewise
    seconds = prefill(core, args.prefill_tokens)
    flops = 2 * mc.num_active_params() * args.prefill_tokens  # MoE: the top-k experts
    figures["prefill_tok_s"] = args.prefill_tokens / seconds
    figures["prefill_share_of_bf16_peak"] = flops / seconds / BF16_PEAK_FLOPS
    print(
        f"prefill {args.prefill_tokens} tokens: {figures['prefill_tok_s']:.0f} tok/s, "
        f"{figures['prefill_share_of_bf16_peak']:.2%} of bf16 peak"
    )
    goal = {"decode_b64_share_of_roofline": ">= 0.8", "prefill_share_of_bf16_peak": ">= 0.55"}
    extra = {
        "model": args.model,
        "context": args.context,
        "dtype": str(core.dtype).split(".")[-1],
        "attention": core.runner.attention_backend,
        "cuda_graphs": graphs is not None,
        "piecewise_graphs": piecewise is not None,
        "mixed_chunk": args.mixed_chunk,
    }
    print(f"wrote {write_result('step', args.device, figures, goal, extra)}")


if __name__ == "__main__":
    main()
