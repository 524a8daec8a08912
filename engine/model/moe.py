"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a router picks top_k experts per token,
each a SwiGLU MLP, and their outputs are summed with the router's weights.

The experts of a layer are stacked into two tensors at load time, w13 [E, 2 * I, H] (gate rows,
then up rows) and w2 [E, H, I], so that one expert is one matmul pair. `grouped_experts` is the
torch reference: the (token, expert) pairs sorted by expert, one matmul pair per expert that has
tokens, the weighted outputs scattered back. It reads the group sizes on the host (one sync per
layer, free on the CPU); a fused GPU kernel can replace it behind the same signature.
`SparseMoE.checkpoint_tensors` names every expert's weights as the Hub checkpoints do, as views of
the stacked tensors, so the loader fills them tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import ModelConfig


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Top-k experts of each token: (weights [T, k] float32, expert ids [T, k]), highest first.

    Softmax over all experts in float32, then top-k, then (optionally) rescaled to sum to 1.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t -> [T, H] in x's dtype.

    x [T, H]; w13 [E, 2 * I, H]; w2 [E, H, I]; weights, ids [T, k]. Each product with a weight is
    taken in the wider of the two dtypes, then rounded to x's dtype and summed there.
    """
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # pair p = token * top_k + slot, grouped by expert
    tokens = order // top_k
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the group sizes, on the host
    rows = x.index_select(0, tokens).split(counts)
    outs = []
    for expert, group in enumerate(rows):
        if group.shape[0]:
            gate, up = F.linear(group, w13[expert]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w2[expert]))
    weighted = torch.cat(outs) * weights.flatten()[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, tokens, weighted.to(x.dtype))


# Hub checkpoint names per architecture: the block, then each expert's gate, up and down projections.
CHECKPOINT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, **factory: Any) -> None:
        super().__init__()
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} has no mixture-of-experts configuration")
        self.moe = cfg.moe
        h, i, e = cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.num_experts
        self.names = CHECKPOINT_NAMES[cfg.architecture]
        self.gate = nn.Linear(h, e, bias=False, **factory)  # the router
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, **factory))
        self.w2 = nn.Parameter(torch.empty(e, h, i, **factory))

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route(self.gate(x), self.moe.top_k, self.moe.renormalize)
        if self.moe.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return grouped_experts(x, self.w13, self.w2, weights, ids)

    def checkpoint_tensors(self, prefix: str) -> Iterator[tuple[str, Tensor]]:
        """(Hub name, view) of the router and of every expert's projections; `prefix` is the
        layer's, e.g. "model.layers.3."."""
        block, gate, up, down = self.names
        yield f"{prefix}{block}.gate.weight", self.gate.weight
        i = self.w2.shape[-1]
        for e in range(self.w13.shape[0]):
            yield f"{prefix}{block}.experts.{e}.{gate}.weight", self.w13[e, :i]
            yield f"{prefix}{block}.experts.{e}.{up}.weight", self.w13[e, i:]
            yield f"{prefix}{block}.experts.{e}.{down}.weight", self.w2[e]
