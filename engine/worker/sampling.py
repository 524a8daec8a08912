"""Token sampling for a batch: logit bias, penalties, greedy, temperature, top-k, top-p, min-p,
per-request seeds, logprobs. Everything is batched on the logits' device: per-row parameters are
[N] tensors, never a Python loop over rows or the vocabulary.

The order is vLLM's: bans and logit_bias, then the repetition, frequency and presence penalties,
then temperature, top-k/top-p and min-p. Random rows use the exponential race: argmax(p / E) with
E ~ Exp(1) draws from p. A seeded request draws its noise from its own generator, so its tokens
do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from superinfer.engine.core.request import SamplingParams
from superinfer.engine.worker.device_tensor import device_tensor


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


@dataclass
class GrammarMasks:
    """Allowed-token bitmasks (structured output) for some rows of the batch."""

    rows: torch.Tensor  # [M] row indices
    disallowed: torch.Tensor  # [M, vocab] bool, on the logits' device


@dataclass
class TokenHistory:
    """Each row's token history for the penalties: output-token counts and a prompt-token mask."""

    output_counts: torch.Tensor  # [N, vocab] int32
    in_prompt: torch.Tensor  # [N, vocab] bool


def _bias(logits: torch.Tensor, params: Sequence[SamplingParams], banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Add each row's logit_bias and -inf at its banned tokens (one scatter for the batch)."""
    entries = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias]
    entries += [(i, token, float("-inf")) for i, ids in enumerate(banned) for token in ids]
    if not entries:
        return logits
    rows, cols, values = map(list, zip(*entries, strict=True))
    device = logits.device
    index = (device_tensor(rows, torch.long, device), device_tensor(cols, torch.long, device))
    return logits.index_put(index, device_tensor(values, torch.float32, device), accumulate=True)


def _penalize(scores: torch.Tensor, params: Sequence[SamplingParams], history: TokenHistory) -> torch.Tensor:
    device = scores.device
    repetition = device_tensor([p.repetition_penalty for p in params], torch.float32, device)[:, None]
    frequency = device_tensor([p.frequency_penalty for p in params], torch.float32, device)[:, None]
    presence = device_tensor([p.presence_penalty for p in params], torch.float32, device)[:, None]
    counts = history.output_counts
    seen = counts > 0
    repeated = torch.where(scores > 0, scores / repetition, scores * repetition)
    scores = torch.where(seen | history.in_prompt, repeated, scores)
    return scores - frequency * counts - presence * seen


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[Sequence[int]] = (),
    history: TokenHistory | None = None,
    grammar: GrammarMasks | None = None,
) -> tuple[torch.Tensor, SampledLogprobs | None]:
    """Sample one token per row of float32 `logits` [N, vocab].

    `banned[i]` are token ids row i may not produce (EOS and stop tokens before `min_tokens`).
    `history` is needed when a row has a penalty; `grammar` masks the rows under a grammar.
    Logprobs are those of the model, before grammar, bias, penalties, temperature and truncation
    (vLLM's default).
    """
    vocab = logits.shape[-1]
    scores = _bias(logits, params, banned)
    if grammar is not None:
        scores = scores.clone() if scores is logits else scores
        scores[grammar.rows] = scores[grammar.rows].masked_fill(grammar.disallowed, float("-inf"))
    if history is not None:
        scores = _penalize(scores, params, history)
    if all(p.greedy for p in params):
        tokens = scores.argmax(dim=-1)
    else:
        device = logits.device
        temps = device_tensor([p.temperature if not p.greedy else 1.0 for p in params], torch.float32, device)
        scaled = scores / temps[:, None]
        if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
            top_k = device_tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long, device)
            top_p = device_tensor([p.top_p for p in params], torch.float32, device)
            scaled = _truncate(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = device_tensor([p.min_p for p in params], torch.float32, device)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_()
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        tokens = (probs / noise).argmax(dim=-1)
        if any(p.greedy for p in params):
            is_greedy = device_tensor([p.greedy for p in params], torch.bool, device)
            tokens = torch.where(is_greedy, scores.argmax(dim=-1), tokens)

    want = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    if want is None:
        return tokens, None
    logp = logits.log_softmax(dim=-1)
    top = logp.topk(max(want, 1), dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, SampledLogprobs(chosen=chosen, top_ids=top.indices, top_values=top.values)
