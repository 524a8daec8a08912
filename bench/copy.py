"""copy: the DuplexKV copy ladder (the paper's Table 1), GB/s each way, against one large copy.

Rungs, moving the same blocks (random, non-consecutive block ids) between the GPU cache and a
pinned CPU cache:
  per-layer per-block   a vLLM-like layer-first layout: one copy per layer, K/V and block
  block-first per-block our layout: one copy per block (all layers at once)
  batched               block-first, coalesced runs (consecutive ids merged into one copy)
  duplex                batched GPU->CPU and CPU->GPU at once on two streams
  ideal                 one large pinned copy of the same bytes in each direction

    python -m bench.copy [--model qwen2.5-32b] [--gib 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import random

import torch

from superinfer.bench.record import write_result
from superinfer.engine.model.loader import preset_config
from superinfer.engine.worker.duplex import copy_blocks

BLOCK_TOKENS = 16


def timed(device: torch.device, fn, repeats: int = 3) -> float:
    """Median seconds of fn() (CUDA events on a GPU)."""
    results = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            results.append(start.elapsed_time(end) / 1000)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            results.append(time.perf_counter() - t0)
    return sorted(results)[len(results) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-32b")
    parser.add_argument("--gib", type=float, default=8.0, help="bytes moved each way")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = preset_config(args.model)
    inner = (cfg.num_layers, 2, BLOCK_TOKENS, cfg.num_kv_heads, cfg.head_dim)
    block_bytes = 2 * torch.Size(inner).numel()  # bf16
    n = max(2, int(args.gib * 2**30) // block_bytes)
    pool = 2 * n  # each tier twice the moved set, ids scattered
    pin = device.type == "cuda"
    gpu = torch.zeros((pool, *inner), dtype=torch.bfloat16, device=device)
    cpu = torch.zeros((pool, *inner), dtype=torch.bfloat16, pin_memory=pin)
    rng = random.Random(0)
    out_pairs = list(zip(rng.sample(range(pool), n), rng.sample(range(pool), n), strict=True))
    in_pairs = list(zip(rng.sample(range(pool), n), rng.sample(range(pool), n), strict=True))
    moved = n * block_bytes

    # Layer-first views of the same memory stand in for a vLLM-like layout: [layer][k|v] -> [blocks, ...].
    def per_layer_per_block() -> None:
        for layer in range(cfg.num_layers):
            for kv in range(2):
                for g, c in out_pairs:
                    cpu[c, layer, kv].copy_(gpu[g, layer, kv], non_blocking=True)

    def per_block() -> None:
        for g, c in out_pairs:
            cpu[c].copy_(gpu[g], non_blocking=True)

    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if pin else (None, None)

    def duplex() -> None:
        if not pin:
            copy_blocks(gpu, cpu, out_pairs)
            copy_blocks(cpu, gpu, in_pairs)
            return
        with torch.cuda.stream(streams[0]):
            copy_blocks(gpu, cpu, out_pairs)
        with torch.cuda.stream(streams[1]):
            copy_blocks(cpu, gpu, in_pairs)
        torch.cuda.current_stream(device).wait_stream(streams[0])
        torch.cuda.current_stream(device).wait_stream(streams[1])

    big_gpu = gpu[:n].view(-1)
    big_cpu = cpu[:n].view(-1)
    gbps = lambda seconds: moved / seconds / 1e9
    f: dict[str, float] = {}
    f["ideal_gpu_to_cpu_gb_s"] = gbps(timed(device, lambda: big_cpu.copy_(big_gpu, non_blocking=True)))
    f["ideal_cpu_to_gpu_gb_s"] = gbps(timed(device, lambda: big_gpu.copy_(big_cpu, non_blocking=True)))
    f["per_layer_per_block_gpu_to_cpu_gb_s"] = gbps(timed(device, per_layer_per_block, repeats=1))
    f["block_first_per_block_gpu_to_cpu_gb_s"] = gbps(timed(device, per_block))
    f["batched_gpu_to_cpu_gb_s"] = gbps(timed(device, lambda: copy_blocks(gpu, cpu, out_pairs)))
    f["batched_cpu_to_gpu_gb_s"] = gbps(timed(device, lambda: copy_blocks(cpu, gpu, in_pairs)))
    duplex_s = timed(device, duplex)
    f["duplex_each_way_gb_s"] = gbps(duplex_s)
    f["duplex_aggregate_over_one_way"] = 2 * gbps(duplex_s) / f["batched_gpu_to_cpu_gb_s"]
    f["batched_share_of_ideal"] = f["batched_gpu_to_cpu_gb_s"] / f["ideal_gpu_to_cpu_gb_s"]
    slowest_ideal = min(f["ideal_gpu_to_cpu_gb_s"], f["ideal_cpu_to_gpu_gb_s"])
    f["duplex_time_over_ideal"] = duplex_s / (moved / (1e9 * slowest_ideal))
    for k, v in f.items():
        print(f"{k:40s} {v:8.2f}")
    goal = {
        "batched_share_of_ideal": ">= 0.9 for 2 MiB blocks",
        "duplex_aggregate_over_one_way": ">= 1.7 on PCIe (vLLM ~1.67)",
    }
    extra = {"model": args.model, "block_bytes": block_bytes, "blocks_each_way": n}
    print(f"wrote {write_result('copy', args.device, f, goal, extra)}")


if __name__ == "__main__":
    main()
