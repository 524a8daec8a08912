"""RotaSched and the CPU tier: token identity under rotation, safety invariants, policy rules."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.policies import RotaryParams, RotaryPolicy, WatermarkPolicy, virtual_lag_time
from superinfer.engine.core.request import Request, RequestStatus, SamplingParams
from superinfer.engine.core.scheduler import Scheduler, SchedulerConfig
from superinfer.engine.engine import EngineCore
from superinfer.engine.slo import SLO
from tests.test_core import add_if_it_fits, make_request
from tests.test_engine import engine, random_prompts, run

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rotary_scheduler(num_blocks=16, num_cpu_blocks=64, budget=64, xfer=2400, max_seqs=16, policy=None, clock=None):
    kv = KVCacheManager(num_blocks, BS, True, num_cpu_blocks)
    return Scheduler(
        SchedulerConfig(max_seqs, budget, 256, xfer),
        kv,
        policy or RotaryPolicy(RotaryParams(transfer_budget_blocks=xfer)),
        clock or Clock(),
    )


def step(s: Scheduler, token: int = 5):
    plan = s.schedule()
    s.update(plan, [token] * plan.num_sampled)
    return plan


# --- the engine: rotation never changes a token ----------------------------------------------
PROMPTS = random_prompts(10, 2000, seed=9, lo=10, hi=50)
SAMPLING = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def unpressured() -> dict[str, list[int]]:
    """Greedy outputs with ample KV memory (batching itself is token-exact: see test_engine)."""
    return run(engine("tiny", max_model_len=256), PROMPTS, SAMPLING)


class TickingClock:
    """Advances a fixed step at every reading: the policy's decisions depend on the number of
    readings only, not on how fast this machine runs the model."""

    def __init__(self, tick_s: float) -> None:
        self.now, self.tick_s = 0.0, tick_s

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now


@pytest.mark.parametrize("policy", ["rotary", "watermark"])
def test_greedy_outputs_identical_with_frequent_rotation(policy, unpressured):
    # 20 blocks of 16 tokens cannot hold 10 requests of up to 80 tokens: with no minimum residency
    # and no admission control rotation is constant; on a ticking clock, as often on every machine.
    config = EngineConfig(
        model="tiny",
        device="cpu",
        dtype="float32",
        max_model_len=256,
        policy=policy,
        num_gpu_blocks=20,
        num_cpu_blocks=400,
        transfer_budget_blocks=16,
        rotary_min_residency_ms=0,
        slo_admission=False,
    )
    rotating = EngineCore(config, clock=TickingClock(0.01))
    assert run(rotating, PROMPTS, SAMPLING) == unpressured
    assert rotating.scheduler.counters.rotations > 5
    kv = rotating.kv
    assert kv.pool.num_free == kv.num_blocks and kv.cpu.num_free == kv.cpu.num_blocks


def test_cpu_tier_full_falls_back_to_recompute(unpressured):
    tight = engine("tiny", max_model_len=256, policy="rotary", num_gpu_blocks=20, num_cpu_blocks=3)
    assert run(tight, PROMPTS, SAMPLING) == unpressured
    counters = tight.scheduler.counters
    assert counters.preemption_reasons[("recompute", "cpu_full")] > 0  # the too-small tier shows
    for mode, n in counters.preemptions.items():  # the reasons split the totals
        assert n == sum(k for (m, _), k in counters.preemption_reasons.items() if m == mode)
    exported = tight.metrics.registry.get_sample_value(
        "superinfer_engine_preemptions_total", {"model_name": "tiny", "mode": "recompute", "reason": "cpu_full"}
    )
    assert exported == counters.preemption_reasons[("recompute", "cpu_full")]
    assert counters.by_reason()["recompute_cpu_full"] == exported  # as the benchmarks report it
    assert tight.kv.pool.num_free == tight.kv.num_blocks and tight.kv.cpu.num_free == 3


def test_write_through_waits_until_the_gpu_pool_is_half_used():
    """With most of the GPU pool free and nobody waiting, a rotation is unlikely: full blocks stay
    unwritten (on the CPU a copy costs compute time). Past half the pool, those blocks go first."""
    s = rotary_scheduler(num_blocks=24, num_cpu_blocks=64)
    first = make_request("first", 4 * BS, max_tokens=64, first_token=1)
    s.add(first)
    for _ in range(3):
        plan = step(s)
        assert plan.swap_out == [] and first.cpu_block_ids == []
    second = make_request("second", 8 * BS, max_tokens=64, first_token=50)  # then 14 of 24 blocks in use
    s.add(second)
    plan = step(s)  # a request waits: first's full blocks go; second's are final only after its prefill
    assert len(plan.swap_out) == len(first.cpu_block_ids) == 4
    plan = step(s)
    assert len(plan.swap_out) == len(second.cpu_block_ids) == 8


def test_write_through_ignores_requests_that_wait_only_for_the_token_budget():
    """A burst whose prefills wait for the token budget, but fits in the free blocks, starts no
    write-through (with ample memory the copies would only cost); waiting requests that need more
    blocks than are free do start it."""
    s = rotary_scheduler(num_blocks=64, num_cpu_blocks=256, budget=4 * BS)
    first = make_request("first", 4 * BS, max_tokens=100, first_token=1)
    s.add(first)
    step(s)
    for i in range(4):
        s.add(make_request(f"burst{i}", 4 * BS, max_tokens=100, first_token=10 * i + 20))
    waited = 0
    while s.waiting:  # about one prefill a step: they wait for the budget, 20 of 64 blocks in use at most
        assert step(s).swap_out == []
        waited += 1
    assert waited >= 3 and first.cpu_block_ids == [] and s.kv.num_free_blocks > 32
    for i in range(3):
        s.add(make_request(f"long{i}", 30 * BS, max_tokens=8, first_token=7 * i + 60))
    assert s.kv.num_free_blocks > 32  # still most of the pool free, but not enough for them
    plan = step(s)
    assert plan.swap_out and len(first.cpu_block_ids) >= 4  # its full blocks go


def test_write_through_goes_first_to_the_next_rotation_victim_when_the_tier_is_short():
    """A CPU tier too small for every running request's full blocks: the request the policy would
    rotate out next (here the lower priority one, though admitted second) gets them first, so it
    can leave with a one-block copy."""
    s = rotary_scheduler(num_blocks=14, num_cpu_blocks=3)  # mostly in use: full blocks are written through
    keep, leave = make_request("keep", 16, first_token=1), make_request("leave", 16, first_token=50)
    keep.priority = 1
    for r in (keep, leave):
        s.add(r)
    step(s)  # both prefill 16 tokens: 4 full blocks each, written through once final (next step)
    assert [r.request_id for r in s.running] == ["keep", "leave"]
    step(s)
    assert len(leave.cpu_block_ids) == 3 and keep.cpu_block_ids == []


def test_full_cpu_tier_with_chunked_prefill_does_not_livelock():
    """Two requests that cannot share the GPU, a one-block CPU tier, two tokens per step: a
    rotation that cannot swap must not turn into recompute ping-pong where nobody progresses."""
    clock = Clock()
    s = Scheduler(
        SchedulerConfig(4, 2, 128, 100),
        KVCacheManager(10, 2, True, num_cpu_blocks=1),
        RotaryPolicy(RotaryParams(transfer_budget_blocks=100)),
        clock,
    )
    sampling = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    s.add(Request("A", list(range(3, 12)), sampling, 0.0))
    for k in range(500):
        if k == 6:
            s.add(Request("B", list(range(60, 69)), sampling, clock.now))
        step(s)
        clock.now += 0.05
        if not s.has_work:
            break
    assert not s.has_work, "both requests finish"


# --- the rules of the policy on hand-made situations ----------------------------------------
def test_virtual_lag_time():
    p = RotaryParams(alpha=3, beta_f=0.5, beta_b=0)
    req = Request("a", [1, 2, 3], SamplingParams(), arrival_time=10.0, slo=SLO(ttft_ms=2000, tbt_ms=100))
    assert virtual_lag_time(req, 10.5, p) == 0.0  # waited less than beta_f * TTFT SLO
    assert virtual_lag_time(req, 12.5, p) == pytest.approx(1.5)
    req.status, req.t_last_token = RequestStatus.ROTARY, 20.0
    assert virtual_lag_time(req, 20.2, p) == pytest.approx(0.6)  # alpha * 0.2
    req.status, req.t_run = RequestStatus.RUNNING, 15.0
    assert virtual_lag_time(req, 20.0, p) == pytest.approx(-5.0)


def test_no_contention_is_plain_fcfs_and_rotates_nothing():
    clock = Clock()
    s = rotary_scheduler(num_blocks=64, clock=clock)
    for i in range(4):
        clock.now = float(i)
        s.add(make_request(f"r{i}", 6, max_tokens=4))
    clock.now = 10.0
    plan = step(s)
    assert [q.request_id for q in plan.all_seqs()] == ["r0", "r1", "r2", "r3"]
    assert not plan.swap_out and s.counters.rotations == 0


def test_contention_rotates_the_longest_running_decode_for_a_lagging_arrival():
    clock = Clock()
    s = rotary_scheduler(num_blocks=6, clock=clock)
    s.add(make_request("old", 7, max_tokens=12, first_token=0))
    step(s)
    clock.now = 1.0
    s.add(make_request("mid", 7, max_tokens=12, first_token=1))
    step(s)  # both running, 4 of 6 blocks used
    s.add(make_request("new", 7, max_tokens=12, first_token=2))  # needs 2 blocks; only 2 are free
    clock.now = 3.0  # it arrived at 0: it lags after 0.5 x its 5 s TTFT SLO
    decision = s.policy.decide(s, clock.now)
    assert [r.request_id for r in decision.admit] == ["new"]
    assert [r.request_id for r in decision.rotate_out] == ["old"], "the longest-running decode yields first"
    plan = step(s)
    assert s.requests["old"].status is RequestStatus.ROTARY and plan.swap_out
    clock.now = 3.1
    step(s)
    assert s.requests["new"].t_first_token is not None


def test_an_arrival_that_does_not_lag_yet_waits_for_free_blocks():
    clock = Clock()
    s = rotary_scheduler(num_blocks=6, clock=clock)
    s.add(make_request("old", 7, max_tokens=12, first_token=0))
    s.add(make_request("mid", 7, max_tokens=12, first_token=1))
    step(s)
    step(s)
    s.add(make_request("new", 7, max_tokens=12, first_token=2))
    clock.now = 2.0  # waited 2 s of its 2.5 s grace (0.5 x TTFT SLO): VLT 0
    decision = s.policy.decide(s, clock.now)
    assert decision.rotate_out == []
    assert decision.admit == [] and [r.request_id for r in decision.patient] == ["new"], "only into free blocks"
    step(s)
    assert s.counters.rotations == 0


LOOSE_TBT = SLO(ttft_ms=5000, tbt_ms=60_000)  # never missed here: residency alone decides


def test_a_request_brought_back_runs_its_minimum_residency_before_it_can_leave_again():
    clock = Clock()
    params = RotaryParams(min_residency_s=0.5, slo_admission=False)
    s = rotary_scheduler(num_blocks=6, clock=clock, policy=RotaryPolicy(params))

    def add(name: str, first_token: int) -> None:
        req = make_request(name, 7, max_tokens=12, first_token=first_token)
        req.slo = LOOSE_TBT
        s.add(req)

    add("old", 0)
    step(s)
    clock.now = 2.8
    add("mid", 1)
    step(s)
    add("new", 2)
    clock.now = 3.0
    step(s)  # "new" lags: "old" (running since 0) is rotated out for it; "mid" has run only 0.2 s
    assert s.requests["old"].status is RequestStatus.ROTARY
    assert s.requests["new"].status is RequestStatus.RUNNING
    clock.now = 3.2  # "old" lags now (alpha x 0.2 s), but "new" has run 0.2 s and "mid" 0.4 s
    assert s.policy.decide(s, clock.now).rotate_out == [], "nobody has run its minimum residency yet"
    clock.now = 3.35
    assert [r.request_id for r in s.policy.decide(s, clock.now).rotate_out] == ["mid"]


def thrash_run(min_residency_s: float) -> tuple[int, int]:
    """Eight requests sharing room for four, 20 ms steps: (rotations, tokens)."""
    clock = Clock()
    params = RotaryParams(min_residency_s=min_residency_s, slo_admission=False)
    s = rotary_scheduler(num_blocks=24, num_cpu_blocks=200, clock=clock, policy=RotaryPolicy(params))
    for i in range(8):  # 6 blocks each at the end: 48 needed, 24 there
        s.add(make_request(f"r{i}", 4, max_tokens=20, first_token=11 * i))
        s.requests[f"r{i}"].slo = LOOSE_TBT
    tokens = 0
    while s.has_work:
        plan = step(s)
        tokens += sum(q.sample for q in plan.all_seqs())
        clock.now += 0.02
    return s.counters.rotations, tokens


def test_minimum_residency_stops_rotation_thrash():
    thrash_rotations, tokens = thrash_run(0.0)
    rotations, same_tokens = thrash_run(0.2)
    assert tokens == same_tokens == 8 * 20
    assert thrash_rotations >= 4 * rotations, (thrash_rotations, rotations)
    assert rotations > 0, "the overload still rotates, just not every step"


def test_prioritize_selects_only_what_the_transfer_budget_can_bring_in():
    """Six rotated-out requests need 4 copies each; B_xfer = 10 moves two per step. Selecting
    more would rotate running requests out for room nobody can use this step."""
    clock = Clock()
    s = rotary_scheduler(num_blocks=36, num_cpu_blocks=100, xfer=10, clock=clock)
    s.add(make_request("long", 60, max_tokens=30, first_token=200))
    step(s)
    step(s)  # "long" decodes, holding 16 of 36 blocks: 20 free, the six need 24
    for i in range(6):  # rotated out earlier: 3 full blocks and a tail in the CPU tier, none left on the GPU
        req = make_request(f"r{i}", 14, max_tokens=30, first_token=10 * i)
        req.token_ids = [*req.prompt_token_ids, 5]
        req.num_computed_tokens, req.t_last_token = 14, 0.0
        req.status, req.cpu_block_ids, (req.cpu_tail,) = (
            RequestStatus.ROTARY,
            s.kv.cpu.allocate(3),
            s.kv.cpu.allocate(1),
        )
        s.requests[req.request_id] = req
        s.rotary.append(req)
        s.rotary_on_time.append(req)
    clock.now = 1.0
    assert [s.kv.swap_in_need(r, 1) for r in s.rotary] == [(4, 4)] * 6
    decision = s.policy.decide(s, clock.now)
    assert [r.request_id for r in decision.admit] == ["r0", "r1"]
    assert decision.rotate_out == [], "the free blocks hold what can come in: nothing is rotated out"


def test_only_decode_phase_requests_are_rotated():
    clock = Clock()
    s = rotary_scheduler(num_blocks=8, budget=4, clock=clock)
    s.add(make_request("prefilling", 30, max_tokens=2))  # 30-token prompt, 4 tokens a step
    step(s)
    clock.now = 5.0
    s.add(make_request("waiting", 6, max_tokens=2))
    step(s)
    step(s)
    assert s.counters.rotations == 0 and s.requests["prefilling"].status is RequestStatus.RUNNING


def test_shared_prefix_blocks_are_not_counted_as_freed():
    clock = Clock()
    s = rotary_scheduler(num_blocks=12, clock=clock)
    s.add(make_request("a", 9, max_tokens=30))
    step(s)
    s.add(make_request("b", 9, max_tokens=30))  # same prompt: shares a's 2 full blocks
    step(s)
    a = s.requests["a"]
    assert s.kv.owned_blocks(a) == len(a.block_ids) - 2


def test_watermark_rotates_oldest_running_when_free_blocks_fall_under_it():
    clock = Clock()
    s = rotary_scheduler(num_blocks=10, policy=WatermarkPolicy(3), clock=clock)
    for i in range(3):
        clock.now = float(i)
        s.add(make_request(f"r{i}", 7, max_tokens=20, first_token=10 * i))
        step(s)
    assert s.counters.rotations == 0  # 6 blocks used, 4 free: above the watermark
    for _ in range(3):  # each request grows into a third block
        clock.now += 1.0
        step(s)
        if s.counters.rotations:
            break
    assert [r.request_id for r in s.rotary] == ["r0"], "the oldest running request is rotated first"


# --- safety invariants over random workloads -------------------------------------------------
def copied_blocks(plan) -> tuple[set[int], set[int]]:
    """GPU and CPU blocks the plan's copies read or write."""
    gpu = {g for g, _ in plan.swap_out} | {g for _, g in plan.swap_in}
    cpu = {c for _, c in plan.swap_out} | {c for c, _ in plan.swap_in}
    return gpu, cpu


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 16), st.integers(0, 2)),
        st.tuples(st.just("abort"), st.integers(0, 40), st.booleans()),
        st.tuples(st.just("step"), st.floats(0.0, 0.5)),
    ),
    max_size=70,
)


@settings(max_examples=80, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(10, 30),
    cpu_blocks=st.integers(0, 40),
    xfer=st.integers(1, 12),
    budget=st.integers(4, 40),
    policy=st.sampled_from(["rotary", "watermark"]),
)
def test_two_tier_invariants_over_random_workloads(ops, num_blocks, cpu_blocks, xfer, budget, policy):
    clock = Clock()
    pol = RotaryPolicy(RotaryParams(transfer_budget_blocks=xfer)) if policy == "rotary" else WatermarkPolicy(3)
    s = rotary_scheduler(num_blocks, cpu_blocks or 1, budget, xfer, max_seqs=8, policy=pol, clock=clock)
    added: list[str] = []
    ended: set[str] = set()
    mid_flight_aborts: deque[tuple[int, bool]] = deque()

    def one_step() -> None:
        plan = s.schedule()
        moved = len(plan.swap_out) + len(plan.swap_in)
        assert moved <= xfer, "per-step moved blocks stay within the transfer budget"
        assert not {g for g, _ in plan.swap_out} & {g for _, g in plan.swap_in}, "GPU block both source and dest"
        assert not {c for _, c in plan.swap_out} & {c for c, _ in plan.swap_in}, "CPU block both dest and source"
        gpu, cpu = copied_blocks(plan)
        while mid_flight_aborts:  # aborts that arrive while the step is in flight
            idx, _ = mid_flight_aborts.popleft()
            req = s.abort(added[idx % len(added)])
            if req is not None:
                ended.add(req.request_id)
        assert not gpu & set(s.kv.pool.free), "a block the in-flight step's copies touch was freed for reuse"
        assert not cpu & set(s.kv.cpu.free), "a CPU block the in-flight step's copies touch was freed for reuse"
        for req in s.update(plan, [7] * plan.num_sampled):
            if req.is_finished:
                ended.add(req.request_id)
        clock.now += 0.01

    for op in ops:
        if op[0] == "add":
            add_if_it_fits(s, added, *op[1:])
        elif op[0] == "abort" and added:
            if op[2]:
                mid_flight_aborts.append((op[1], True))
            else:
                req = s.abort(added[op[1] % len(added)])
                if req is not None:
                    ended.add(req.request_id)
        elif op[0] == "step":
            clock.now += op[1]
            one_step()
    mid_flight_aborts.clear()
    for _ in range(3000):
        if not s.has_work:
            break
        one_step()
    assert not s.has_work, "nothing is stuck"
    assert s.kv.pool.num_free == num_blocks and s.kv.cpu.num_free == s.kv.cpu.num_blocks, "no leak in either tier"
    assert ended == set(added), "every request ends exactly once, none is lost"


def test_a_request_that_already_missed_its_tbt_yields_first():
    clock = Clock()
    s = rotary_scheduler(num_blocks=6, clock=clock, policy=RotaryPolicy(RotaryParams(slo_admission=False)))
    s.add(make_request("old", 7, max_tokens=12, first_token=0))
    step(s)
    clock.now = 1.0
    s.add(make_request("missed", 7, max_tokens=12, first_token=1))
    step(s)
    s.requests["old"].max_gap_s = 0.05  # (this clock jumps: set the gaps the story needs)
    s.requests["missed"].max_gap_s = 0.5  # a 500 ms stall: its 100 ms TBT SLO is lost anyway
    s.add(make_request("new", 7, max_tokens=12, first_token=2))
    clock.now = 3.0
    decision = s.policy.decide(s, clock.now)
    assert [r.request_id for r in decision.rotate_out] == ["missed"], "not 'old', which still meets its SLO"
    step(s)
    assert s.requests["missed"].status is RequestStatus.ROTARY


def _tier_state(kv: KVCacheManager, reqs: list[Request]) -> tuple:
    cpu = kv.cpu
    return [r.cpu_block_ids for r in reqs], cpu.ref_cnt, cpu.cached, list(cpu.free), cpu.copying, kv.pool.copying


@pytest.mark.parametrize(
    ("shared", "budget", "cpu_blocks", "in_flight"),
    [
        (False, 100, 64, False),
        (False, 5, 64, False),
        (False, 100, 6, False),
        (True, 100, 64, False),
        (True, 3, 64, False),
        (False, 100, 64, True),
    ],
)
def test_write_through_all_copies_what_one_by_one_copies(shared, budget, cpu_blocks, in_flight):
    """Written through together (one CPU allocation when no content is shared, one by one when
    some is): the same copies, block ids and tier state as `write_through` per request, within
    the shared budget and the tier's free blocks; a request's copies stop at a block an
    unfinished copy touches (`in_flight`: the second request's second block)."""
    states, results = [], []
    for together in (True, False):
        kv = KVCacheManager(64, BS, True, cpu_blocks)
        prompts = [[9, 9, 9, 9, 5, 5, 5, 5, i] if shared else [i] * 9 for i in range(1, 6)]
        reqs = [Request(f"r{i}", p, SamplingParams(), 0.0) for i, p in enumerate(prompts)]
        for req in reqs:
            assert kv.allocate(req, len(req.token_ids))
            req.num_computed_tokens = len(req.token_ids)
        if in_flight:
            kv.pool.copied([reqs[1].block_ids[1]], step=0)
        targets = [(r, r.num_computed_tokens) for r in reqs]
        if together:
            copied, copies = kv.write_through_all(targets, budget, step=1)
        else:
            copied, copies = [], []
            for req, complete in targets:
                if len(copies) >= budget:
                    break
                if own := kv.write_through(req, budget - len(copies), 1, complete):
                    copied.append(req)
                    copies += own
        results.append(([r.request_id for r in copied], copies))
        states.append(_tier_state(kv, reqs))
    assert results[0] == results[1] and states[0] == states[1]
    # shared: two blocks' content, once; in flight: the second request's second block and on wait
    assert len(results[0][1]) == min(budget, cpu_blocks, 2 if shared else 9 if in_flight else 10)
