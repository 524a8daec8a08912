"""Run the whole benchmark set for this machine; each writes its JSON to bench/results/.

python -m bench.run            # CPU: peer, sched, host_time, sampler, policy_cost, slo, ragged, cpu_linear
                               # (tiny model), moe (small MoE models), tp (tiny, -tp 2)
python -m bench.run --gpu      # GPU: step, slo (llama-3-8b dummy weights), attn, GPU tests, copy, peer,
                               # sampler, then the kernels' launch sweep
                               # [--stage-timeout-s 120] for a short lease
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

PARALLEL = ["-n", "8"] if importlib.util.find_spec("xdist") else []

CPU = [
    ["bench.peer"],
    ["bench.sched"],
    ["bench.host_time"],
    ["bench.sampler"],
    ["bench.policy_cost"],
    ["bench.slo"],
    ["bench.ragged"],
    ["bench.cpu_linear"],
    ["bench.moe"],
    ["bench.tp"],
]
GPU_TESTS = ("gpu", "sampler", "model", "moe", "fused_kernels")
# Most telling first: a short lease may end before the last. The tests are the files that collect
# without the operator's packages (a GPU machine may have only the engine's).
GPU = [
    ["bench.step", "--device", "cuda", "--batches", "1,16,64,128,256", "--piecewise-graphs"],
    # the paper's top rate, where fcfs's queue blocks, both policies with and without the piecewise
    # graphs, then rotary with a residency floor (its churn on the last H100 run): each point builds
    # an engine (~1 minute on an H100 with the drain; a CPU tier sized from that host's memory would
    # take minutes to pin)
    [
        "bench.slo",
        "--device=cuda",
        "--policies=rotary,fcfs,rotary[piecewise-graphs],fcfs[piecewise-graphs],rotary[min-residency=1s]",
        "--rates=60",
        "--duration=15",
        "--gpu-memory-utilization=0.3",
        "--cpu-kv-gib=16",
        "--step-log=bench/results/steps",
    ],
    ["bench.attn"],
    # compiled on CUDA, gpu-marked or not; compiling dominates: in parallel where pytest-xdist is there
    ["pytest", "-q", *PARALLEL, *(f"tests/test_{name}.py" for name in ("kernels", "attention", "fused_kernels"))],
    # the engine on CUDA: 31 tests, about 2 minutes in 4 processes on an H100
    ["pytest", "-q", *PARALLEL, "-m", "gpu", *(f"tests/test_{name}.py" for name in GPU_TESTS)],
    ["bench.kv_copy", "--device", "cuda"],
    ["bench.peer", "--model", "llama-3-8b", "--device", "cuda", "--dtype", "bfloat16", "--prompts", "128"],
    ["bench.sampler", "--device", "cuda", "--shapes", "256x128256,1024x128256"],
    ["bench.attn", "--batches", "64", "--contexts", "2048", "--prefill", "4096", "--sweep"],
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--stage-timeout-s", type=float, default=None, help="stop a stage that runs longer")
    args = parser.parse_args()
    failed = []
    for module, *rest in GPU if args.gpu else CPU:
        print(f"== {module} {' '.join(rest)}", flush=True)
        try:
            code = subprocess.run([sys.executable, "-m", module, *rest], timeout=args.stage_timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code:
            failed.append(f"{module} ({code})")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
