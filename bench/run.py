"""Run the whole benchmark set for this machine; each writes its JSON to bench/results/.

python -m bench.run            # CPU: peer, sched, host_time, sampler, policy_cost, slo, ragged, cpu_linear
                               # (tiny model), moe (small MoE models), tp (tiny, -tp 2)
python -m bench.run --gpu      # GPU: GPU tests, step, attn, copy, peer, sampler, slo (llama-3-8b dummy weights)
"""

from __future__ import annotations

import argparse
import subprocess
import sys

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
GPU = [
    ["pytest", "-q", "-m", "gpu", "tests"],
    ["bench.step", "--device", "cuda"],
    ["bench.attn"],
    ["bench.copy", "--device", "cuda"],
    ["bench.peer", "--model", "llama-3-8b", "--device", "cuda", "--dtype", "bfloat16", "--prompts", "128"],
    ["bench.sampler", "--device", "cuda", "--shapes", "256x128256,1024x128256"],
    ["bench.slo", "--device", "cuda", "--duration", "30", "--gpu-memory-utilization", "0.3"],
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    failed = []
    for module, *rest in GPU if args.gpu else CPU:
        print(f"== {module} {' '.join(rest)}", flush=True)
        if subprocess.run([sys.executable, "-m", module, *rest]).returncode:
            failed.append(module)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
