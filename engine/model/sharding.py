"""Tensor parallelism (Megatron style): which part of each weight a rank holds, and the collectives
that join the parts.

Column-parallel layers (q/k/v, gate/up) hold a slice of their output features; the row-parallel
layer after each (o_proj, down_proj) holds the matching slice of its input features, so the ranks'
partial sums meet in one all-reduce per block. Query heads are split evenly; KV heads too, or, with
fewer KV heads than ranks, each rank holds the one KV head its query heads read. The embedding and
the LM head hold a slice of the vocabulary (the last slice padded): a token's embedding row lives on
one rank, the others add zeros in an all-reduce, and rank 0 gathers the logits' slices to sample. A
mixture-of-experts layer's experts are split whole: every rank routes every token the same way,
runs its own experts, and an all-reduce adds their outputs.

A weight's `Shard` says which part of the whole checkpoint tensor the rank holds, so the loader
reads only that part and dummy weights are drawn whole and then sliced: identical on one device or
many.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from .config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """Rows start..start + length of the whole tensor along `dim` (of size `whole`), held in the
    first `length` rows of the rank's tensor (which may be longer: the vocabulary's padding)."""

    dim: int
    start: int
    length: int
    whole: int

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The index of this part in a whole tensor of `ndim` dimensions."""
        index = [slice(None)] * ndim
        index[self.dim] = slice(self.start, self.start + self.length)
        return tuple(index)

    def times(self, factor: int) -> Shard:
        """The same part with `factor` rows per row (heads -> their features)."""
        return Shard(self.dim, self.start * factor, self.length * factor, self.whole * factor)

    def along(self, dim: int) -> Shard:
        return replace(self, dim=dim)


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `size` ranks (the default process group); size 1: one device."""

    rank: int = 0
    size: int = 1

    def split(self, total: int) -> Shard:
        """This rank's even share of `total` rows (a multiple of size: see check_fits)."""
        n = total // self.size
        return Shard(0, self.rank * n, n, total)

    def kv_heads(self, num_kv_heads: int) -> Shard:
        """The KV heads this rank holds: an even share, or the one its query heads read."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return Shard(0, self.rank * num_kv_heads // self.size, 1, num_kv_heads)

    def vocab(self, vocab_size: int) -> tuple[Shard, int]:
        """This rank's vocabulary rows and the padded rows per rank (ceil(vocab / size))."""
        rows = -(-vocab_size // self.size)
        start = min(self.rank * rows, vocab_size)
        return Shard(0, start, min(rows, vocab_size - start), vocab_size), rows

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum of x over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_first(self, x: Tensor) -> Tensor | None:
        """On rank 0, the ranks' x side by side along the last dim; None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_first(self, x: Tensor) -> Tensor:
        """Rank 0's x on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x


def check_fits(cfg: ModelConfig, size: int) -> None:
    """Raise a ValueError naming every config field that cannot be split `size` ways."""
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads {cfg.num_heads} is not divisible by {size}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads {kv} neither divides nor is divisible by {size}")
    dense = cfg.moe is None or bool(cfg.moe.dense_layers)
    if dense and cfg.intermediate_size % size:
        problems.append(f"intermediate_size {cfg.intermediate_size} is not divisible by {size}")
    if cfg.moe is not None and cfg.moe.num_experts % size:
        problems.append(f"num_experts {cfg.moe.num_experts} (the experts are split whole) is not divisible by {size}")
    if problems:
        fields = "; ".join(problems)
        raise ValueError(f"--tensor-parallel-size {size} does not fit this {cfg.architecture} model: {fields}")


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of the checkpoint and where this rank keeps it: `view`, its part of the model's
    storage (None: another rank holds the tensor), holding `shard` of the whole (None: all of it)."""

    name: str
    shape: tuple[int, ...]  # of the whole tensor
    view: Tensor | None
    shard: Shard | None = None

    def part(self, whole: Tensor) -> Tensor:
        """This rank's part of the whole tensor."""
        return whole if self.shard is None else whole[self.shard.index(whole.ndim)]

    def load(self, part: Tensor) -> None:
        """Copy this rank's part (see `part`) into the view; rows past it (padding) become zeros."""
        if self.view is None:
            return
        if self.shard is None:
            self.view.copy_(part)
            return
        dim, n = self.shard.dim, self.shard.length
        self.view.narrow(dim, 0, n).copy_(part)
        self.view.narrow(dim, n, self.view.shape[dim] - n).zero_()


def held(name: str, view: Tensor, shard: Shard | None = None) -> CheckpointTensor:
    """A tensor this rank holds, whole or (`shard`) in part."""
    if shard is None or (shard.length == shard.whole == view.shape[shard.dim]):
        return CheckpointTensor(name, tuple(view.shape), view)
    shape = list(view.shape)
    shape[shard.dim] = shard.whole
    return CheckpointTensor(name, tuple(shape), view, shard)
