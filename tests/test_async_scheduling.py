"""Async scheduling: step t+1 is planned and submitted before step t's tokens are read back.

Outputs must be exactly those of the synchronous engine (tokens, text, logprobs, finish reasons),
with stops the scheduler cannot foresee (stop tokens, stop strings), preemption and rotation; a
token sampled past a stop is dropped; nothing leaks, whatever is aborted while steps are in flight.
"""

from __future__ import annotations

import functools

import pytest

from superinfer.engine.core.plan import PLACEHOLDER
from superinfer.engine.core.request import FinishReason, Request, SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.output import RequestOutput
from tests.test_core import make_scheduler
from tests.test_engine import engine, random_prompts
from tests.test_rotary import rotary_scheduler

PROMPTS = random_prompts(12, 2000, seed=21, lo=8, hi=60)


def run_all(core: EngineCore, prompts: dict[str, list[int]], sampling: dict[str, SamplingParams]) -> dict:
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, sampling[rid])
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
    while core.has_work:
        for o in core.step():
            outs[o.request_id].append(o)
    assert core.kv.pool.num_free == core.kv.num_blocks, "GPU blocks leaked"
    if core.kv.cpu is not None:
        assert core.kv.cpu.num_free == core.kv.cpu.num_blocks, "CPU blocks leaked"
    return {
        rid: (
            [t for o in os for t in o.token_ids],
            "".join(o.text for o in os),
            [(lp.token_id, lp.logprob) for o in os for lp in o.logprobs or []],
            os[-1].finish_reason,
        )
        for rid, os in outs.items()
    }


@functools.cache
def mixed_sampling_params() -> dict[str, SamplingParams]:
    """Greedy, seeded random, logprobs, min_tokens, and stops that land mid-generation."""
    probe = run_all(
        engine("tiny", max_model_len=256),
        PROMPTS,
        {rid: SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for rid in PROMPTS},
    )
    sampling = {}
    for i, (rid, (tokens, text, *_)) in enumerate(probe.items()):
        kind = i % 6
        if kind == 0:
            sampling[rid] = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(tokens[8],))
        elif kind == 1:
            sampling[rid] = SamplingParams(max_tokens=24, temperature=0, stop=(text[len(text) // 3 :][:3],))
        elif kind == 2:
            sampling[rid] = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=40, seed=i)
        elif kind == 3:
            sampling[rid] = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
        elif kind == 4:
            sampling[rid] = SamplingParams(max_tokens=1, temperature=0)
        else:
            sampling[rid] = SamplingParams(max_tokens=12, temperature=0, min_tokens=10, stop_token_ids=(tokens[2],))
    return sampling


@pytest.fixture
def mixed_sampling() -> dict[str, SamplingParams]:
    return mixed_sampling_params()


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"num_gpu_blocks": 14, "max_num_batched_tokens": 32},  # preemption by recompute, chunked prefill
        {"policy": "rotary", "num_gpu_blocks": 14, "num_cpu_blocks": 400, "transfer_budget_blocks": 12},
        {"policy": "watermark", "num_gpu_blocks": 14, "num_cpu_blocks": 400, "transfer_budget_blocks": 12},
    ],
    ids=["ample", "preempting", "rotary", "watermark"],
)
def test_outputs_identical_to_the_synchronous_engine(setting, mixed_sampling):
    sync = engine("tiny", max_model_len=256, async_scheduling=False, **setting)
    pipelined = engine("tiny", max_model_len=256, async_scheduling=True, **setting)
    expected = run_all(sync, PROMPTS, mixed_sampling)
    got = run_all(pipelined, PROMPTS, mixed_sampling)
    for rid, (tokens, text, logprobs, reason) in expected.items():
        assert got[rid][0] == tokens and got[rid][1] == text and got[rid][3] == reason, rid
        assert [t for t, _ in got[rid][2]] == [t for t, _ in logprobs]
        assert [v for _, v in got[rid][2]] == pytest.approx([v for _, v in logprobs], abs=1e-4)  # batch rounding
    assert {reason for *_, reason in expected.values()} == {"stop", "length"}
    if "policy" in setting:
        assert pipelined.scheduler.counters.rotations > 0
    elif "num_gpu_blocks" in setting:
        assert pipelined.scheduler.counters.preemptions["recompute"] > 0


def test_abort_while_steps_are_in_flight_frees_everything():
    core = engine("tiny", max_model_len=256, async_scheduling=True, policy="rotary", num_gpu_blocks=14)
    sampling = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for rid, prompt in PROMPTS.items():
        core.add_request(rid, prompt, sampling)
    aborted_in_flight = 0
    for n in range(12):
        core.step()
        if n % 3 == 2 and core.step_in_flight:
            core.abort(next(iter(core.scheduler.requests)))
            aborted_in_flight += 1
    assert aborted_in_flight > 0
    for rid in list(core.scheduler.requests):
        core.abort(rid)
    late = []
    while core.has_work:
        late += core.step()
    assert not late, "aborted requests emit nothing more"
    assert core.kv.pool.num_free == core.kv.num_blocks and core.kv.cpu.num_free == core.kv.cpu.num_blocks


# --- the scheduler's side ------------------------------------------------------------------------
def test_pending_token_is_a_placeholder_and_arrives_later():
    s = make_scheduler(num_blocks=8)
    s.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0), 0.0))
    prefill = s.schedule()
    decode = s.schedule()  # planned before the prefill's token is known
    (seq,) = decode.all_seqs()
    assert seq.token_ids == [PLACEHOLDER] and seq.start_pos == 3 and seq.sample
    s.update(prefill, [7])
    assert s.requests["a"].output_token_ids == [7]
    third = s.schedule()
    s.update(decode, [8])
    assert third.all_seqs()[0].token_ids == [PLACEHOLDER] and third.all_seqs()[0].start_pos == 4
    fourth = s.schedule()
    assert fourth.all_seqs() == [], "its pending token is its last (max_tokens): not scheduled again"
    s.update(third, [9])
    s.update(fourth, [])
    assert s.requests == {} and s.kv.num_free_blocks == 8


def test_token_sampled_past_a_stop_is_dropped():
    s = make_scheduler(num_blocks=8)
    s.add(Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=10, temperature=0), 0.0, eos_token_ids=frozenset({0})))
    first = s.schedule()
    second = s.schedule()
    (req,) = s.update(first, [0])  # EOS: it ends while `second` still computes for it
    assert req.finish_reason is FinishReason.STOP and req.output_token_ids == [0]
    assert s.update(second, [5]) == [] and req.output_token_ids == [0]
    assert s.kv.num_free_blocks == 8


def test_blocks_under_a_copy_in_flight_wait_for_its_step():
    """Rotated out in step 99 (blocks copied out), then aborted before step 99 completes: both
    ends of its copies stay quarantined until it does; blocks no copy touches are free at once."""
    s = rotary_scheduler(num_blocks=5, num_cpu_blocks=16)  # mostly in use: full blocks are written through
    s.add(Request("a", list(range(3, 13)), SamplingParams(max_tokens=10, temperature=0), 0.0))
    s.update(s.schedule(), [7])
    s.update(s.schedule(), [8])  # writes its two full blocks through: clean from here on
    copies = s.kv.swap_out(s.requests["a"], step=99)
    assert len(copies) == 1, "only the dirty tail is copied out"
    assert set(s.kv.pool.held) == {copies[0][0]} and s.kv.pool.num_free == 4
    s.abort("a")
    assert set(s.kv.cpu.held) == {copies[0][1]}
    s.kv.retire(99)
    assert s.kv.pool.num_free == 5 and s.kv.cpu.num_free == 16
