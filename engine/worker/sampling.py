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
    """Mask logits outside each row's top-k, then outside the top-p nucleus of what is left
    (renormalised, as HF and vLLM do). The best token always stays."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A small per-step tensor on the device without a blocking host-to-device copy."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[Sequence[int]] = (),
) -> tuple[torch.Tensor, SampledLogprobs | None]:
    """Sample one token per row of float32 `logits` [N, vocab].

    `banned[i]` are token ids row i may not produce (EOS and stop tokens before `min_tokens`).
    Logprobs are those of the model, before banning, temperature and truncation.
    """
    vocab = logits.shape[-1]
    scores = logits
    if any(banned):
        rows = [i for i, ids in enumerate(banned) for _ in ids]
        cols = [t for ids in banned for t in ids]
        scores = logits.index_put(
            (_on(logits.device, rows, torch.long), _on(logits.device, cols, torch.long)),
            torch.tensor(float("-inf"), device=logits.device),
        )
    if all(p.greedy for p in params):
        tokens = scores.argmax(dim=-1)
    else:
        device = logits.device
        temps = _on(device, [p.temperature if not p.greedy else 1.0 for p in params], torch.float32)
        scaled = scores / temps[:, None]
        if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
            top_k = _on(device, [p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long)
            top_p = _on(device, [p.top_p for p in params], torch.float32)
            scaled = _truncate(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        tokens = (probs / noise).argmax(dim=-1)
        if any(p.greedy for p in params):
            is_greedy = _on(device, [p.greedy for p in params], torch.bool)
            tokens = torch.where(is_greedy, scores.argmax(dim=-1), tokens)

    want = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    if want is None:
        return tokens, None
    logp = logits.log_softmax(dim=-1)
    top = logp.topk(max(want, 1), dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, SampledLogprobs(chosen=chosen, top_ids=top.indices, top_values=top.values)
