"""Paged attention over the block-first KV cache: the torch backend (CPU and CUDA).

Cache layout: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]. One block across all
layers is one contiguous region, so moving a block between tiers is one copy.

A step's sequences are ragged: decodes (one query) at contexts of every length, prefill chunks of
every length, some continuing an earlier chunk. `plan_attention` sorts them once per step into
groups whose members need about the same padding, and builds each group's index tensors and mask
up front; each layer then costs one gather of K, one of V and one fused attention (SDPA) per group,
whatever the number of sequences:
  * decodes are grouped by context length, each group padded to its longest context (at most
    `pad_tokens` more than any member's), with a mask for the padding;
  * first chunks of prompts (starting at position 0) are grouped by length and run causal without
    a mask: a padded query row or key never reaches a real one;
  * a chunk that continues a prompt attends to everything before it too: a group of its own, with
    an explicit causal mask.
The Triton kernels (superinfer.kernels, wired in triton_attention.py) run instead on CUDA, and
on the CPU the C kernel (cpu_attention.py) attends the decodes in place; this stays their
reference. `attention_backend.py` picks one for `--attention-backend`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from superinfer.engine.worker.device_tensor import device_tensor, to_device
from superinfer.engine.worker.host_memory import host_tensor

# Padding (in keys, or in queries for first chunks) a sequence may carry to share a group: what a
# group costs in fixed overhead on a CPU is about the time of this many keys per sequence.
PAD_TOKENS = 64
# Gathered K and V of one group: small enough to stay in cache between the gather and the attention
# that reads them (past a few MiB a CPU's time per key more than doubles).
GROUP_BYTES = 4 << 20


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
    populate: bool = False,
) -> torch.Tensor:
    """A zeroed cache. In host memory it takes exactly its size (no power-of-two rounding), and
    with `pin_memory` it is registered for asynchronous CUDA copies (see host_memory).
    `populate`: map its pages now, as a cache the model computes in needs (first writes to fresh
    pages during steps cost up to a few times the step's KV write); a large CPU tier leaves them
    to its copies."""
    shape = (num_blocks, num_layers, 2, block_size, kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        block_bytes = num_layers * 2 * block_size * kv_heads * head_dim * dtype.itemsize
        buffer = host_tensor(num_blocks * block_bytes, pin=pin_memory, align=block_bytes, populate=populate)
        return buffer.view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


class SeqSpan(NamedTuple):
    """One sequence's share of the step: `num_tokens` query rows from `row`, `context` keys in all.
    (A NamedTuple: one per running request each step, built in a third of a frozen dataclass's time.)"""

    row: int
    num_tokens: int
    context: int
    block_ids: Sequence[int]  # at least cdiv(context, block_size) blocks


@dataclass
class AttentionGroup:
    """Sequences attended in one call: queries padded to `q_len` rows, keys to `width` blocks each."""

    q_rows: torch.Tensor  # [n * q_len] rows of the step's queries (padding repeats a real row)
    out_rows: torch.Tensor  # [m] rows of the output the real results go to
    picked: torch.Tensor | None  # [m] positions of the real results in the [n * q_len] result; None: all
    blocks: torch.Tensor  # [n * width] block ids (padding: block 0)
    n: int
    q_len: int
    mask: torch.Tensor | None  # additive [n, 1, q_len, width * block_size]; None with `causal`
    causal: bool


@dataclass
class AttentionMetadata:
    """Per-step tensors: where each new token's K/V goes, and the attention groups."""

    slot_index: torch.Tensor  # [T] flat slot of each new token's K in layer 0 (see PagedAttention)
    groups: list[AttentionGroup]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(
    spans: list[SeqSpan], length: Callable[[SeqSpan], int], pad_tokens: int, max_tokens: int
) -> list[list[SeqSpan]]:
    """Runs of `spans` sorted by `length` (longest first) whose members are at most `pad_tokens`
    shorter than the run's first, and at most `max_tokens` padded tokens in all."""
    runs: list[list[SeqSpan]] = []
    for s in sorted(spans, key=length, reverse=True):
        if runs:
            width = length(runs[-1][0])
            if width - length(s) <= pad_tokens and (len(runs[-1]) + 1) * width <= max_tokens:
                runs[-1].append(s)
                continue
        runs.append([s])
    return runs


def plan_attention(
    spans: Sequence[SeqSpan],
    kv_cache: torch.Tensor,
    pad_tokens: int = PAD_TOKENS,
    group_bytes: int = GROUP_BYTES,
    with_decodes: bool = True,
) -> AttentionMetadata:
    """The step's slot indices and attention groups for `kv_cache`, built once for all layers.
    Without `with_decodes` the decodes get their slots but no group (another kernel attends them)."""
    _, num_layers, _, block_size, kv_heads, head_dim = kv_cache.shape
    builder = _GroupBuilder(block_size, kv_cache.dtype, kv_cache.device)
    max_tokens = max(1, group_bytes // (2 * kv_heads * head_dim * kv_cache.element_size()))
    slots: list[int] = []
    block_stride = num_layers * 2 * block_size
    for s in spans:
        if s.num_tokens == 1:  # a decode: most rows at scale
            pos = s.context - 1
            slots.append(s.block_ids[pos // block_size] * block_stride + pos % block_size)
            continue
        for pos in range(s.context - s.num_tokens, s.context):
            slots.append(s.block_ids[pos // block_size] * block_stride + pos % block_size)
    decodes = [s for s in spans if s.num_tokens == 1] if with_decodes else []
    firsts = [s for s in spans if s.num_tokens > 1 and s.num_tokens == s.context]
    continued = [s for s in spans if 1 < s.num_tokens < s.context]
    groups = [builder.decodes(run) for run in _split(decodes, lambda s: s.context, pad_tokens, max_tokens)]
    groups += [builder.first_chunks(run) for run in _split(firsts, lambda s: s.num_tokens, pad_tokens, max_tokens)]
    groups += [builder.continued_chunk(s) for s in continued]
    return AttentionMetadata(slot_index=builder.indices(slots), groups=groups)


class _GroupBuilder:
    """Host-side construction of a step's groups; each tensor goes to the device without a sync."""

    def __init__(self, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size, self.dtype, self.device = block_size, dtype, device

    def indices(self, values: list[int]) -> torch.Tensor:
        return device_tensor(values, torch.long, self.device)

    def additive_mask(self, hidden: torch.Tensor) -> torch.Tensor:
        """0 where a key is visible, -inf where `hidden`, in the attention's dtype."""
        return to_device(torch.zeros(hidden.shape, dtype=self.dtype).masked_fill_(hidden, float("-inf")), self.device)

    def _blocks(self, run: list[SeqSpan], width: int) -> torch.Tensor:
        ids: list[int] = []
        for s in run:
            own = list(s.block_ids[: _cdiv(s.context, self.block_size)])
            ids += own + [0] * (width - len(own))
        return self.indices(ids)

    def decodes(self, run: list[SeqSpan]) -> AttentionGroup:
        width = _cdiv(max(s.context for s in run), self.block_size)
        contexts = torch.tensor([s.context for s in run])
        hidden = torch.arange(width * self.block_size)[None, :] >= contexts[:, None]
        rows = self.indices([s.row for s in run])
        mask = self.additive_mask(hidden[:, None, None])
        return AttentionGroup(rows, rows, None, self._blocks(run, width), len(run), 1, mask, causal=False)

    def first_chunks(self, run: list[SeqSpan]) -> AttentionGroup:
        q_len = run[0].num_tokens  # the longest: queries and keys are padded to it
        width = _cdiv(q_len, self.block_size)
        q_rows, out_rows, picked = [], [], []
        for i, s in enumerate(run):
            real = list(range(s.row, s.row + s.num_tokens))
            q_rows += real + [s.row] * (q_len - s.num_tokens)
            out_rows += real
            picked += range(i * q_len, i * q_len + s.num_tokens)
        padded = len(picked) < len(q_rows)
        return AttentionGroup(
            q_rows=self.indices(q_rows),
            out_rows=self.indices(out_rows),
            picked=self.indices(picked) if padded else None,
            blocks=self._blocks(run, width),
            n=len(run),
            q_len=q_len,
            mask=None,
            causal=True,
        )

    def continued_chunk(self, s: SeqSpan) -> AttentionGroup:
        width = _cdiv(s.context, self.block_size)
        # Query i sits at position context - num_tokens + i and sees keys 0..that position.
        positions = torch.arange(s.num_tokens)[:, None] + (s.context - s.num_tokens)
        hidden = torch.arange(width * self.block_size)[None, :] > positions
        rows = self.indices(list(range(s.row, s.row + s.num_tokens)))
        mask = self.additive_mask(hidden[None, None])
        return AttentionGroup(rows, rows, None, self._blocks([s], width), 1, s.num_tokens, mask, causal=False)


class PagedAttention:
    """The `Attention` callable the model runs for one step."""

    def __init__(self, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.meta = meta
        self.scale = scale
        # Token slots [blocks * layers * 2 * block_size, H, D]: new K/V are written with one
        # index_copy_ each at meta.slot_index (+ layer offset, + block_size for V).
        self.slots = kv_cache.view(-1, *kv_cache.shape[-2:])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_slots = self.meta.slot_index + layer * 2 * self.block_size
        self.slots.index_copy_(0, k_slots, k.to(self.slots.dtype))
        self.slots.index_copy_(0, k_slots + self.block_size, v.to(self.slots.dtype))
        keys, values = self.kv_cache[:, layer, 0], self.kv_cache[:, layer, 1]  # [blocks, block_size, H, D]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for g in self.meta.groups:
            out[g.out_rows] = self._attend(g, q, keys, values)
        return out

    def _attend(self, g: AttentionGroup, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The group's real output rows [m, Hq, D]."""
        heads, dim = q.shape[1:]
        qg = q.index_select(0, g.q_rows).view(g.n, g.q_len, heads, dim).transpose(1, 2)
        kv_shape = (g.n, -1, *keys.shape[2:])  # [n, width * block_size, kv_heads, D]
        kg = keys.index_select(0, g.blocks).view(kv_shape).transpose(1, 2).to(q.dtype)
        vg = values.index_select(0, g.blocks).view(kv_shape).transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=g.mask, is_causal=g.causal, scale=self.scale, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(g.n * g.q_len, heads, dim)
        return out if g.picked is None else out.index_select(0, g.picked)


# One step's attention: (the step's sequences, the cache, the softmax scale) -> the callable the
# model runs per layer, (layer, q, k, v) -> out.
StepAttention = Callable[[Sequence[SeqSpan], torch.Tensor, float], Callable[..., torch.Tensor]]


def torch_attention(spans: Sequence[SeqSpan], kv_cache: torch.Tensor, scale: float) -> PagedAttention:
    return PagedAttention(kv_cache, plan_attention(spans, kv_cache), scale)
