"""The torch-free control plane: block pool, prefix cache, scheduler semantics, block accounting."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer.engine.core.block_pool import cdiv
from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.request import FinishReason, Request, RequestStatus, SamplingParams
from superinfer.engine.core.scheduler import Scheduler, SchedulerConfig

BS = 4


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, first_token: int = 1, **kw) -> Request:
    prompt = [(first_token + i) % 97 + 3 for i in range(prompt_len)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, temperature=0, **kw),
        arrival_time=0.0,
        eos_token_ids=frozenset({0}),
    )


def make_scheduler(
    num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, max_len: int = 256, prefix: bool = True
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_seqs, budget, max_len), KVCacheManager(num_blocks, BS, prefix), clock=lambda: 0.0
    )


def tokens_for(plan: StepPlan, by_request: dict[str, int]) -> list[int]:
    """The tokens `Scheduler.update` takes for a plan (in its sampled_ids() order), by request id."""
    return [by_request[rid] for rid in plan.sampled_ids()]


def step(s: Scheduler, token: int = 5):
    plan = s.schedule()
    s.update(plan, [token] * plan.num_sampled)
    return plan


def test_control_plane_never_imports_torch(tmp_path):
    code = (
        "import sys, superinfer.engine.core.scheduler, superinfer.engine.core.policies, "
        "superinfer.engine.slo; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "False"


def test_chunked_prefill_splits_across_steps_and_samples_once():
    s = make_scheduler(budget=10)
    s.add(make_request("a", 25))
    plans = [step(s) for _ in range(3)]
    assert [p.all_seqs()[0].num_tokens for p in plans] == [10, 10, 5]
    assert [p.all_seqs()[0].start_pos for p in plans] == [0, 10, 20]
    assert [p.all_seqs()[0].sample for p in plans] == [False, False, True]
    req = s.requests["a"]
    assert req.output_token_ids == [5] and req.num_computed_tokens == 25
    nxt = step(s)
    assert nxt.all_seqs()[0].token_ids == [5] and nxt.all_seqs()[0].start_pos == 25


def test_running_decodes_come_before_new_prefills_in_one_step():
    s = make_scheduler(budget=12)
    s.add(make_request("a", 6))
    step(s)
    s.add(make_request("b", 30))
    plan = step(s)
    assert {q.request_id: q.num_tokens for q in plan.all_seqs()} == {"a": 1, "b": 11}  # b gets what a leaves
    assert plan.num_tokens <= 12


def test_plain_decodes_travel_as_rows_and_the_rest_as_seqs():
    s = make_scheduler(budget=64)
    s.add(make_request("a", 6))
    s.add(make_request("m", 6, first_token=30, min_tokens=3))  # its next samples may not be EOS: a row of its own
    step(s)
    s.add(make_request("b", 10, first_token=60))
    plan = s.schedule()
    assert [q.request_id for q in plan.seqs] == ["m", "b"] and plan.seqs[0].banned_token_ids == (0,)
    assert plan.decodes.request_ids == ["a"] and plan.decodes.start_pos == [6] and plan.decodes.token_ids == [5]
    assert plan.decodes.block_ids == [s.requests["a"].block_ids]
    (row,) = plan.decodes.seqs()
    assert (row.token_ids, row.start_pos, row.sample, row.banned_token_ids) == ([5], 6, True, ())
    assert plan.num_seqs == 3 and plan.num_tokens == 1 + 1 + 10
    assert plan.num_context_tokens == 7 + 7 + 10
    assert sorted(plan.sampled_ids()) == ["a", "b", "m"]


def test_max_num_seqs_limits_admission():
    s = make_scheduler(max_seqs=2, budget=100)
    for rid in "abc":
        s.add(make_request(rid, 3))
    plan = step(s)
    assert [q.request_id for q in plan.all_seqs()] == ["a", "b"]
    assert s.num_waiting == 1


def test_out_of_blocks_preempts_newest_by_recompute_and_requeues_it_first():
    s = make_scheduler(num_blocks=4, budget=64)
    s.add(make_request("old", 7, max_tokens=6))
    s.add(make_request("new", 7, max_tokens=6))
    step(s)  # both prefilled: 7 tokens in 2 blocks each, pool full
    assert s.kv.num_free_blocks == 0
    step(s)  # position 7 still fits
    assert s.counters.preemptions["recompute"] == 0
    step(s)  # position 8 needs a third block each: "new" is preempted, "old" gets its block
    assert s.requests["new"].status is RequestStatus.WAITING and s.waiting[0].request_id == "new"
    assert s.requests["new"].num_computed_tokens == 0 and s.requests["new"].block_ids == []
    assert s.counters.preemptions["recompute"] == 1
    assert s.requests["new"].output_token_ids == [5, 5]  # tokens are kept for the recompute


@pytest.mark.parametrize("prefix", [False, True])
def test_preempted_request_recomputes_prompt_and_outputs(prefix):
    s = make_scheduler(num_blocks=5, budget=64, prefix=prefix)
    s.add(make_request("a", 7, max_tokens=12))
    s.add(make_request("b", 7, max_tokens=12))
    starts: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(60):
        if not s.has_work:
            break
        plan = s.schedule()
        for q in plan.all_seqs():
            starts[q.request_id].append(q.start_pos)
        s.update(plan, [5] * plan.num_sampled)
    assert not s.has_work and s.kv.num_free_blocks == 5
    assert s.counters.preemptions["recompute"] >= 1
    restarts = [p for prev, p in itertools.pairwise(starts["b"]) if p <= prev]
    assert restarts, "the preempted request was prefilled again"
    if prefix:
        assert all(p % BS == 0 and p > 0 for p in restarts), "it resumed from its own cached blocks"
    else:
        assert restarts == [0] * len(restarts)


def test_prefix_cache_hit_reuses_full_blocks_but_not_the_last_token():
    s = make_scheduler()
    s.add(make_request("a", 13))
    step(s)
    s.add(make_request("b", 13))  # same prompt
    plan = step(s)
    b = s.requests["b"]
    assert b.num_cached_tokens == 12  # 3 full blocks of 4; token 13 is computed
    seq_b = next(q for q in plan.all_seqs() if q.request_id == "b")
    assert seq_b.start_pos == 12 and seq_b.num_tokens == 1
    assert b.block_ids[:3] == s.requests["a"].block_ids[:3]
    assert all(s.kv.pool.ref_cnt[blk] == 2 for blk in b.block_ids[:3])


def test_whole_block_prompt_keeps_one_token_to_compute():
    s = make_scheduler()
    s.add(make_request("a", 8))
    step(s)
    s.add(make_request("b", 8))
    step(s)
    assert s.requests["b"].num_cached_tokens == 4


def test_freed_cached_blocks_are_found_after_the_owner_finishes():
    s = make_scheduler()
    s.add(make_request("a", 12, max_tokens=1))
    step(s)
    assert "a" not in s.requests
    s.add(make_request("b", 12))
    step(s)
    assert s.requests["b"].num_cached_tokens == 8


def test_a_next_turn_finds_the_last_turns_output_in_the_prefix_cache():
    """A finished request's output blocks are hashed only once a lookup reaches them: a chat's
    next turn, whose prompt is the last turn's prompt and output and more, finds them all."""
    s = make_scheduler()
    s.add(make_request("a", 6, max_tokens=9, ignore_eos=True))
    step(s)
    a = s.requests["a"]
    while a.num_output_tokens < 8:
        step(s)
    blocks, tokens = a.block_ids, list(a.token_ids)
    step(s)  # its last token: it finishes, 14 tokens computed (3 full blocks, 2 of them decoded)
    assert "a" not in s.requests and sorted(s.kv.pool.unhashed) == sorted(blocks[1:3])
    s.add(Request("b", [*tokens, 5, 42, 43], SamplingParams(max_tokens=4, temperature=0), 0.0))
    step(s)
    b = s.requests["b"]
    assert b.num_cached_tokens == 12 and b.block_ids[:3] == blocks[:3]
    assert not s.kv.pool.unhashed and not s.kv.pool.unhashed_after


def test_prefix_caching_off():
    s = make_scheduler(prefix=False)
    s.add(make_request("a", 13))
    step(s)
    s.add(make_request("b", 13))
    step(s)
    assert s.requests["b"].num_cached_tokens == 0


def test_stop_conditions():
    s = make_scheduler()
    s.add(make_request("len", 3, max_tokens=2))
    s.add(make_request("eos", 3, max_tokens=9))
    s.add(make_request("ign", 3, max_tokens=2, ignore_eos=True))
    s.add(make_request("tok", 3, max_tokens=9, stop_token_ids=(7,)))
    plan = s.schedule()
    s.update(plan, tokens_for(plan, {"len": 5, "eos": 0, "ign": 0, "tok": 7}))
    assert "eos" not in s.requests and "tok" not in s.requests
    plan = s.schedule()
    finished = s.update(plan, tokens_for(plan, {"len": 5, "ign": 0}))
    assert {r.request_id: r.finish_reason for r in finished} == {"len": FinishReason.LENGTH, "ign": FinishReason.LENGTH}


def test_update_takes_a_token_for_each_sampled_row():
    s = make_scheduler()
    s.add(make_request("a", 3))
    plan = s.schedule()
    with pytest.raises(ValueError, match="samples 1 tokens, got 2"):
        s.update(plan, [5, 6])
    s.update(plan, [5])  # the refused call changed nothing
    assert s.requests["a"].output_token_ids == [5] and s.requests["a"].num_pending_tokens == 0


def test_min_tokens_suppresses_early_eos():
    s = make_scheduler()
    s.add(make_request("a", 3, max_tokens=5, min_tokens=2))
    step(s, token=0)
    assert "a" in s.requests
    step(s, token=0)
    assert "a" not in s.requests


def test_max_model_len_ends_with_length():
    s = make_scheduler(max_len=6)
    s.add(make_request("a", 4, max_tokens=100))
    for _ in range(3):
        step(s)
    assert "a" not in s.requests


def test_rejects_what_can_never_finish():
    s = make_scheduler(num_blocks=4, max_len=64)
    with pytest.raises(ValueError, match="maximum context length"):
        s.add(make_request("long", 64))
    with pytest.raises(ValueError, match="more KV cache"):
        s.add(make_request("big", 10, max_tokens=10))
    s.add(make_request("ok", 10, max_tokens=6))
    with pytest.raises(ValueError, match="already live"):
        s.add(make_request("ok", 3))


def test_abort_waiting_and_running_frees_everything():
    s = make_scheduler(budget=8)
    s.add(make_request("run", 8))
    s.add(make_request("wait", 8))
    step(s)
    assert s.abort("run").finish_reason is FinishReason.ABORT
    assert s.abort("wait").finish_reason is FinishReason.ABORT
    assert s.abort("missing") is None
    assert not s.has_work and s.kv.num_free_blocks == s.kv.num_blocks
    assert set(s.schedule().released) == {"run", "wait"}


def check_invariants(s: Scheduler) -> None:
    refs = Counter(b for r in s.requests.values() for b in r.block_ids)
    pool = s.kv.pool
    for block in range(pool.num_blocks):
        assert pool.ref_cnt[block] == refs.get(block, 0), f"block {block} refcount"
        assert (block in pool.free) == (pool.ref_cnt[block] == 0)
    assert pool.in_use == {h for h, b in pool.cached.items() if pool.ref_cnt[b] > 0}
    watched = Counter(h for r in s.kv.swapped_out for h in r.block_hashes[: len(r.cpu_block_ids)])
    assert pool.watched == watched and pool.watched_in_use == len(pool.in_use & watched.keys())
    for r in s.running:
        assert r.status is RequestStatus.RUNNING
        assert len(r.block_ids) >= cdiv(r.num_computed_tokens, BS)
    for r in s.waiting:
        assert r.status is RequestStatus.WAITING and not r.block_ids
    assert len(s.running) + len(s.waiting) == len(s.requests)
    assert len(s.running) <= s.config.max_num_seqs


def add_if_it_fits(s: Scheduler, added: list[str], prompt_len: int, max_tokens: int, first_token: int) -> None:
    """Add a generated request; one that could never fit is rejected, as the server would."""
    rid = f"r{len(added)}"
    try:
        s.add(make_request(rid, prompt_len, max_tokens=max_tokens, first_token=first_token))
        added.append(rid)
    except ValueError:
        pass


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(0, 9)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(12, 40), budget=st.integers(1, 48), prefix=st.booleans())
def test_block_accounting_over_random_workloads(ops, num_blocks, budget, prefix):
    s = make_scheduler(num_blocks=num_blocks, budget=budget, max_seqs=6, max_len=64, prefix=prefix)
    added: list[str] = []
    ended: dict[str, FinishReason] = {}
    for op in ops:
        if op[0] == "add":
            add_if_it_fits(s, added, *op[1:])
        elif op[0] == "abort" and added:
            req = s.abort(added[op[1] % len(added)])
            if req is not None:
                ended[req.request_id] = req.finish_reason
        elif op[0] == "step":
            plan = s.schedule()
            assert plan.num_tokens <= budget
            for req in s.update(plan, [op[1]] * plan.num_sampled):
                if req.is_finished:
                    ended[req.request_id] = req.finish_reason
        check_invariants(s)
    for _ in range(2000):  # drain: everything finishes, nothing is stuck
        if not s.has_work:
            break
        plan = s.schedule()
        for req in s.update(plan, [9] * plan.num_sampled):
            if req.is_finished:
                ended[req.request_id] = req.finish_reason
        check_invariants(s)
    assert not s.has_work
    assert s.kv.num_free_blocks == num_blocks
    assert sorted(ended) == sorted(added), "every request ends exactly once, none is lost"
