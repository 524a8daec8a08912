"""CUDA graphs for steps with prompt tokens: the forward between one layer's attention and the
next, captured per padded token count, with attention run op by op between them.

A step with a prompt chunk cannot replay a decode graph: its attention's launches depend on its
batch (the prompt tokens' tiles, the decode rows, their splits). Op by op, the other ~10 kernels a
layer are host-bound: on an H100 a Llama-3-8B step with a 256-token prompt chunk beside its decodes
took 29-33 ms whatever the batch, where a decode step replayed in a graph took 7-13 ms. So for each
padded token count the runner captures `layers + 1` graphs over static buffers: the embedding, the
RoPE tables and layer 0 up to its attention; each layer's second half with the next layer's first
(output projection, norms, MLP, the next q/k/v and RoPE); the last layer's second half with the
final norm. Between graphs flow q, k, v, the residual stream, the RoPE tables and attention's
output, in buffers.

A step of n tokens takes the smallest count >= n: its token ids and positions go into the first
n rows (the other rows get token 0 at position 0), graph 0 replays, then for each layer attention
runs op by op on the first n rows of q, k and v (the padding rows write no KV and nobody attends
to them), its output goes into the buffer and the next graph replays. Every op of the graphs works
row by row, so the padding changes no real row. Steps past the largest count run op by op.

Attention writes its output straight into the buffer. Without CUDA (tests, through Triton's
interpreter) the same pieces run op by op over the same buffers. The graphs of all counts share
one memory pool with the decode graphs and are replayed one at a time on the compute stream: what
one piece hands the next is in a buffer allocated before any capture, and a decode graph's output,
which lives in the pool, is read on that stream before another graph replays.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from superinfer.engine.model.decoder import DecoderLM
from superinfer.engine.worker.device_tensor import device_tensor
from superinfer.engine.worker.graph_capture import capture

if TYPE_CHECKING:  # (importing it imports triton)
    from superinfer.engine.worker.triton_attention import TritonPagedAttention

TOKEN_COUNTS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def graph_token_counts(max_num_batched_tokens: int) -> list[int]:
    """The padded token counts to capture: TOKEN_COUNTS below the step's token budget, and the
    budget itself (at most the largest of TOKEN_COUNTS)."""
    top = min(max_num_batched_tokens, TOKEN_COUNTS[-1])
    return sorted({n for n in TOKEN_COUNTS if n < top} | {top})


class PiecewiseGraphs:
    def __init__(self, model: DecoderLM, counts: Sequence[int], device: torch.device, pool: Any = None) -> None:
        """Capture each count's graphs in memory pool `pool` (None: a new one; the decode graphs'
        is shared, as only one graph replays at a time), under torch.inference_mode, with nothing
        else running on the device."""
        top = max(counts)
        attn = model.model.layers[0].self_attn
        heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        dtype = model.model.embed_tokens.weight.dtype
        self.model = model
        self.counts = sorted(counts)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        cos, sin = model.rotary(self.positions, dtype)
        self.cos, self.sin = torch.zeros_like(cos), torch.zeros_like(sin)
        self.q = torch.zeros(top, heads, d, dtype=dtype, device=device)
        self.k = torch.zeros(top, kv_heads, d, dtype=dtype, device=device)
        self.v = torch.zeros(top, kv_heads, d, dtype=dtype, device=device)
        self.out = torch.zeros(top, heads, d, dtype=dtype, device=device)  # attention's, op by op
        self.residual = torch.zeros(top, model.config.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(top, model.config.hidden_size, dtype=dtype, device=device)  # the output
        # Each count's pieces over the buffers' first rows: what its graphs replay (run op by op
        # without CUDA). They and the buffers stay referenced as long as the graphs.
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.replays = 0
        for count in reversed(self.counts):  # the largest first: the others fit in its pool
            pieces = self.pieces[count] = self._pieces(count)
            if device.type != "cuda":
                continue
            self.graphs[count], _, pool = capture(pieces, device, pool)
        self.pool = pool

    def _pieces(self, n: int) -> list[Callable[[], None]]:
        """The forward of n rows cut at each attention: layers + 1 pieces, each reading and
        writing the buffers' first n rows."""
        # The pieces hold the buffers' views, not self: no reference cycle keeps the device memory
        # of dropped graphs alive until a garbage collection.
        model, layers = self.model, self.model.model.layers
        cos, sin = self.cos[:n], self.sin[:n]
        input_ids, positions, hidden = self.input_ids[:n], self.positions[:n], self.hidden[:n]
        q_buf, k_buf, v_buf, out, residual_buf = self.q[:n], self.k[:n], self.v[:n], self.out[:n], self.residual[:n]

        def keep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> None:
            q_buf.copy_(q)
            k_buf.copy_(k)
            v_buf.copy_(v)
            residual_buf.copy_(residual)

        def first() -> None:
            h = model.model.embed_tokens(input_ids)
            table_cos, table_sin = model.rotary(positions, h.dtype)
            cos.copy_(table_cos)
            sin.copy_(table_sin)
            keep(*layers[0].attention_inputs(h, None, cos, sin))

        def between(layer: int) -> Callable[[], None]:
            def piece() -> None:
                h, residual = layers[layer - 1].after_attention(out, residual_buf)
                keep(*layers[layer].attention_inputs(h, residual, cos, sin))

            return piece

        def last() -> None:
            h, residual = layers[-1].after_attention(out, residual_buf)
            hidden.copy_(model.model.norm.add(h, residual)[0])

        return [first, *(between(layer) for layer in range(1, len(layers))), last]

    def run(self, input_ids: torch.Tensor, positions: Sequence[int], attn: TritonPagedAttention) -> torch.Tensor | None:
        """The model's final-norm hidden states [n, hidden] for a step of n = len(positions) tokens,
        through the smallest count that holds them; None when none does (the caller runs the step
        op by op). They are the output buffer: read them before the next run."""
        n = len(positions)
        i = bisect_left(self.counts, n)
        if i == len(self.counts):
            return None
        count = self.counts[i]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(device_tensor(positions, torch.long, input_ids.device))
        self.input_ids[n:count].zero_()
        self.positions[n:count].zero_()
        graphs = self.graphs.get(count)
        steps: Sequence[Callable[[], None]] = [g.replay for g in graphs] if graphs else self.pieces[count]
        steps[0]()
        for layer, replay in enumerate(steps[1:]):
            attn(layer, self.q[:n], self.k[:n], self.v[:n], out=self.out[:n])
            replay()
        self.replays += 1
        return self.hidden[:n]
