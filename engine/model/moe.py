"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a router picks top_k experts per token,
each a SwiGLU MLP, and their outputs are summed with the router's weights.

The experts of a layer are stacked into two tensors at load time, w13 [E, 2 * I, H] (gate rows,
then up rows) and w2 [E, H, I], so that one expert is one matmul pair. `grouped_experts` is the
torch reference: the (token, expert) pairs sorted by expert, one matmul pair per expert that has
tokens, the weighted outputs scattered back. It reads the group sizes on the host (one sync per
layer, free on the CPU); a fused GPU kernel can replace it behind the same signature.
`SparseMoE.checkpoint_tensors` names every expert's weights as the Hub checkpoints do, as views of
the stacked tensors, so the loader fills them tensor by tensor. With tensor parallelism each rank
holds a contiguous range of whole experts and runs the pairs routed to them; an all-reduce adds
the ranks' outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import ModelConfig
from .sharding import CheckpointTensor, TensorParallel, held


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Top-k experts of each token: (weights [T, k] float32, expert ids [T, k]), highest first.

    Softmax over all experts in float32, then top-k, then (optionally) rescaled to sum to 1.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, first: int = 0) -> Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t -> [T, H] in x's dtype,
    over the experts first.. that w13 and w2 hold (all of them on one device).

    x [T, H]; w13 [E, 2 * I, H]; w2 [E, H, I]; weights, ids [T, k]. Each product with a weight is
    taken in the wider of the two dtypes, then rounded to x's dtype and summed there.
    """
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    top_k, held_experts = ids.shape[1], w13.shape[0]
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # pair p = token * top_k + slot, grouped by expert
    counts = torch.bincount(flat, minlength=first + held_experts).tolist()  # the group sizes, on the host
    before = sum(counts[:first])
    counts = counts[first : first + held_experts]
    order = order[before : before + sum(counts)]  # the pairs routed to the experts held here
    if order.numel() == 0:
        return out
    tokens = order // top_k
    rows = x.index_select(0, tokens).split(counts)
    outs = []
    for expert, group in enumerate(rows):
        if group.shape[0]:
            gate, up = F.linear(group, w13[expert]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w2[expert]))
    weighted = torch.cat(outs) * weights.flatten()[order].unsqueeze(-1)
    return out.index_add_(0, tokens, weighted.to(x.dtype))


# Hub checkpoint names per architecture: the block, then each expert's gate, up and down projections.
CHECKPOINT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel(), **factory: Any) -> None:  # noqa: B008
        super().__init__()
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} has no mixture-of-experts configuration")
        self.moe, self.tp = cfg.moe, tp
        h, i, e = cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.num_experts
        self.experts = tp.split(e)  # the experts held here
        self.names = CHECKPOINT_NAMES[cfg.architecture]
        self.gate = nn.Linear(h, e, bias=False, **factory)  # the router, whole on every rank
        self.w13 = nn.Parameter(torch.empty(self.experts.length, 2 * i, h, **factory))
        self.w2 = nn.Parameter(torch.empty(self.experts.length, h, i, **factory))

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route(self.gate(x), self.moe.top_k, self.moe.renormalize)
        if self.moe.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return self.tp.all_reduce(grouped_experts(x, self.w13, self.w2, weights, ids, self.experts.start))

    def checkpoint_tensors(self, prefix: str) -> Iterator[CheckpointTensor]:
        """The router and every expert's projections under their Hub names, as views of the
        stacked tensors (no view for experts another rank holds); `prefix` is the layer's, e.g.
        "model.layers.3."."""
        block, gate, up, down = self.names
        yield held(f"{prefix}{block}.gate.weight", self.gate.weight)
        h, i = self.w2.shape[1:]
        for e in range(self.experts.whole):
            names = [f"{prefix}{block}.experts.{e}.{proj}.weight" for proj in (gate, up, down)]
            local = e - self.experts.start
            if 0 <= local < self.experts.length:
                views = (self.w13[local, :i], self.w13[local, i:], self.w2[local])
                yield from (held(n, v) for n, v in zip(names, views, strict=True))
            else:  # another rank's expert: named, not held
                shapes = ((i, h), (i, h), (h, i))
                yield from (CheckpointTensor(n, shape, None) for n, shape in zip(names, shapes, strict=True))
