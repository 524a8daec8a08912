"""copy: the DuplexKV copy ladder (the paper's Table 1), GB/s each way, against one large copy.

Rungs, moving the same blocks (random, non-consecutive block ids) between the GPU cache and a
pinned CPU cache:
  per-layer per-block   a vLLM-like layer-first layout: one copy per layer, K/V and block
  block-first per-block our layout: one copy per block (all layers at once)
  batched               block-first, coalesced runs (consecutive ids merged into one copy)
  duplex                batched GPU->CPU and CPU->GPU at once on two streams
  ideal                 one large pinned copy of the same bytes in each direction
Then DuplexKV's copy methods (engine/worker/copy_methods.py: runs, kernel, batch), each way and
duplex, on the same blocks and on a step's worth (--step-blocks scattered blocks, where per-call
costs show), and what the engine's startup probe picks on these caches.

    python -m bench.kv_copy [--model qwen2.5-32b] [--gib 8] [--step-blocks 64] [--device cuda]
"""

from __future__ import annotations

import argparse
import random

import torch

from superinfer.engine.model.loader import preset_config
from superinfer.engine.worker.copy_methods import COPIERS, METHODS, copy_runs, probe
from superinfer.workload.record import write_result

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


def method_rungs(
    device: torch.device,
    gpu: torch.Tensor,
    cpu: torch.Tensor,
    out_pairs: list[tuple[int, int]],
    in_pairs: list[tuple[int, int]],
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream],
    moved: int,
    step_blocks: int,
    block_bytes: int,
) -> dict[str, float]:
    """Each copy method each way, both ways at once, and step-sized (GB/s; NaN where unavailable)."""
    f: dict[str, float] = {}
    step = step_blocks * block_bytes
    for method in METHODS:
        copier = COPIERS[method]

        def one_way(src, dst, pairs, copier=copier) -> None:
            with torch.cuda.stream(streams[0]):
                copier(src, dst, pairs, 0, 0)
            torch.cuda.current_stream(device).wait_stream(streams[0])

        def both_ways(copier=copier) -> None:
            for stream, (src, dst, pairs) in zip(streams, ((gpu, cpu, out_pairs), (cpu, gpu, in_pairs)), strict=True):
                with torch.cuda.stream(stream):
                    copier(src, dst, pairs, 0, 0)
                torch.cuda.current_stream(device).wait_stream(stream)

        try:
            out_s = timed(device, lambda: one_way(gpu, cpu, out_pairs))
            in_s = timed(device, lambda: one_way(cpu, gpu, in_pairs))
            duplex_s = timed(device, both_ways)
            step_out = timed(device, lambda: one_way(gpu, cpu, out_pairs[:step_blocks]), repeats=11)
            step_in = timed(device, lambda: one_way(cpu, gpu, in_pairs[:step_blocks]), repeats=11)
        except Exception as exc:  # e.g. no cuda.bindings, or a CUDA older than 12.8
            print(f"{method}: unavailable ({type(exc).__name__}: {exc})")
            out_s = in_s = duplex_s = step_out = step_in = float("nan")
        f[f"{method}_gpu_to_cpu_gb_s"] = moved / out_s / 1e9
        f[f"{method}_cpu_to_gpu_gb_s"] = moved / in_s / 1e9
        f[f"{method}_duplex_aggregate_over_one_way"] = 2 * out_s / duplex_s
        f[f"{method}_step_gpu_to_cpu_gb_s"] = step / step_out / 1e9
        f[f"{method}_step_cpu_to_gpu_gb_s"] = step / step_in / 1e9
    return f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-32b")
    parser.add_argument("--gib", type=float, default=8.0, help="bytes moved each way")
    parser.add_argument("--step-blocks", type=int, default=64, help="blocks each way in a step-sized copy")
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
            copy_runs(gpu, cpu, out_pairs)
            copy_runs(cpu, gpu, in_pairs)
            return
        with torch.cuda.stream(streams[0]):
            copy_runs(gpu, cpu, out_pairs)
        with torch.cuda.stream(streams[1]):
            copy_runs(cpu, gpu, in_pairs)
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
    f["batched_gpu_to_cpu_gb_s"] = gbps(timed(device, lambda: copy_runs(gpu, cpu, out_pairs)))
    f["batched_cpu_to_gpu_gb_s"] = gbps(timed(device, lambda: copy_runs(cpu, gpu, in_pairs)))
    duplex_s = timed(device, duplex)
    f["duplex_each_way_gb_s"] = gbps(duplex_s)
    f["duplex_aggregate_over_one_way"] = 2 * gbps(duplex_s) / f["batched_gpu_to_cpu_gb_s"]
    f["batched_share_of_ideal"] = f["batched_gpu_to_cpu_gb_s"] / f["ideal_gpu_to_cpu_gb_s"]
    slowest_ideal = min(f["ideal_gpu_to_cpu_gb_s"], f["ideal_cpu_to_gpu_gb_s"])
    f["duplex_time_over_ideal"] = duplex_s / (moved / (1e9 * slowest_ideal))
    extra: dict[str, object] = {}
    if pin:
        f |= method_rungs(device, gpu, cpu, out_pairs, in_pairs, streams, moved, args.step_blocks, block_bytes)
        chosen, report = probe(gpu, cpu, 0)
        extra["probe"] = {"chosen": chosen, "seconds": report}
    for k, v in f.items():
        print(f"{k:40s} {v:8.2f}")
    goal = {
        "batched_share_of_ideal": ">= 0.9 for 2 MiB blocks",
        "duplex_aggregate_over_one_way": ">= 1.7 on PCIe (vLLM ~1.67)",
    }
    extra |= {"model": args.model, "block_bytes": block_bytes, "blocks_each_way": n, "step_blocks": args.step_blocks}
    print(f"probe picks {extra.get('probe', {}).get('chosen', 'runs (no CUDA)')}")
    print(f"wrote {write_result('copy', args.device, f, goal, extra)}")


if __name__ == "__main__":
    main()
