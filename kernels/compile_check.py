"""Compile the kernels as the engine launches them, for a GPU, on a machine without one.

The launch functions run on small CPU tensors with every kernel swapped for a recorder; each
recorded launch (its arguments, constexprs and warps) is then compiled for the target through
Triton's ahead-of-time path, down to a cubin. That catches what the interpreter cannot: types,
layouts, shared memory; with the cuobjdump Triton ships, also each kernel's registers and stack
(spills). Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128).

    python -m superinfer.kernels.compile_check [--arch 90] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("compile_check compiles for a GPU: unset TRITON_INTERPRET")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from superinfer.kernels import block_copy, kv_write, paged_decode, paged_prefill, rms_norm, rope, silu_mul

KERNELS = [
    (paged_decode, "_decode_kernel"),
    (paged_decode, "_reduce_kernel"),
    (paged_prefill, "_prefill_kernel"),
    (kv_write, "_kv_write_kernel"),
    (block_copy, "_block_copy_kernel"),
    (rms_norm, "_rms_norm_kernel"),
    (silu_mul, "_silu_mul_kernel"),
    (rope, "_rope_kernel"),
]
TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.uint8: "u8",
}
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, HIDDEN, INTERMEDIATE = 32, 8, 128, 16, 4096, 14336


@dataclass
class Launch:
    kernel: Any  # a triton JITFunction
    args: tuple
    kwargs: dict[str, Any]


@dataclass
class _Recorder:
    kernel: Any
    launches: list[Launch] = field(default_factory=list)

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, args, kwargs))


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Every kernel launch inside, recorded instead of run."""
    launches: list[Launch] = []
    originals = [(module, name, getattr(module, name)) for module, name in KERNELS]
    try:
        for module, name, kernel in originals:
            setattr(module, name, _Recorder(kernel, launches))
        yield launches
    finally:
        for module, name, kernel in originals:
            setattr(module, name, kernel)


def _type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_launch(launch: Launch, target: GPUTarget) -> Any:
    """The recorded launch compiled for `target` (a CompiledKernel)."""
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages") if k in launch.kwargs}
    constants = {k: v for k, v in launch.kwargs.items() if k not in options}
    names = launch.kernel.arg_names
    values = dict(zip(names, launch.args, strict=False)) | constants
    signature = {n: "constexpr" if n in constants else _type(values[n]) for n in names}
    constexprs = {(i,): constants[n] for i, n in enumerate(names) if n in constants}
    # What the JIT tells the compiler at a real launch: which pointers and ints are multiples of 16
    # (vector loads and the pipeliner depend on it).
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constants and _aligned(values[n])}
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options)


def _aligned(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def resources(compiled: Any) -> str:
    """'REG:n STACK:n ...' of a compiled kernel's cubin, from the cuobjdump shipped with Triton
    ('' without it)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = [line.strip() for line in out.splitlines() if "REG:" in line]
    return " ".join(usage[0].split()[:2]) if usage else ""


def engine_launches(dtype: torch.dtype) -> list[Launch]:
    """One step's launches at Llama-3-8B shapes: KV write, decodes (one split and several),
    extends, block gather and scatter, the norms (hidden and per head), the MLP activation and RoPE."""
    keys = 2 * paged_decode.BLOCK_N  # the longer sequence's context: one split, or two
    per_seq = keys // BLOCK_SIZE
    cache = torch.zeros(2 * per_seq, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
    q = torch.zeros(6, HEADS, HEAD_DIM, dtype=dtype)
    k = torch.zeros(6, KV_HEADS, HEAD_DIM, dtype=dtype)
    cpu = torch.device("cpu")
    ids = [list(range(per_seq)), list(range(per_seq, 2 * per_seq))]
    with recording() as launches:
        kv_write.kv_write(cache, 1, k, k, torch.zeros(6, dtype=torch.int32))
        for split_keys in (keys, paged_decode.BLOCK_N):
            decodes = paged_decode.DecodeBatch.build([0, 1], [60, keys], ids, BLOCK_SIZE, cpu, KV_HEADS, split_keys)
            paged_decode.paged_decode(q, cache, 1, decodes, 0.1)
        group = HEADS // KV_HEADS
        extends = paged_prefill.ExtendBatch.build([0, 4], [4, 2], [60, 2], ids, BLOCK_SIZE, group, cpu)
        paged_prefill.paged_prefill(q, cache, 1, extends, 0.1)
        staging = torch.zeros(2, *cache.shape[1:], dtype=dtype)
        block_ids = torch.tensor([3, 5], dtype=torch.int32)
        block_copy.gather_blocks(cache, block_ids, staging)
        block_copy.scatter_blocks(staging, cache, block_ids)
        hidden, weight = torch.zeros(6, HIDDEN, dtype=dtype), torch.ones(HIDDEN, dtype=dtype)
        rms_norm.rms_norm(hidden, weight, 1e-5)
        rms_norm.add_rms_norm(hidden, hidden, weight, 1e-5)
        rms_norm.rms_norm(q, torch.ones(HEAD_DIM, dtype=dtype), 1e-6)
        silu_mul.silu_mul(torch.zeros(6, 2 * INTERMEDIATE, dtype=dtype))
        qk = torch.zeros(6, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=dtype)[:, : HEADS + KV_HEADS]  # inside qkv
        rope.rope(qk, torch.zeros(6, 1, HEAD_DIM, dtype=dtype), torch.zeros(6, 1, HEAD_DIM, dtype=dtype))
    return launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    for launch in engine_launches(getattr(torch, args.dtype)):
        t0 = time.perf_counter()
        compiled = compile_launch(launch, target)
        seconds = time.perf_counter() - t0
        print(
            f"{launch.kernel.__name__:20s} sm_{args.arch} {args.dtype}: {launch.kwargs.get('num_warps', 4)} warps, "
            f"shared memory {compiled.metadata.shared} B, {resources(compiled)} (compiled in {seconds:.1f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
