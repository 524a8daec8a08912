"""The batched sampler draws from exactly the distribution that temperature, top-k, top-p and
min-p define, on both of its top-p paths, and a seeded row's tokens do not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from superinfer.engine.core.request import SamplingParams
from superinfer.engine.worker import sampling
from superinfer.engine.worker.sampling import sample

DRAWS = 40_000


def target(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution one row's parameters define, token by token: top-k (ties with the k-th
    score kept), renormalised; the nucleus (tokens whose more likely tokens hold less than top_p);
    min-p against the most likely token; renormalised."""
    probs = (logits / p.temperature).softmax(-1).double()
    if 0 < p.top_k < len(logits):
        kth = logits.topk(p.top_k).values[-1]
        probs = torch.where(logits >= kth, probs, 0.0)
        probs /= probs.sum()
    above = torch.stack([probs[probs > q].sum() for q in probs])
    keep = (probs > 0) & ((above < p.top_p) | (p.top_p >= 1.0)) & (probs >= p.min_p * probs.max())
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def frequencies(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    rows = logits.expand(DRAWS, -1).contiguous()
    tokens, _ = sample(rows, [p] * DRAWS, [None] * DRAWS)
    return torch.bincount(tokens, minlength=len(logits)).double() / DRAWS


ROWS = {
    "flat": torch.linspace(0.0, 1.0, 24),
    "peaked": torch.tensor([6.0, 4.0, 3.5, 3.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0]),
    "ties": torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0, 0.0, 0.0, -1.0]),
}
PARAMS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=0.8, top_p=0.7),
    "tight_top_p": SamplingParams(temperature=1.0, top_p=0.05),
    "all": SamplingParams(temperature=1.3, top_k=6, top_p=0.8, min_p=0.1),
}


@pytest.mark.parametrize("rounds", [sampling.MAX_NUCLEUS_ROUNDS, 0], ids=["rejection", "sort"])
@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
@pytest.mark.parametrize("logits", ROWS.values(), ids=ROWS.keys())
def test_draws_follow_the_truncated_distribution(logits, params, rounds, monkeypatch):
    monkeypatch.setattr(sampling, "MAX_NUCLEUS_ROUNDS", rounds)
    torch.manual_seed(0)
    want, got = target(logits, params), frequencies(logits, params)
    assert torch.all(got[want == 0] == 0), "a token outside the truncated set was drawn"
    assert (got - want).abs().sum() / 2 < 0.015  # total variation; its noise at 40k draws is ~0.005


@pytest.mark.gpu
@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_draws_on_cuda_follow_the_truncated_distribution(params):
    """On CUDA every top-p row takes the sort path (no round waits on the host)."""
    torch.manual_seed(0)
    logits = ROWS["peaked"]
    want, got = target(logits, params), frequencies(logits.cuda(), params).cpu()
    assert torch.all(got[want == 0] == 0) and (got - want).abs().sum() / 2 < 0.015


def test_top_p_applies_to_the_renormalised_top_k_set():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    # top-2 renormalised: 0.625 already covers 0.6, so only the first token is left
    assert frequencies(logits, SamplingParams(top_k=2, top_p=0.6))[0] == 1.0


def test_rows_left_open_after_the_rounds_are_drawn_exactly(monkeypatch):
    monkeypatch.setattr(sampling, "MAX_NUCLEUS_ROUNDS", 1)  # most rows of a tight nucleus stay open
    torch.manual_seed(1)
    logits, params = ROWS["flat"], SamplingParams(top_p=0.1)
    want, got = target(logits, params), frequencies(logits, params)
    assert torch.all(got[want == 0] == 0) and (got - want).abs().sum() / 2 < 0.015


def test_a_seeded_row_draws_the_same_tokens_in_any_batch():
    vocab = 32
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)) * 2
    seeded = SamplingParams(temperature=0.9, top_p=0.6, seed=7)

    def run(rows: list[int]) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        params = [seeded if r == 0 else SamplingParams(top_p=0.3) for r in rows]
        out = []
        for _ in range(20):  # one generator across steps, as the runner keeps it
            gens = [gen if r == 0 else None for r in rows]
            tokens, _ = sample(logits[rows], params, gens)
            out.append(int(tokens[rows.index(0)]))
        return out

    alone = run([0])
    assert run([1, 0, 2]) == alone and run([3, 4, 0, 1, 2]) == alone
    assert len(set(alone)) > 1  # it does sample


def test_greedy_rows_beside_random_rows_take_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0), SamplingParams(top_p=0.5), SamplingParams(temperature=0), SamplingParams()]
    tokens, _ = sample(logits, params, [None] * 4)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_the_sampler_bench_times_every_mode():
    from superinfer.bench.sampler import MODES, time_mode

    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(6))
    assert all(time_mode(logits, params, repeats=1) > 0 for params in MODES.values())
