"""EngineCore end to end on CPU: token-exact against transformers, and invariant under batching,
chunked prefill, preemption and prefix caching."""

from __future__ import annotations

import math
import random

import pytest
import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.slo import SLO
from tests.hf_fixtures import hf_greedy, hf_model, make_hf_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run(
    core: EngineCore, prompts: dict[str, list[int]], sampling: SamplingParams | dict[str, SamplingParams] = GREEDY
) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, sampling[rid] if isinstance(sampling, dict) else sampling)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while core.has_work:
        for o in core.step():
            out[o.request_id] += o.token_ids
    return out


def engine(model: str, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", dtype="float32", **{"num_gpu_blocks": 256, **kw}))


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 40) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for i in range(n)}


@pytest.fixture(scope="module")
def tiny() -> EngineCore:
    return engine("tiny", max_model_len=512)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_generation_matches_transformers(arch, tmp_path):
    path = make_hf_checkpoint(arch, tmp_path / arch, seed=3)
    reference = hf_model(path)
    prompts = random_prompts(3, reference.config.vocab_size, seed=1)
    ours = run(engine(str(path), block_size=4), prompts)
    for rid, prompt in prompts.items():
        expected = hf_greedy(reference, prompt, 12)
        assert ours[rid] == expected, f"{arch} {rid}"


def test_logprobs_match_transformers(tmp_path):
    path = make_hf_checkpoint("llama", tmp_path / "m", seed=5)
    reference = hf_model(path)
    prompt = [5, 17, 42, 9, 77, 31]
    core = engine(str(path))
    core.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=3))
    (out,) = core.step()
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    lp = out.logprobs[0]
    assert lp.token_id == int(expected.argmax())
    assert lp.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    top = expected.topk(3)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_batching_chunked_prefill_preemption_and_prefix_cache_are_token_identical(tiny):
    vocab = tiny.model_config.vocab_size
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = random_prompts(8, vocab, seed=2, lo=5, hi=60)
    for rid in ("r1", "r4", "r6"):
        prompts[rid] = shared + prompts[rid][:5]
    sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    alone = {}
    reference = engine("tiny", max_model_len=512, enable_prefix_caching=False)
    for rid, prompt in prompts.items():
        alone.update(run(reference, {rid: prompt}, sampling))

    # 16 tokens per step forces chunked prefill; 20 blocks of 16 tokens forces preemption.
    stressed = engine("tiny", max_model_len=512, max_num_batched_tokens=16, num_gpu_blocks=20)
    together = run(stressed, prompts, sampling)
    assert together == alone
    assert stressed.scheduler.counters.preemptions["recompute"] > 0
    assert stressed.kv.num_free_blocks == stressed.kv.num_blocks

    cached = engine("tiny", max_model_len=512)
    run(cached, {"r1": prompts["r1"]}, sampling)
    cached.add_request("r4", prompts["r4"], sampling)
    outs = []
    while cached.has_work:
        outs += cached.step()
    assert outs[-1].num_cached_tokens == 32  # two full blocks of the shared 40-token prefix
    assert [t for o in outs for t in o.token_ids] == alone["r4"]


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    vocab = tiny.model_config.vocab_size
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True)
    prompt = random_prompts(1, vocab, seed=4)["r0"]
    alone = run(tiny, {"x": prompt}, seeded)["x"]
    others = random_prompts(5, vocab, seed=5)
    mixed = {rid: SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True) for rid in others}
    together = run(tiny, {**others, "x": prompt}, {**mixed, "x": seeded})
    assert together["x"] == alone
    other_seed = run(tiny, {"y": prompt}, SamplingParams(max_tokens=16, temperature=0.9, seed=12, ignore_eos=True))
    assert other_seed["y"] != alone


def test_top_k_one_tiny_top_p_and_tiny_temperatures_are_greedy(tiny):
    """(A temperature of 1e-300 divided the logits into inf and NaN, which sampled the last token.)"""
    prompt = random_prompts(1, tiny.model_config.vocab_size, seed=6)["r0"]
    greedy = run(tiny, {"g": prompt})["g"]
    top_k = run(tiny, {"k": prompt}, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True))["k"]
    top_p = run(tiny, {"p": prompt}, SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, ignore_eos=True))["p"]
    cold = run(tiny, {"t": prompt}, SamplingParams(max_tokens=12, temperature=1e-300, seed=3, ignore_eos=True))["t"]
    assert greedy == top_k == top_p == cold


def test_stop_string_truncates_text_and_finishes(tiny):
    prompt = tiny.tokenizer.encode("Tell me about the sea")
    tiny.add_request("full", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    full = ""
    while tiny.has_work:
        full += "".join(o.text for o in tiny.step())
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    tiny.add_request("stop", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,)))
    outs = []
    while tiny.has_work:
        outs += tiny.step()
    assert "".join(o.text for o in outs) == full[: full.index(stop)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert tiny.kv.num_free_blocks == tiny.kv.num_blocks


def test_abort_frees_blocks_and_emits_nothing_more(tiny):
    prompt = random_prompts(1, tiny.model_config.vocab_size, seed=8, lo=50, hi=60)["r0"]
    tiny.add_request("a", prompt, SamplingParams(max_tokens=100, temperature=0))
    tiny.step()
    assert tiny.kv.num_free_blocks < tiny.kv.num_blocks
    tiny.abort("a")
    assert not tiny.has_work and tiny.kv.num_free_blocks == tiny.kv.num_blocks
    assert tiny.step() == []


def gauge(core: EngineCore, name: str, **labels: str) -> float | None:
    return core.metrics.registry.get_sample_value(
        f"superinfer_engine_{name}", {"model_name": core.config.model_name, **labels}
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gauges_tell_the_truth_when_the_engine_goes_idle(async_scheduling):
    core = engine("tiny", max_model_len=512, async_scheduling=async_scheduling)
    prompts = random_prompts(2, core.model_config.vocab_size, seed=9, lo=40, hi=50)
    core.add_request("long", prompts["r0"], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    core.add_request("short", prompts["r1"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    finished = False
    while not finished:
        finished = any(o.finished for o in core.step())
    assert gauge(core, "requests_running") == 1
    assert gauge(core, "kv_cache_usage_ratio", tier="gpu") > 0
    core.abort("long")  # nothing is left to step: only the abort can refresh the gauges
    while core.has_work:
        core.step()
    assert gauge(core, "requests_running") == 0
    assert gauge(core, "requests_waiting") == 0
    assert gauge(core, "kv_cache_usage_ratio", tier="gpu") == 0
    assert gauge(core, "kv_blocks", tier="gpu", state="free") == core.kv.num_blocks


def test_slo_lag_gauge_is_the_most_lagging_waiting_request():
    now = [100.0]
    core = EngineCore(
        EngineConfig(model="tiny", device="cpu", dtype="float32", num_gpu_blocks=256, max_num_seqs=1,
                     ttft_slo_ms=500, async_scheduling=False),
        clock=lambda: now[0],
    )  # fmt: skip
    prompts = random_prompts(2, core.model_config.vocab_size, seed=10, lo=20, hi=30)
    core.add_request("first", prompts["r0"], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    core.add_request("second", prompts["r1"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    core.step()
    assert gauge(core, "slo_lag_seconds") == 0  # "second" waits, within its 500 ms TTFT target
    now[0] += 2.0
    core.step()
    assert gauge(core, "slo_lag_seconds") == pytest.approx(1.5)  # 2 s waiting against 0.5 s
    core.abort("first")
    while core.has_work:
        core.step()
    assert gauge(core, "slo_lag_seconds") == 0


def test_min_tokens_bans_eos_and_stop_tokens_until_reached(tiny):
    prompt = random_prompts(1, tiny.model_config.vocab_size, seed=12)["r0"]
    first = run(tiny, {"g": prompt}, SamplingParams(max_tokens=1, temperature=0))["g"][0]
    banned = SamplingParams(max_tokens=8, temperature=0, min_tokens=4, stop_token_ids=(first,))
    out = run(tiny, {"b": prompt}, banned)["b"]
    assert out[0] != first and len(out) >= 4
    assert first not in out[:3]


def test_what_would_fail_a_step_is_refused_with_the_request(tiny):
    """The sampler indexes the logits with a request's banned and biased tokens, the batch keeps
    priorities in int64 columns, the TBT guard divides by the SLO: a token past the vocabulary, a
    priority past 32 bits, an infinite SLO are the request's errors, not the engine's in a step."""
    vocab = tiny.model_config.vocab_size
    for bad in (
        SamplingParams(min_tokens=1, stop_token_ids=(vocab,)),
        SamplingParams(min_tokens=1, stop_token_ids=(-1,)),
        SamplingParams(logit_bias=((vocab + 5, 1.0),)),
    ):
        with pytest.raises(ValueError, match="must be token ids in"):
            tiny.validate(3, bad)
    tiny.validate(3, SamplingParams(min_tokens=1, stop_token_ids=(vocab - 1,), logit_bias=((0, 1.0),)))
    with pytest.raises(ValueError, match="priority must be in"):
        tiny.add_request("p", [5, 6], SamplingParams(), priority=2**63)
    with pytest.raises(ValueError, match="SLO targets must be in"):
        SLO(tbt_ms=math.inf)


def test_stop_string_on_the_last_allowed_token_reports_stop(tiny):
    prompt = tiny.tokenizer.encode("Tell me about the sea")
    tiny.add_request("full", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outs = []
    while tiny.has_work:
        outs += tiny.step()
    text = "".join(o.text for o in outs)
    last_piece = outs[-1].text.strip() or text[-2:]
    tiny.add_request("s", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=(last_piece,)))
    outs = []
    while tiny.has_work:
        outs += tiny.step()
    assert outs[-1].finish_reason == "stop" and len(outs) == 6
