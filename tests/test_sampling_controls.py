"""Penalties, logit_bias, min_p and prompt logprobs in the engine, checked against transformers and
against reference loops with OpenAI's and vLLM's definitions; invariant under batching, chunked
prefill, preemption and async scheduling (the token history lives on the device)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from superinfer.engine.core.request import SamplingParams
from tests.hf_fixtures import hf_greedy, hf_model, make_hf_checkpoint
from tests.test_engine import engine, random_prompts, run


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_hf_checkpoint("llama", tmp_path_factory.mktemp("m"), seed=4)
    return path, hf_model(path)


def reference_greedy(model, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """OpenAI's penalties, one token at a time over a full forward: logit - frequency * count -
    presence * (count > 0), counted over the generated tokens only."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


def test_presence_and_frequency_penalties_match_openai_semantics(checkpoint):
    path, model = checkpoint
    prompts = random_prompts(3, model.config.vocab_size, seed=3, lo=4, hi=20)
    params = {
        "r0": (0.0, 1.5),
        "r1": (1.5, 0.0),
        "r2": (0.8, 0.8),
    }
    sampling = {
        rid: SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=p, frequency_penalty=f)
        for rid, (p, f) in params.items()
    }
    ours = run(engine(str(path), block_size=4), prompts, sampling)
    for rid, prompt in prompts.items():
        assert ours[rid] == reference_greedy(model, prompt, 16, *params[rid]), rid
    plain = run(engine(str(path), block_size=4), prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert any(plain[rid] != ours[rid] for rid in prompts)  # the penalties changed something


def test_repetition_penalty_matches_transformers_generate(checkpoint):
    path, model = checkpoint
    prompts = random_prompts(2, model.config.vocab_size, seed=8, lo=6, hi=16)
    sampling = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=1.8)
    ours = run(engine(str(path), block_size=4), prompts, sampling)
    for rid, prompt in prompts.items():
        expected = hf_greedy(model, prompt, 14, repetition_penalty=1.8)
        assert ours[rid] == expected, rid


def test_penalties_survive_batching_chunked_prefill_preemption_and_async_scheduling(checkpoint):
    path, model = checkpoint
    prompts = random_prompts(6, model.config.vocab_size, seed=5, lo=10, hi=40)
    sampling = SamplingParams(
        max_tokens=20,
        temperature=0,
        ignore_eos=True,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        repetition_penalty=1.2,
    )
    alone = {}
    for rid, prompt in prompts.items():
        alone.update(run(engine(str(path), block_size=4), {rid: prompt}, sampling))
    for async_scheduling in (False, True):
        stressed = engine(
            str(path), block_size=4, num_gpu_blocks=24, max_num_batched_tokens=16, async_scheduling=async_scheduling
        )
        assert run(stressed, prompts, sampling) == alone
        assert stressed.scheduler.counters.preemptions["recompute"] > 0
        # Rows go back with the next step's plan (which carries the requests that ended).
        run(stressed, {"next": [5, 6]}, SamplingParams(max_tokens=1))
        assert not stressed.runner.histories.row_of


def test_logit_bias_forces_and_bans_tokens(tiny):
    prompt = [5, 9, 33, 2]
    forced = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True, logit_bias=((77, 100.0),))
    assert run(tiny, {"a": prompt}, forced)["a"] == [77] * 6
    greedy = run(tiny, {"b": prompt}, SamplingParams(max_tokens=1, temperature=0))["b"][0]
    banned = SamplingParams(max_tokens=1, temperature=0, logit_bias=((greedy, -100.0),))
    assert run(tiny, {"c": prompt}, banned)["c"][0] != greedy


def test_min_p_of_one_keeps_only_the_most_likely_token(tiny):
    prompts = random_prompts(4, tiny.model_config.vocab_size, seed=9)
    greedy = run(tiny, prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    sampled = SamplingParams(max_tokens=8, temperature=1.5, min_p=1.0, ignore_eos=True)
    assert run(tiny, {f"m{rid}": p for rid, p in prompts.items()}, sampled) == {f"m{r}": t for r, t in greedy.items()}


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_equal_the_models_log_softmax(checkpoint, chunk):
    path, model = checkpoint
    prompt = random_prompts(1, model.config.vocab_size, seed=12, lo=30, hi=30)["r0"]
    kwargs = {"max_num_batched_tokens": chunk} if chunk else {}
    core = engine(str(path), block_size=4, **kwargs)
    run(core, {"warm": prompt}, SamplingParams(max_tokens=1, temperature=0))  # caches the prefix
    core.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    outs = []
    while core.has_work:
        outs += core.step()
    (out,) = outs
    assert out.num_cached_tokens == 0  # scoring the prompt bypasses the prefix cache
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for position in range(1, len(prompt)):
        lp, row = lps[position], expected[position - 1]
        assert lp.token_id == prompt[position]
        assert lp.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-3)
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()
        assert lp.rank == int((row > row[prompt[position]]).sum()) + 1


def test_sampling_params_reject_out_of_range_controls():
    for change in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"prompt_logprobs": 21},
        {"seed": 2**64},  # past what a generator takes: refused here, not in the engine's step
        {"seed": -(2**63) - 1},
    ):
        with pytest.raises(ValueError, match=next(iter(change))):
            dataclasses.replace(SamplingParams(), **change)


@pytest.fixture(scope="module")
def tiny():
    return engine("tiny", max_model_len=512)
