"""Token sampling for a batch: logit bias, penalties, greedy, temperature, top-k, top-p, min-p,
per-request seeds, logprobs. Everything is batched on the logits' device: per-row parameters are
[N] tensors, never a Python loop over rows or the vocabulary.

The order is vLLM's: bans and logit_bias, then the repetition, frequency and presence penalties,
then temperature, top-k/top-p and min-p. Nothing sorts the vocabulary on the CPU, where a sort of
[N, vocab] costs more than the model step: top-k masks below each row's k-th score (ties kept),
and a row draws one uniform number and inverts its cumulative distribution (no noise per token).
Top-p draws by rejection: a token is drawn from what is left, and kept if the tokens more likely
than it hold less than top_p of the mass; else it and everything less likely are dropped and the
row draws again. Each draw is kept with probability at least top_p, so few rounds are needed; rows
still open after MAX_NUCLEUS_ROUNDS (and every row on CUDA, which sorts fast and must not wait on
the host) find the nucleus by sorting. A seeded request draws from its own generator, only while
its row is open, so its tokens do not depend on the batch.
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


MAX_NUCLEUS_ROUNDS = 8


def _top_k_mask(scaled: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """-inf below each row's k-th largest score (k >= vocab: no limit). Ties with it stay."""
    vocab = scaled.shape[-1]
    k_max = max(k for k in top_k if k < vocab)
    kth = scaled.topk(k_max, dim=-1).values
    rank = device_tensor([min(k, k_max) - 1 for k in top_k], torch.long, scaled.device)
    floor = kth.gather(-1, rank[:, None])
    unlimited = device_tensor([k >= vocab for k in top_k], torch.bool, scaled.device)[:, None]
    return scaled.masked_fill((scaled < floor) & ~unlimited, float("-inf"))


def _uniforms(rows: Sequence[int], generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One number in (0, 1] per row; a seeded row's from its own generator."""
    u = torch.rand(len(rows), device=device)
    for i, gen in enumerate(map(generators.__getitem__, rows)):
        if gen is not None:
            u[i] = torch.rand(1, generator=gen, device=device)
    return 1.0 - u


def _invert_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token t with probability weights[i, t] / sum(weights[i]), for uniform u in (0, 1]:
    the first token whose cumulative weight reaches u x the total (never a zero-weight one)."""
    cdf = weights.cumsum(dim=-1)
    target = u[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


def _draw_nucleus(
    probs: torch.Tensor,
    weights: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    rounds: int,
) -> torch.Tensor:
    """Draw from `weights` (probs, min-p applied) within each row's top-p nucleus of `probs`:
    the tokens whose more likely tokens hold less than top_p of the mass."""
    n, device = probs.shape[0], probs.device
    tokens = torch.empty(n, dtype=torch.long, device=device)
    rows = list(range(n))
    index = torch.arange(n, device=device)
    p, w, p_top = probs, weights, top_p[:, None]  # of the open rows (at first all, not copied)
    low: torch.Tensor | None = None  # tokens at most this likely are out of the nucleus
    for _ in range(rounds):
        drawn = _invert_cdf(w if low is None else w.masked_fill(p <= low, 0.0), _uniforms(rows, generators, device))
        p_drawn = p.gather(-1, drawn[:, None])
        above = p.masked_fill(p <= p_drawn, 0.0).sum(dim=-1, keepdim=True)
        kept = ((above < p_top) | (p_top >= 1.0)).squeeze(-1)
        tokens[index[kept]] = drawn[kept]
        open_ = (~kept).nonzero().squeeze(-1)
        if not len(open_):
            return tokens
        index, p, w, p_top, low = index[open_], p[open_], w[open_], p_top[open_], p_drawn[open_]
        rows = [rows[i] for i in open_.tolist()]
    ranked = p.sort(dim=-1, descending=True).values
    before = ranked.cumsum(dim=-1) - ranked
    last = ((before < p_top).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    floor = ranked.gather(-1, last)
    tokens[index] = _invert_cdf(w.masked_fill(p < floor, 0.0), _uniforms(rows, generators, device))
    return tokens


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
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if min(top_k) < vocab:
            scaled = _top_k_mask(scaled, top_k)
        probs = scaled.softmax(dim=-1)
        weights = probs
        if any(p.min_p > 0 for p in params):
            min_p = device_tensor([p.min_p for p in params], torch.float32, device)[:, None]
            weights = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        if any(p.top_p < 1.0 for p in params):
            top_p = device_tensor([p.top_p for p in params], torch.float32, device)
            rounds = 0 if device.type == "cuda" else MAX_NUCLEUS_ROUNDS
            tokens = _draw_nucleus(probs, weights, top_p, generators, rounds)
        else:
            tokens = _invert_cdf(weights, _uniforms(range(len(params)), generators, device))
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
