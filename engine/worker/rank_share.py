"""One rank's share of the engine: its part of the model, its KV caches and the runner over them.

EngineCore builds rank 0's share in the engine's process; with tensor parallelism the other ranks
build theirs in worker processes (tp_workers.py). Every rank uses the same KV block ids (the
scheduler's, on rank 0), and a block holds the rank's own KV heads, so every rank sizes its pool
from its own free memory and all of them take the smallest count.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.grammar import GrammarCompiler
from superinfer.engine.model.loader import LoadedModel, load_model
from superinfer.engine.model.packed_linear import pack_linears
from superinfer.engine.model.sharding import TensorParallel
from superinfer.engine.worker.attention import allocate_kv_cache
from superinfer.engine.worker.host_memory import require_host_bytes
from superinfer.engine.worker.malloc_heap import retain_freed_heap
from superinfer.engine.worker.runner import ModelRunner, torch_threads
from superinfer.engine.worker.streams import Streams

log = logging.getLogger("superinfer.engine")


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of `rank`: the one named for rank 0, and on CUDA the next GPUs for the others
    ("cuda" and "auto" start at GPU 0, "cuda:N" at GPU N)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available on this machine")
    if rank == 0:
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"--device {name}: rank {rank} needs GPU {index}, but this machine shows {torch.cuda.device_count()}"
        )
    return torch.device("cuda", index)


def rank_threads(requested: int | None, ranks: int) -> int:
    """Torch threads of one rank: as asked, else the default (torch_threads) shared by the ranks."""
    return requested if requested is not None else max(1, torch_threads(None) // ranks)


def load_shard(config: EngineConfig, device: torch.device, tp: TensorParallel) -> LoadedModel:
    torch.set_num_threads(rank_threads(config.torch_threads, tp.size))
    if device.type == "cpu":
        retain_freed_heap()  # steps reuse freed buffers instead of faulting in fresh pages
    torch.manual_seed(config.seed)
    return load_model(
        config.model,
        dtype=None if config.dtype == "auto" else config.dtype,
        device=str(device),
        dummy=config.dummy_weights,
        revision=config.revision,
        download_dir=config.download_dir,
        offline=config.offline,
        tp=tp,
    )


def kv_block_bytes(loaded: LoadedModel, block_size: int) -> int:
    """Bytes of one KV block on this rank: its own KV heads, every layer."""
    attn = loaded.model.model.layers[0].self_attn
    dtype = next(loaded.model.parameters()).dtype
    return 2 * loaded.config.num_layers * attn.num_kv_heads * attn.head_dim * dtype.itemsize * block_size


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel, block_bytes: int, device: torch.device) -> int:
    """How many KV blocks fit: the override, else the free device memory under the budget."""
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    if device.type != "cuda":
        blocks = max(1, int(config.kv_cache_gib_cpu_device * (1 << 30)) // block_bytes)
        require_host_bytes("--kv-cache-gib-cpu-device (the KV cache, on the CPU)", blocks * block_bytes)
        return blocks
    free, total = torch.cuda.mem_get_info(device)
    mc, dtype_bytes = loaded.config, 4
    # Peak activations of the largest step plus the sampler's float32 logits work space.
    activations = config.max_num_batched_tokens * (4 * mc.hidden_size + mc.ffn_activations_per_token()) * dtype_bytes
    logits = config.max_num_seqs * mc.vocab_size * 4 * 4
    budget = total * config.gpu_memory_utilization - (total - free) - activations - logits - (256 << 20)
    if budget < block_bytes:
        raise ValueError(
            f"no memory left for the KV cache on {device}: {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB after loading the model; raise --gpu-memory-utilization "
            "or lower --max-num-batched-tokens / --max-num-seqs"
            + (" (or raise --tensor-parallel-size)" if config.tensor_parallel_size > 1 else "")
        )
    return int(budget // block_bytes)


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, for the startup log."""

    rank: int
    device: str
    weight_bytes: int
    block_bytes: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    packed_weight_bytes: int = 0  # oneDNN's copies of the linear weights (CPU)

    def describe(self) -> str:
        packed = f" (+{_size(self.packed_weight_bytes)} packed for oneDNN)" if self.packed_weight_bytes else ""
        return (
            f"rank {self.rank} on {self.device}: weights {_size(self.weight_bytes)}{packed}, "
            f"KV pool {_size(self.num_gpu_blocks * self.block_bytes)} ({self.num_gpu_blocks} blocks of "
            f"{_size(self.block_bytes)}), CPU tier {_size(self.num_cpu_blocks * self.block_bytes)}"
        )


def _size(nbytes: int) -> str:
    if nbytes == 0:
        return "none"
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.2f} {unit}"
    return f"{nbytes / 1024:.0f} KiB"


def make_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    device: torch.device,
    num_blocks: int,
    num_cpu_blocks: int,
    streams: Streams | None = None,
    grammars: GrammarCompiler | None = None,
) -> tuple[ModelRunner, RankMemory]:
    """Allocate this rank's KV pool and CPU tier and the runner over them."""
    model, bs = loaded.model, config.block_size
    attn = model.model.layers[0].self_attn
    dtype = next(model.parameters()).dtype
    shape = (loaded.config.num_layers, bs, attn.num_kv_heads, attn.head_dim)
    kv_cache = allocate_kv_cache(num_blocks, *shape, dtype, device, populate=True)
    packed_bytes = pack_linears(model) if config.cpu_linear == "onednn" else 0
    cpu_cache = None
    block_bytes = kv_block_bytes(loaded, bs)
    if num_cpu_blocks:
        t0 = time.perf_counter()
        pin = device.type == "cuda"
        cpu_cache = allocate_kv_cache(num_cpu_blocks, *shape, dtype, "cpu", pin_memory=pin)
        log.info(
            "CPU KV tier: %d blocks, %.2f GiB of %s host memory (%.1f s)",
            num_cpu_blocks,
            num_cpu_blocks * block_bytes / 2**30,
            "pinned" if pin else "plain",
            time.perf_counter() - t0,
        )
    runner = ModelRunner(
        model,
        kv_cache,
        bs,
        loaded.config.head_dim**-0.5,
        cpu_cache,
        duplex=config.duplex,
        streams=streams,
        grammars=grammars,
        attention=config.attention_backend,
        copy_method=config.kv_copy_method,
    )
    log.info("rank %d: attention backend %s", model.tp.rank, runner.attention_backend)
    memory = RankMemory(
        model.tp.rank, str(device), weight_bytes(model), block_bytes, num_blocks, num_cpu_blocks, packed_bytes
    )
    return runner, memory
