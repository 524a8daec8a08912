"""attn: paged attention on Llama-3-8B shapes, the Triton kernels against the torch backend and SDPA.

B sequences of C keys each in shuffled blocks, one query token each (32 query heads, 8 KV heads,
head_dim 128, bf16). Per (B, C): the time of one layer's attention call of each backend (its KV
write included), the Triton decode kernel alone, and the bandwidth that kernel achieves: the K and
V bytes it must read, B x C x 2 x 8 x 128 x 2, over its time, also as a share of the HBM bandwidth
measured in the same run (a large device-to-device copy). Also the host time to build one step's
metadata for each backend. Prefill: one sequence of T new tokens (no earlier context) in
shuffled blocks, the Triton prefill kernel against torch's SDPA (flash) on contiguous K and V
already expanded to every query head, both causal; TFLOP/s count 2 x T^2 x heads x head_dim.
`--sweep` times each kernel's launch configurations (keys per tile, warps, pipeline stages) at
B=64 x 2k (decode) and T=4096 (prefill) and reports the fastest, so the defaults are measured.
GPU only: there is nothing to measure on a CPU.

    python -m bench.attn [--batches 1,8,32,64,128,256] [--contexts 1024,2048,4096,8192] [--block-size 16]
                         [--prefill 1024,4096,8192] [--sweep]

The cache holds 2 layers (the benchmark attends layer 1): a block's K of one layer is the same
contiguous run as in a 32-layer cache (block_size x 8 x 128 elements), at a shorter block stride.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F

from superinfer.engine.worker.attention import SeqSpan, torch_attention
from superinfer.workload.record import write_result

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 2
DTYPE = torch.bfloat16


def cuda_time_us(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median microseconds of fn() on the current CUDA stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def host_time_us(fn: Callable[[], object], iters: int = 5) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def decode_step(batch: int, context: int, block_size: int, device: torch.device) -> tuple[list[SeqSpan], torch.Tensor]:
    """`batch` decodes of `context` keys (the last one new) in shuffled blocks of a fresh cache."""
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    cache = torch.empty(num_blocks, LAYERS, 2, block_size, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    cache.normal_()
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    spans = [SeqSpan(i, 1, context, ids[i * per_seq : (i + 1) * per_seq]) for i in range(batch)]
    return spans, cache


def fits(batch: int, context: int, block_size: int, device: torch.device) -> bool:
    """Room for the cache and the torch backend's gathered K and V (a group at a time, ~2x a step's KV)."""
    kv_bytes = batch * -(-context // block_size) * block_size * 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    return LAYERS * kv_bytes + 2 * kv_bytes + (2 << 30) < free


def measure(batch: int, context: int, block_size: int, device: torch.device, hbm: float) -> dict[str, float]:
    from superinfer.engine.worker.triton_attention import TritonPagedAttention
    from superinfer.kernels.paged_decode import paged_decode

    spans, cache = decode_step(batch, context, block_size, device)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k, v = (torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device) for _ in range(2))
    scale = HEAD_DIM**-0.5
    ours, theirs = TritonPagedAttention.for_step(spans, cache, scale), torch_attention(spans, cache, scale)
    assert ours.decodes is not None
    out = torch.empty_like(q)
    kernel_us = cuda_time_us(lambda: paged_decode(q, cache, 1, ours.decodes, scale, out=out))
    read = batch * context * 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    key = f"b{batch}_c{context}"
    figures = {
        f"triton_decode_{key}_us": kernel_us,
        f"triton_decode_{key}_gb_s": read / kernel_us / 1e3,
        f"triton_decode_{key}_share_of_hbm": read / (kernel_us * 1e-6) / hbm,
        f"triton_decode_{key}_splits": -(-ours.decodes.max_context // ours.decodes.split_keys),
        f"triton_layer_{key}_us": cuda_time_us(lambda: ours(1, q, k, v)),
        f"torch_layer_{key}_us": cuda_time_us(lambda: theirs(1, q, k, v)),
        f"triton_plan_{key}_us": host_time_us(lambda: TritonPagedAttention.for_step(spans, cache, scale)),
        f"torch_plan_{key}_us": host_time_us(lambda: torch_attention(spans, cache, scale)),
    }
    # The same attention, or the times mean nothing.
    torch.testing.assert_close(ours(1, q, k, v), theirs(1, q, k, v), atol=2e-2, rtol=2e-2)
    return figures


def prefill_step(tokens: int, block_size: int, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """A cache holding one sequence's `tokens` keys in shuffled blocks, and those block ids."""
    spans, cache = decode_step(1, tokens, block_size, device)
    return spans[0].block_ids, cache


def measure_prefill(tokens: int, block_size: int, device: torch.device) -> dict[str, float]:
    from superinfer.kernels.paged_prefill import ExtendBatch, paged_prefill

    block_ids, cache = prefill_step(tokens, block_size, device)
    group = HEADS // KV_HEADS
    batch = ExtendBatch.build([0], [tokens], [tokens], [block_ids], block_size, group, device)
    q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    ids = torch.tensor(block_ids, device=device)
    k, v = (cache[ids, 1, i].reshape(-1, KV_HEADS, HEAD_DIM)[:tokens] for i in (0, 1))
    # SDPA's best case: [1, H, T, D] contiguous, K and V already repeated to every query head.
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    k4, v4 = (t.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous() for t in (k, v))
    ours_us = cuda_time_us(lambda: paged_prefill(q, cache, 1, batch, scale, out=out))
    sdpa_us = cuda_time_us(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale))
    sdpa = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)[0].transpose(0, 1)
    torch.testing.assert_close(out, sdpa, atol=2e-2, rtol=2e-2)
    flops = 2 * tokens * tokens * HEADS * HEAD_DIM
    return {
        f"triton_prefill_t{tokens}_us": ours_us,
        f"sdpa_prefill_t{tokens}_us": sdpa_us,
        f"triton_prefill_t{tokens}_tflops": flops / ours_us / 1e6,
        f"sdpa_prefill_t{tokens}_tflops": flops / sdpa_us / 1e6,
        f"triton_prefill_t{tokens}_speed_vs_sdpa": sdpa_us / ours_us,
    }


@contextlib.contextmanager
def launch_config(module: ModuleType, **values: int) -> Iterator[None]:
    """The kernel module's launch constants set to `values` for the block."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


Launch = Callable[[], torch.Tensor]


def time_configs(
    kind: str,
    module: ModuleType,
    grid: dict[str, Sequence[int]],
    prepare: Callable[[], Launch],
    rate: Callable[[float], str],
    rounds: int = 7,
) -> dict[str, float]:
    """The launch `prepare()` builds (host metadata outside the timing) timed under each
    combination of `module`'s launch constants in `grid`; one that fails to compile (shared
    memory, registers) or differs from the default's output is reported, not kept. The kept ones
    are timed in `rounds` rounds, each in a new random order, and each reports its median over the
    rounds: one configuration timed twice a few seconds apart differed by 15% on an H100, more than
    the best few differ, so back-to-back timing would pick noise."""
    expected = prepare()()
    configs: dict[str, dict[str, int]] = {}
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid, values, strict=True))
        name = f"sweep_{kind}_" + "_".join(f"{k.lower()}{v}" for k, v in config.items())
        try:
            with launch_config(module, **config):
                torch.testing.assert_close(prepare()(), expected, atol=2e-2, rtol=2e-2)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        configs[name] = config
    times: dict[str, list[float]] = {name: [] for name in configs}
    order = list(configs)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            with launch_config(module, **configs[name]):
                times[name].append(cuda_time_us(prepare(), warmup=2, iters=10))
    figures: dict[str, float] = {}
    for name, t in times.items():
        us = figures[f"{name}_us"] = statistics.median(t)
        print(f"{name}: {us:8.1f} us, {rate(us)} (rounds {min(t):.0f}-{max(t):.0f} us)")
    default = f"sweep_{kind}_" + "_".join(f"{k.lower()}{getattr(module, k)}" for k in grid) + "_us"
    best = min(figures, key=figures.__getitem__, default=None)
    if best is not None:
        print(f"fastest {kind}: {best} {figures[best]:.1f} us; the default: {figures.get(default, math.nan):.1f} us")
    return figures


def sweep(block_size: int, device: torch.device, hbm: float) -> dict[str, float]:
    """The decode kernel's launch configurations at B=64 x 2k keys, the prefill kernel's at T=4096."""
    from superinfer.kernels import paged_decode as decode_module
    from superinfer.kernels import paged_prefill as prefill_module
    from superinfer.kernels.paged_decode import DecodeBatch
    from superinfer.kernels.paged_prefill import ExtendBatch

    scale = HEAD_DIM**-0.5
    batch, context = 64, 2048
    spans, cache = decode_step(batch, context, block_size, device)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    read = batch * context * 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    args = ([s.row for s in spans], [s.context for s in spans], [s.block_ids for s in spans], block_size, device)
    figures = time_configs(
        "decode",
        decode_module,
        # Around the first H100 sweep's best (128 keys x 8 warps x 3 stages; tiles under 64 keys and
        # 2 warps were all slower): longer tiles and every pipeline depth.
        {"BLOCK_N": (64, 128, 256), "NUM_WARPS": (4, 8), "NUM_STAGES": (1, 2, 3, 4)},
        lambda: partial(decode_module.paged_decode, q, cache, 1, DecodeBatch.build(*args, KV_HEADS), scale),
        lambda us: f"{read / (us * 1e-6) / hbm:.0%} of HBM",
    )
    tokens = 4096
    block_ids, cache = prefill_step(tokens, block_size, device)
    q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    group = HEADS // KV_HEADS
    build = lambda: ExtendBatch.build([0], [tokens], [tokens], [block_ids], block_size, group, device)
    flops = 2 * tokens * tokens * HEADS * HEAD_DIM
    figures |= time_configs(
        "prefill",
        prefill_module,
        {"ROWS": (64, 128), "BLOCK_N": (32, 64, 128), "NUM_WARPS": (4, 8), "NUM_STAGES": (1, 2, 3)},
        lambda: partial(prefill_module.paged_prefill, q, cache, 1, build(), scale),
        lambda us: f"{flops / us / 1e6:.0f} TFLOP/s",
    )
    return figures


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--contexts", default="1024,2048,4096,8192")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill", default="1024,4096,8192", help="prefill lengths (tokens)")
    parser.add_argument("--sweep", action="store_true", help="time the kernels' launch configurations")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("bench.attn measures GPU kernels: it needs a CUDA device (--device cuda)")
    try:
        import triton
    except ImportError:
        raise SystemExit("bench.attn needs triton: pip install 'superinfer[gpu]'") from None
    from superinfer.bench.step import hbm_bandwidth

    hbm = hbm_bandwidth(device)
    figures: dict[str, float] = {"hbm_gb_s_measured": hbm / 1e9}
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            if not fits(batch, context, args.block_size, device):
                print(f"B={batch} C={context}: does not fit, skipped")
                continue
            got = measure(batch, context, args.block_size, device, hbm)
            figures.update(got)
            key = f"b{batch}_c{context}"
            print(
                f"B={batch:4d} C={context:5d}: triton kernel {got[f'triton_decode_{key}_us']:8.1f} us "
                f"({got[f'triton_decode_{key}_share_of_hbm']:.0%} of HBM), layer call triton "
                f"{got[f'triton_layer_{key}_us']:8.1f} us vs torch {got[f'torch_layer_{key}_us']:8.1f} us",
                flush=True,
            )
            torch.cuda.empty_cache()
    for tokens in (int(t) for t in args.prefill.split(",") if t):
        got = measure_prefill(tokens, args.block_size, device)
        figures.update(got)
        print(
            f"prefill T={tokens:5d}: triton {got[f'triton_prefill_t{tokens}_tflops']:5.0f} TFLOP/s, "
            f"SDPA {got[f'sdpa_prefill_t{tokens}_tflops']:5.0f} TFLOP/s "
            f"({got[f'triton_prefill_t{tokens}_speed_vs_sdpa']:.2f}x SDPA's speed)",
            flush=True,
        )
        torch.cuda.empty_cache()
    goal = {
        "triton_decode_b64_c2048_share_of_hbm": ">= 0.85",
        "triton_prefill_t*_speed_vs_sdpa": ">= 0.9",
        "triton_layer_*_us": "< torch_layer_*_us everywhere",
    }
    extra = {
        "shapes": f"Llama-3-8B attention: {HEADS} q heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16",
        "block_size": args.block_size,
        "triton": triton.__version__,
    }
    tag = "sweep" if args.sweep else ""
    path = write_result("attn", args.device, figures, goal, extra, tag=tag)  # kept if a lease ends in the sweep
    if args.sweep:
        figures.update(sweep(args.block_size, device, hbm))
        path = write_result("attn", args.device, figures, goal, extra, tag=tag)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
