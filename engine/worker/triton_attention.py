"""Paged attention on the Triton kernels (`--attention-backend triton`; `auto` on CUDA).

Per step, on the host: each new token's slot, the decodes' batch (one query each, split-K over
long contexts) and the other sequences' batch (prompt chunks, continued or not). Per layer: one KV
write, then one decode launch and one extend launch, each writing its own rows of the output.
Importing this module imports triton; the torch backend in attention.py stays the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from superinfer.engine.worker.attention import SeqSpan
from superinfer.kernels.common import int32_tensor, to_device
from superinfer.kernels.kv_write import kv_write
from superinfer.kernels.paged_decode import DecodeBatch, paged_decode
from superinfer.kernels.paged_prefill import ExtendBatch, paged_prefill


def token_slots(spans: Sequence[SeqSpan], block_size: int) -> list[int]:
    """The cache slot (block_id * block_size + offset) of every new token, in row order."""
    slots: list[int] = []
    for s in spans:
        if s.num_tokens == 1:  # a decode: most rows at scale
            pos = s.context - 1
            slots.append(int(s.block_ids[pos // block_size]) * block_size + pos % block_size)
        else:
            pos = np.arange(s.context - s.num_tokens, s.context)
            blocks = np.asarray(s.block_ids, dtype=np.int64)[pos // block_size]
            slots += (blocks * block_size + pos % block_size).tolist()
    return slots


class TritonPagedAttention:
    """The `Attention` callable the model runs for one step."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        scale: float,
        slots: torch.Tensor,
        decodes: DecodeBatch | None,
        extend_spans: Sequence[SeqSpan] = (),
    ) -> None:
        """Over metadata already on the device: the new tokens' slots, the decodes' batch, the
        other sequences (their batch is built at the first layer). `for_step` builds it all."""
        self.kv_cache, self.scale, self.slots, self.decodes = kv_cache, scale, slots, decodes
        self.block_size = kv_cache.shape[3]
        self.extend_spans = extend_spans
        self.extends: ExtendBatch | None = None  # built at the first layer, which gives the GQA group

    @classmethod
    def for_step(cls, spans: Sequence[SeqSpan], kv_cache: torch.Tensor, scale: float) -> TritonPagedAttention:
        block_size, kv_heads, device = kv_cache.shape[3], kv_cache.shape[4], kv_cache.device
        ordered = sorted(spans, key=lambda s: s.row)
        slots = to_device(int32_tensor(token_slots(ordered, block_size)), device)
        decodes = [s for s in spans if s.num_tokens == 1]
        batch = (
            DecodeBatch.build(
                [s.row for s in decodes],
                [s.context for s in decodes],
                [s.block_ids for s in decodes],
                block_size,
                device,
                kv_heads,
            )
            if decodes
            else None
        )
        return cls(kv_cache, scale, slots, batch, [s for s in spans if s.num_tokens > 1])

    def _extend_batch(self, group: int) -> ExtendBatch:
        if self.extends is None:
            s = self.extend_spans
            self.extends = ExtendBatch.build(
                [x.row for x in s],
                [x.num_tokens for x in s],
                [x.context for x in s],
                [x.block_ids for x in s],
                self.block_size,
                group,
                self.kv_cache.device,
            )
        return self.extends

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention's output [T, heads, head_dim], into `out` if given (every row is written)."""
        kv_write(self.kv_cache, layer, k, v, self.slots)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.decodes is not None:
            paged_decode(q, self.kv_cache, layer, self.decodes, self.scale, out=out)
        if self.extend_spans:
            batch = self._extend_batch(q.shape[1] // self.kv_cache.shape[4])
            paged_prefill(q, self.kv_cache, layer, batch, self.scale, out=out)
        return out
