"""Paged attention with the CPU kernel (`--attention-backend cpu`; `auto` on the CPU).

The decodes, most of a busy step's sequences, go to the C kernel, which reads their keys and
values where they lie in the cache: no gather, no padding to the longest context. Prompt chunks
stay on the torch backend's grouped SDPA, whose matrix products beat the kernel's per-query loop
over many queries. One step's layers share the kernel's span table, built once.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import torch

from superinfer.engine.model.tiny import default_cache_root
from superinfer.engine.worker.attention import PagedAttention, SeqSpan, plan_attention
from superinfer.engine.worker.device_tensor import device_tensor
from superinfer.kernels.cpu_paged_attention import SpanTable, load, paged_attention


def kernel_library() -> ctypes.CDLL:
    """The kernel built for this machine (once, under $SUPERINFER_CACHE/kernels)."""
    return load(default_cache_root() / "kernels")


def cpu_attention() -> Callable[[Sequence[SeqSpan], torch.Tensor, float], CpuPagedAttention]:
    """The per-step attention with the kernel library resolved once."""
    return functools.partial(CpuPagedAttention, lib=kernel_library())


class CpuPagedAttention(PagedAttention):
    """The `Attention` callable the model runs for one step."""

    def __init__(self, spans: Sequence[SeqSpan], kv_cache: torch.Tensor, scale: float, lib: ctypes.CDLL) -> None:
        super().__init__(kv_cache, plan_attention(spans, kv_cache, with_decodes=False), scale)
        self.lib = lib
        decodes = [s for s in spans if s.num_tokens == 1]
        self.decodes = (
            SpanTable.build(
                [s.row for s in decodes],
                [1] * len(decodes),
                [s.context for s in decodes],
                [s.block_ids for s in decodes],
                self.block_size,
            )
            if decodes
            else None
        )
        self.decode_rows = device_tensor([s.row for s in decodes], torch.long, kv_cache.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = super().__call__(layer, q, k, v)  # the new K/V written, the prompt chunks attended
        if self.decodes is None:
            return out
        if q.dtype == torch.float32:
            paged_attention(self.lib, q.contiguous(), self.kv_cache, layer, self.decodes, self.scale, out)
            return out
        q32 = q.float()  # the kernel computes in fp32: a bf16 model's rows go through a buffer
        out32 = torch.empty_like(q32)
        paged_attention(self.lib, q32, self.kv_cache, layer, self.decodes, self.scale, out32)
        out.index_copy_(0, self.decode_rows, out32.index_select(0, self.decode_rows).to(out.dtype))
        return out
