"""CUDA graphs for decode steps: the model's forward, captured once per padded batch size.

Op by op, a decode step launches some thirty kernels per layer, and on a GPU launching them takes
longer than running them: a Llama-3-8B decode step at batch 1 took 25.4 ms op by op on an H100 and
6.8 ms replayed as a graph. At startup the runner captures the forward of `size` decode rows into one
graph per size, over static input buffers. A decode-only step of B rows copies its inputs into the
first B rows of those buffers, pads the others (their KV writes are skipped and they read no keys,
so their outputs are garbage nobody reads) and replays the graph of the smallest size that holds
B rows. Attention inside is the Triton decode kernel split for `max_model_len` keys: splits past a
sequence's context return at once. Prefill and mixed steps, and batches past the largest size, run
op by op.

Without CUDA (tests, through Triton's interpreter) the same buffers run op by op instead of a replay.
The logits are computed outside the graph, for the real rows only (a graph's output for every
size would hold a vocabulary-wide row per padded row). The graphs share one memory pool and are
replayed one at a time on the compute stream, where a replay's output is read before the next
replay can overwrite it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from functools import partial

import torch

from superinfer.engine.worker.attention import SeqSpan
from superinfer.engine.worker.device_tensor import device_tensor
from superinfer.engine.worker.graph_capture import capture
from superinfer.engine.worker.triton_attention import TritonPagedAttention, token_slots
from superinfer.kernels.common import block_table, cdiv, int32_tensor, to_device
from superinfer.kernels.paged_decode import DecodeBatch, split_size

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes to capture: SIZES below max_num_seqs, and max_num_seqs itself (at most
    the largest of SIZES)."""
    top = min(max_num_seqs, SIZES[-1])
    return sorted({s for s in SIZES if s < top} | {top})


class DecodeGraphs:
    def __init__(
        self, model: torch.nn.Module, kv_cache: torch.Tensor, scale: float, max_model_len: int, sizes: Sequence[int]
    ) -> None:
        """Capture one graph per size (call under torch.inference_mode, with nothing else running
        on the device)."""
        device = kv_cache.device
        top = max(sizes)
        self.block_size = kv_cache.shape[3]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(top, cdiv(max_model_len, self.block_size), dtype=torch.int32, device=device)
        self.rows = torch.arange(top, dtype=torch.int32, device=device)
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Each size's forward over the buffers: what a graph replays (run op by op without CUDA). The
        # buffers and these stay referenced as long as the graphs: a graph reads freed memory otherwise.
        self.forwards: dict[int, Callable[[], torch.Tensor]] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output
        self.replays = 0
        pool = None
        kv_heads = kv_cache.shape[4]
        for size in reversed(self.sizes):  # the largest first: the others fit in its pool
            split = split_size(size * kv_heads, max_model_len, device)
            tables = self.block_tables[:size]
            batch = DecodeBatch(self.rows[:size], self.context_lens[:size], tables, max_model_len, split)
            attn = TritonPagedAttention(kv_cache, scale, self.slots[:size], batch)
            forward = self.forwards[size] = partial(model, self.input_ids[:size], self.positions[:size], attn)
            if device.type != "cuda":
                continue
            (self.graphs[size],), (self.hidden[size],), pool = capture([forward], device, pool)
        self.pool = pool  # (the piecewise graphs share it)

    def run(self, input_ids: torch.Tensor, positions: Sequence[int], spans: Sequence[SeqSpan]) -> torch.Tensor | None:
        """The model's hidden states [len(spans), hidden] for a step of one-token rows (`spans` in
        row order), from the smallest graph that holds them; None when none does (the caller runs
        the step op by op). They are the graph's output buffer: read them before the next run."""
        n = len(spans)
        i = bisect_left(self.sizes, n)
        if i == len(self.sizes):
            return None
        size, bs = self.sizes[i], self.block_size
        contexts = [s.context for s in spans]
        meta = to_device(int32_tensor([token_slots(spans, bs), contexts]), input_ids.device)
        table = to_device(block_table([s.block_ids for s in spans], contexts, bs), input_ids.device)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(device_tensor(positions, torch.long, input_ids.device))
        self.slots[:n].copy_(meta[0])
        self.context_lens[:n].copy_(meta[1])
        self.block_tables[:n, : table.shape[1]].copy_(table)
        self.slots[n:size].fill_(-1)
        self.context_lens[n:size].zero_()
        if size in self.graphs:
            self.graphs[size].replay()
        else:
            self.hidden[size] = self.forwards[size]()
        self.replays += 1
        return self.hidden[size][:n]
