"""Token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Random rows use the exponential race: argmax(p / E) with E ~ Exp(1) draws from p. A seeded
request draws its noise from its own generator, so its tokens do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from superinfer.engine.core.request import SamplingParams


@dataclass
class SampledLogprobs:
    """Model log-probabilities (before temperature and truncation) of chosen and top tokens."""

    chosen: torch.Tensor  # [N]
    top_ids: torch.Tensor  # [N, k]
    top_values: torch.Tensor  # [N, k]


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus (the best token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = rank >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, SampledLogprobs | None]:
    """Sample one token per row of float32 `logits` [N, vocab]."""
    vocab = logits.shape[-1]
    greedy = all(p.greedy for p in params)
    if greedy:
        tokens = logits.argmax(dim=-1)
    else:
        device = logits.device
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        scaled = logits / temps[:, None]
        if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            scaled = _truncate(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        tokens = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=device)
        if is_greedy.any():
            tokens = torch.where(is_greedy, logits.argmax(dim=-1), tokens)

    want = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    if want is None:
        return tokens, None
    logp = logits.log_softmax(dim=-1)
    top = logp.topk(max(want, 1), dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, SampledLogprobs(chosen=chosen, top_ids=top.indices, top_values=top.values)
