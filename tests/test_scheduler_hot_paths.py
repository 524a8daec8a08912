"""The scheduler's hot paths plan exactly what the straightforward code they replaced planned.

At thousands of live requests the scheduler serves plain decodes with vector operations over
its running batch's columns, writes through only the requests that filled a block (for many at
once), applies tokens in an inlined update, computes the TBT guard in one pass and ranks running
and non-running requests apart. Under overload it also checks whether a rotary request fits
without looking its blocks up (the pool's hashes in use), looks one by one only at the rotary
requests whose TBT is not lost, and ranks only the patient requests that fit. The reference
(`tests/reference_scheduler.py`, and the reference policy below) is the code before those changes
(one request and one block lookup at a time, every non-running request ranked); both run the same seeded random traces
(arrivals with shared prefixes, stop tokens, min_tokens, aborts, async steps, memory and CPU-tier
contention, every policy) and must produce identical plans and request states at every step.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import random
from collections import Counter

import numpy as np
import pytest

from superinfer.engine.core import policies, scheduler
from superinfer.engine.core.block_pool import UNHASHED, BlockPool, block_hashes
from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.policies import (
    MIN_PREFILL_CHUNK,
    RESIDENCY_SHARE,
    STALL_DUE_SHARE,
    STALL_URGENT_SHARE,
    Decision,
    FCFSPolicy,
    RotaryParams,
    RotaryPolicy,
    TBTGuard,
    WatermarkPolicy,
    by_arrival,
    virtual_lag_time,
)
from superinfer.engine.core.ranking_columns import RankingColumns
from superinfer.engine.core.request import FinishReason, Request, RequestStatus, SamplingParams
from superinfer.engine.core.running_batch import RunningBatch
from superinfer.engine.core.scheduler import ROWS_PER_VECTOR, Scheduler, SchedulerConfig
from superinfer.engine.core.step_time import StepShape
from superinfer.engine.slo import SLO
from tests.reference_scheduler import ReferenceScheduler
from tests.test_core import tokens_for


def reference_tbt_guard(sched: Scheduler, now: float, headroom: float) -> TBTGuard | None:
    model = sched.step_time
    if not model.ready:
        return None
    streaming = [*sched.running, *sched.rotary, *(r for r in sched.waiting if r.t_first_token is not None)]
    live = [
        r
        for r in streaming
        if not r.tbt_missed and not (r.t_last_token is not None and (now - r.t_last_token) * 1000 > r.slo.tbt_ms)
    ]
    if not live:
        return None
    kv, d = sched.kv, len(live)
    turn = headroom * min(r.slo.tbt_ms for r in live) / 1000.0
    tokens = sum(r.num_tokens for r in live)
    fit = max(1, min(sched.config.max_num_seqs, kv.num_blocks * d // max(1, kv.blocks_for(tokens) + d)))

    def gap(num_live: int) -> float:
        n = min(num_live, fit)
        return model.predict(StepShape(n, n * tokens // d)) * num_live / n

    if gap(1) > turn:
        return None
    new = [r for r in sched.waiting if r.t_first_token is None]
    allowed = 0
    overdue = not all(
        now < r.t_last_token + r.slo.tbt_ms * (headroom / 1000.0) for r in live if r.t_last_token is not None
    )
    if not overdue:
        allowed = bisect.bisect_right(range(1, len(new) + 1), turn, key=lambda k: gap(d + k))
    step_s = turn * min(d, fit) / d
    budget = model.tokens_within(step_s, sum(r.num_tokens for r in sched.running))
    residency = RESIDENCY_SHARE * turn * max(1.0, fit / (d - fit)) if d > fit else math.inf
    return TBTGuard(allowed, max(budget, len(sched.running) + MIN_PREFILL_CHUNK), residency, overdue)


def reference_rank_key(r: Request, now: float, p: RotaryParams) -> tuple[int, int, bool, float, float]:
    """(not due, -priority, SLO lost, -VLT); a started stream off the GPU past its due point
    first, by when its stall budget runs out, then by arrival."""
    stall_s = r.slo.stall_budget_ms / 1000.0
    off_gpu = r.status is not RequestStatus.RUNNING
    if off_gpu and r.t_last_token is not None and now >= r.t_last_token + STALL_DUE_SHARE * stall_s:
        return 0, 0, False, r.t_last_token + stall_s, r.arrival_time
    lost = now > r.arrival_time + r.slo.ttft_ms / 1000.0 if off_gpu and r.t_first_token is None else r.tbt_missed
    return 1, -r.priority, lost, -virtual_lag_time(r, now, p), 0.0


class ReferenceRotaryPolicy(RotaryPolicy):
    def decide(self, sched: Scheduler, now: float) -> Decision:
        kv, p = sched.kv, self.params
        guard = reference_tbt_guard(sched, now, p.tbt_headroom) if p.slo_admission else None
        off_gpu = [*sched.rotary, *(r for r in sched.waiting if r.t_first_token is not None)]
        due = any(now >= r.t_last_token + STALL_DUE_SHARE * r.slo.stall_budget_ms / 1000.0 for r in off_gpu)
        ttft_lost = any(
            r.t_first_token is None and now > r.arrival_time + r.slo.ttft_ms / 1000.0 for r in sched.waiting
        )
        # New requests of the off-GPU streams' top priority or below wait while one is due, or any
        # is off once a queued request lost its TTFT.
        hold = max(r.priority for r in off_gpu) if off_gpu and p.slo_admission and (due or ttft_lost) else None
        waiting = list(sched.waiting)
        new = [r for r in waiting if r.t_first_token is None]
        held = {id(r) for r in new if hold is not None and r.priority <= hold}
        if guard is not None:
            deadline = {id(r): r.arrival_time + r.slo.ttft_ms / 1000.0 for r in new}
            unheld = [r for r in new if id(r) not in held]
            by_slack = sorted(unheld, key=lambda r: (deadline[id(r)] < now, deadline[id(r)]))
            held |= {id(r) for r in by_slack[guard.new_requests :]}
        waiting = [r for r in waiting if id(r) not in held]
        stall_hold = hold is not None and bool(held)
        budget = guard.token_budget if guard is not None else None
        residency = max(p.min_residency_s, guard.residency_s if guard is not None else 0.0)
        others = [*waiting, *by_arrival(sched.rotary)]
        free = kv.num_free_blocks - sum(kv.growth_blocks(r, sched.next_tokens(r)) for r in sched.running)
        costs: dict[str, tuple[int, int]] = {}

        def cost(r: Request) -> tuple[int, int]:
            if r.request_id not in costs:
                costs[r.request_id] = sched.admission_cost(r)
            return costs[r.request_id]

        total = 0
        for r in others:
            total += cost(r)[0]
            if total > free:
                break
        else:
            return Decision(
                admit=by_arrival(others), token_budget=budget, held=len(held), guard=guard, stall_hold=stall_hold
            )

        candidates = [*sched.running, *others]
        keys = {r.request_id: reference_rank_key(r, now, p) for r in candidates}
        ranked = sorted(candidates, key=lambda r: keys[r.request_id])
        left = free + p.transfer_budget_blocks
        xfer_left = p.transfer_budget_blocks
        admit, patient = [], []
        for r in ranked:
            if r.status is RequestStatus.RUNNING:
                continue
            not_due, _, lost, neg_vlt, _ = keys[r.request_id]
            if not_due and (neg_vlt >= 0 or lost):
                patient.append(r)
                continue
            if left <= 0 or xfer_left <= 0:
                continue
            n, copies = cost(r)
            if n <= left and (copies <= xfer_left or copies > p.transfer_budget_blocks):
                admit.append(r)
                left -= n
                xfer_left -= copies
        to_free = p.transfer_budget_blocks - left
        first = ranked[0] if ranked else None  # due ones first, the earliest deadline first
        urgent_s = STALL_URGENT_SHARE * first.slo.stall_budget_ms / 1000.0 if first is not None else 0.0
        if first is not None and keys[first.request_id][0] == 0 and now >= first.t_last_token + urgent_s:
            residency = min(residency, p.min_residency_s)
        rotate_out = []
        for r in reversed(ranked):
            if to_free <= 0:
                break
            if self._may_rotate_out(sched, r, now, residency):
                rotate_out.append(r)
                to_free -= kv.owned_blocks(r)
        return Decision(
            rotate_out,
            admit + patient,
            strict_order=False,
            token_budget=budget,
            held=len(held),
            guard=guard,
            stall_hold=stall_hold,
        )


# --- the same random trace through both ------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def policy_pair(kind: str, gpu_blocks: int, xfer: int):
    if kind == "fcfs":
        return FCFSPolicy(), FCFSPolicy()
    if kind == "watermark":
        return WatermarkPolicy(max(1, gpu_blocks // 10)), WatermarkPolicy(max(1, gpu_blocks // 10))
    params = RotaryParams(
        transfer_budget_blocks=xfer,
        slo_admission=kind != "rotary-no-guard",
        min_residency_s=0.05 if kind == "rotary-residency" else 0.0,
    )
    return RotaryPolicy(params), ReferenceRotaryPolicy(params)


def plan_digest(plan: StepPlan) -> tuple:
    seqs = [
        (q.request_id, tuple(q.token_ids), q.start_pos, tuple(q.block_ids), q.sample, q.sampling, q.banned_token_ids)
        for q in sorted(plan.all_seqs(), key=lambda q: q.request_id)
    ]
    return (
        plan.step_id,
        seqs,
        tuple(plan.swap_out),
        tuple(plan.swap_in),
        plan.swap_out_after,
        plan.swap_in_after,
        tuple(sorted(plan.released)),
        plan.num_tokens,
    )


def token_gaps(r: Request, flush: bool) -> list[float]:
    """The request's token_gaps: read as users do (emptying its batch tail into the list), or put
    together from its list and the tail, leaving the tail as it is."""
    b = r._batch
    if flush or b is None:
        return r.token_gaps
    return r._token_gaps + b.gap_tail[r._slot, : b.tail_gaps[r._slot]].tolist()


def token_ids(r: Request, flush: bool) -> list[int]:
    """The request's token_ids, read as token_gaps (above)."""
    b = r._batch
    if flush or b is None:
        return r.token_ids
    return r._token_ids + b.token_tail[r._slot, : b.tail_tokens[r._slot]].tolist()


def state_digest(s: Scheduler, flush: bool = True) -> tuple:
    def req(r: Request) -> tuple:
        return (
            r.request_id,
            r.status,
            token_ids(r, flush),
            r.num_computed_tokens,
            r.num_pending_tokens,
            r.block_ids,
            r.cpu_block_ids,
            r.cpu_tail,
            r.last_step,
            r.step_before_last,
            token_gaps(r, flush),
            r.max_gap_s,
            r.t_first_token,
            r.t_last_token,
            r.finish_reason,
        )

    return (
        [req(r) for r in s.running],
        [req(r) for r in s.waiting],
        [req(r) for r in s.rotary],
        s.kv.num_free_blocks,
        s.kv.cpu.num_free if s.kv.cpu else None,
        s.counters,
        s.step_time.coefficients(),
    )


POLICIES = ["fcfs", "watermark", "rotary", "rotary-no-guard", "rotary-residency"]


def run_both(seed: int, rows_per_vector: int = ROWS_PER_VECTOR) -> Scheduler:
    """Run trace `seed` through the scheduler and the reference, checking every step; returns the
    scheduler. `rows_per_vector` 0: every scan and update in columns, however few its rows."""
    rng = random.Random(seed)
    kind = POLICIES[seed % len(POLICIES)]
    bs, gpu_blocks = rng.choice([4, 8, 16]), rng.randint(8, 120)
    cpu_blocks = rng.choice([3, 20, 400]) if kind in ("watermark", "rotary") else rng.choice([0, 3, 20, 400])
    xfer = rng.choice([4, 16, 2400])
    config = SchedulerConfig(
        rng.choice([4, 16, 64]),
        rng.choice([16, 64, 512]),
        rng.choice([64, 256]),
        xfer,
        write_through=rng.random() < 0.8,
    )
    prefix_caching = rng.random() < 0.8
    clocks = Clock(), Clock()
    fast_policy, ref_policy = policy_pair(kind, gpu_blocks, xfer)
    fast = Scheduler(config, KVCacheManager(gpu_blocks, bs, prefix_caching, cpu_blocks), fast_policy, clocks[0])
    fast.rows_per_vector = rows_per_vector
    fast.batch = RunningBatch(tail=(1, 3, 64)[seed % 3])  # tokens and gaps a slot holds before the lists get them
    ref = ReferenceScheduler(config, KVCacheManager(gpu_blocks, bs, prefix_caching, cpu_blocks), ref_policy, clocks[1])
    both = (fast, ref)
    in_flight_limit = rng.choice([0, 1])  # synchronous, or async scheduling (one step in flight)
    flush = seed // len(POLICIES) // 2 % 2 == 1  # the checks read token_gaps (else peek at the batch's tails)
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    in_flight: list[list[StepPlan]] = []
    handed_out: list[tuple[StepPlan, tuple]] = []
    eos, next_id = 2, 0

    def tick(dt: float) -> None:
        for clock in clocks:
            clock.now += dt

    for _ in range(rng.randint(30, 200)):
        tick(rng.choice([0.001, 0.01, 0.03, 0.2]))
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 5])):
            prompt = rng.choice(prefixes)[: rng.randint(0, 40)] + [
                rng.randrange(3, 50) for _ in range(rng.randint(1, 30))
            ]
            max_tokens = rng.randint(1, 40)
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=0,
                min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.3 else 0,
                ignore_eos=rng.random() < 0.3,
                stop_token_ids=(rng.randrange(3, 50),) if rng.random() < 0.3 else (),
            )
            slo = SLO(ttft_ms=rng.choice([50, 500, 5000]), tbt_ms=rng.choice([5, 50, 500]))
            priority = rng.choice([0, 0, 1])
            cls = ("interactive", "batch", "interactive")[next_id % 3]  # (metrics group gaps by it)
            for s in both:
                req = Request(f"q{next_id}", list(prompt), sampling, s.clock(), frozenset({eos}), slo, priority, cls)
                with contextlib.suppress(ValueError):  # larger than the pool
                    s.add(req)
            next_id += 1
        if fast.requests and rng.random() < 0.05:
            rid, stop = rng.choice(sorted(fast.requests)), rng.random() < 0.5
            for s in both:
                s.finish(rid, FinishReason.STOP) if stop else s.abort(rid)
        plans = [s.schedule() for s in both]
        assert plan_digest(plans[0]) == plan_digest(plans[1])
        handed_out.append((plans[0], plan_digest(plans[0])))
        in_flight.append(plans)
        while len(in_flight) > in_flight_limit:
            plans = in_flight.pop(0)
            tick(rng.choice([0.0, 0.002, 0.02]))
            sampled = {rid: rng.choice([eos, 7, 8, 9, 9, rng.randrange(3, 50)]) for rid in plans[0].sampled_ids()}
            fast_tokens = tokens_for(plans[0], sampled)  # as a list, or as the runner hands them over
            fast_tokens = np.array(fast_tokens, dtype=np.int64) if seed // len(POLICIES) % 2 else fast_tokens
            touched = fast.update(plans[0], fast_tokens)
            assert sorted(r.request_id for r in touched) == sorted(r.request_id for r in ref.update(plans[1], sampled))
            check_token_timing(fast, touched, flush)
            check_new_tokens(fast, touched, flush)
        assert state_digest(fast, flush) == state_digest(ref)
        check_swap_in_index(fast)
        check_running_batch(fast, flush)
    # Plans share block tables with their requests: none changed after it was handed out.
    assert all(plan_digest(plan) == digest for plan, digest in handed_out)
    return fast


def check_token_timing(s: Scheduler, touched: list[Request], flush: bool) -> None:
    """What the update timed for the metrics: the first token of the requests that have no gap
    yet, and the newest gap of every other request that got a token."""
    gaps = {r.request_id: token_gaps(r, flush) for r in touched}
    assert sorted(r.request_id for r in s.token_timing.first) == sorted(rid for rid, g in gaps.items() if not g)
    timed: dict[str, list[float]] = {}
    for r in touched:
        if gaps[r.request_id]:
            timed.setdefault(r.slo_class, []).append(gaps[r.request_id][-1])
    assert {cls: sorted(np.asarray(g).tolist()) for cls, g in s.token_timing.gaps().items()} == {
        cls: sorted(g) for cls, g in timed.items()
    }


def check_new_tokens(s: Scheduler, touched: list[Request], flush: bool) -> None:
    """What the update hands the engine for its outputs: each request's new token and output
    length, as its token list has them (read as users do, or peeked at)."""
    tokens = [token_ids(r, flush) for r in touched]
    assert s.new_tokens.tokens == [t[-1] for t in tokens]
    assert s.new_tokens.num_output == [len(t) - len(r.prompt_token_ids) for r, t in zip(touched, tokens, strict=True)]


def check_swap_in_index(s: Scheduler) -> None:
    """What admission reads instead of looking at every rotary request: the hashes in use, those of
    the swapped-out requests' blocks, and the rotary requests apart by whether their TBT is lost."""
    pool = s.kv.pool
    assert pool.in_use == {h for h, b in pool.cached.items() if pool.ref_cnt[b] > 0}
    # Unhashed blocks (finished requests' output) are free, each in the one live run that names it.
    unhashed = [b for b in range(pool.num_blocks) if pool.hash_of[b] is UNHASHED]
    assert sorted(pool.unhashed) == unhashed and all(pool.ref_cnt[b] == 0 for b in unhashed)
    runs = [run for runs in pool.unhashed_after.values() for run in runs]
    assert sorted(b for run in runs for b in run.blocks if b >= 0) == unhashed
    assert all(run.live == sum(b >= 0 for b in run.blocks) > 0 for run in runs)
    assert s.kv.swapped_out == set(s.rotary)
    watched = Counter(h for r in s.rotary for h in r.block_hashes[: len(r.cpu_block_ids)])
    assert pool.watched == watched and pool.watched_in_use == len(pool.in_use & watched.keys())
    assert pool.watched_twice == sum(n > 1 for n in watched.values())
    assert s.rotary_on_time == [r for r in s.rotary if not r.tbt_missed]
    assert s.rotary_lost == [r for r in s.rotary if r.tbt_missed]
    for cols, requests, order in (
        (s.rotary_columns, s.rotary_on_time, s.rotary_columns.in_arrival_order),
        (s.waiting_columns, list(s.waiting), s.waiting_columns.in_queue_order),
    ):  # the ranking fields, current and in the lists' order
        slots = order().tolist()
        assert [cols.requests[k] for k in slots] == requests
        for k, r in zip(slots, requests, strict=True):
            t_last = math.nan if r.t_last_token is None else r.t_last_token
            assert (cols.max_gap[k], cols.num_tokens[k], cols.priority[k]) == (r.max_gap_s, r.num_tokens, r.priority)
            assert cols.t_last[k] == t_last or (math.isnan(cols.t_last[k]) and math.isnan(t_last))
            assert (cols.arrival[k], cols.ttft_ms[k], cols.tbt_ms[k]) == (r.arrival_time, r.slo.ttft_ms, r.slo.tbt_ms)
            if cols is s.rotary_columns:
                assert cols.blocks[k] == s.kv.blocks_for(r.num_scheduled_tokens)
                assert cols.copies[k] == s.kv.swap_in_copies_bound(r)


def check_running_batch(s: Scheduler, flush: bool = True) -> None:
    """The running batch holds exactly the running requests, in order, and what it mirrors of
    each is current; the others keep their counters in themselves."""
    b = s.batch
    assert b.order.tolist() == [r._slot for r in s.running] and all(r._batch is b for r in s.running)
    for r in s.running:
        slot = r._slot
        assert b.requests[slot] is r
        assert 0 <= b.tail_gaps[slot] < b.gap_tail.shape[1] and 0 <= b.tail_tokens[slot] < b.token_tail.shape[1]
        assert b.slo_classes[b.slo_class[slot]] == r.slo_class
        mirrored = (b.num_tokens[slot], b.last_token[slot], b.nblocks[slot], b.written[slot], b.limit[slot])
        tokens = token_ids(r, flush)
        assert mirrored == (len(tokens), tokens[-1], len(r.block_ids), len(r.cpu_block_ids), r.length_limit)
        assert b.tbt_ms[slot] == r.slo.tbt_ms
        assert (b.priority[slot], b.t_run[slot]) == (r.priority, r.t_run)
    assert all(r._batch is None for r in [*s.waiting, *s.rotary])
    assert b.blocks_written() == sum(min(len(r.cpu_block_ids), len(r.block_ids)) for r in s.running)
    assert b.stop_counts == Counter(t for r in s.running for t in r.stop_token_set)
    assert sorted(b.stop_tokens) == sorted(b.stop_counts)


SEEDS = range(40)


@pytest.mark.parametrize("rows_per_vector", [0, ROWS_PER_VECTOR], ids=["columns", "rows-when-few"])
@pytest.mark.parametrize("seed", SEEDS)
def test_hot_paths_plan_what_the_reference_plans(seed, rows_per_vector):
    run_both(seed, rows_per_vector)


def test_the_traces_reach_the_paths_that_matter(monkeypatch):
    """Rotation, preemption by recompute and TBT-guarded steps (some holding new requests as a
    streaming one waited its whole turn, some for the started ones off the GPU) all happen in
    these traces, and so do lookups that hash a released request's output blocks, those blocks
    handed out unhashed, and swapped-out requests that share content with another (their hashes
    watched twice)."""
    guards = []
    real_guard = policies.tbt_guard
    monkeypatch.setattr(policies, "tbt_guard", lambda *args: guards.append(real_guard(*args)) or guards[-1])
    copy_outs = []  # of the output-blocks path: whether a copy in flight was in its way
    real_outputs = KVCacheManager.write_through_outputs

    def write_through_outputs(kv: KVCacheManager, *args: object) -> tuple[list[Request], list[tuple[int, int]]]:
        copy_outs.append(bool(kv.pool.copying))
        return real_outputs(kv, *args)

    monkeypatch.setattr(KVCacheManager, "write_through_outputs", write_through_outputs)
    hashed_late, left_runs = [], []  # unhashed output blocks: hashed for a lookup, handed out
    real_hash_runs, real_leave_run = KVCacheManager._hash_runs_after, BlockPool._leave_run
    monkeypatch.setattr(
        KVCacheManager, "_hash_runs_after", lambda *args: hashed_late.append(real_hash_runs(*args)) or hashed_late[-1]
    )
    monkeypatch.setattr(BlockPool, "_leave_run", lambda *args: left_runs.append(real_leave_run(*args)))
    shared_watch, real_unwatch = [], BlockPool.unwatch  # whether another swapped-out request shares a hash

    def unwatch(pool: BlockPool, hashes: list[bytes]) -> None:
        shared_watch.append(pool.watched_twice > 0)
        real_unwatch(pool, hashes)

    monkeypatch.setattr(BlockPool, "unwatch", unwatch)
    schedulers = [run_both(seed) for seed in SEEDS]
    assert sum(s.counters.rotations for s in schedulers) > 30
    assert sum(s.counters.stall_held_steps for s in schedulers) >= 3  # held as a started stream was off the GPU
    assert sum(s.counters.preemptions["recompute"] for s in schedulers) > 20
    assert sum(g is not None for g in guards) > 100
    assert sum(s.counters.guard_overdue_steps for s in schedulers) >= 3  # held as a token came late
    assert copy_outs.count(True) >= 3 and copy_outs.count(False) >= 3
    assert hashed_late.count(True) >= 10 and len(left_runs) >= 50
    assert shared_watch.count(True) >= 10 and shared_watch.count(False) >= 10


def test_the_traces_reach_a_scan_that_reuses_the_last_ones_look(monkeypatch):
    """After an eviction from the end of the running order (fcfs), the next vector scan starts
    from the previous scan's classification: the traces get there, and plan as the reference."""
    reused = []
    real_rows = scheduler._Classified.rows
    monkeypatch.setattr(scheduler._Classified, "rows", lambda *args: reused.append(real_rows(*args)) or reused[-1])
    for seed in SEEDS[:15]:
        run_both(seed, rows_per_vector=0)
    assert sum(r is not None for r in reused) > 3


def watch_scans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """For each vector scan from now on: the rows it evicted, and whether one was its last row."""
    scans = []
    real_rows = scheduler.Scheduler._decode_rows

    def decode_rows(self: Scheduler, slots: np.ndarray, *args: object) -> None:
        evicted = args[-2]
        scans.append((len(evicted), len(slots) - 1 in evicted))
        real_rows(self, slots, *args)

    monkeypatch.setattr(scheduler.Scheduler, "_decode_rows", decode_rows)
    return scans


def test_the_traces_evict_within_a_scan_and_scan_on(monkeypatch):
    """A row that finds no free block and is itself the policy's victim is evicted within the
    vector scan, which goes on after it (sometimes past the last row): the traces get there, and
    plan as the reference."""
    scans = watch_scans(monkeypatch)
    for seed in SEEDS[:15]:
        run_both(seed, rows_per_vector=0)
    assert sum(n > 0 for n, _ in scans) > 20
    assert any(last for _, last in scans)


def test_a_scan_evicts_row_after_row_as_the_reference_does(monkeypatch):
    """Requests admitted together all begin a block in the same step with none free: the rotary
    policy's victim is each time the row that found none (the longest running; the first on a
    tie), whose full block, written through already, frees one (its tail is being copied out):
    the next row takes it and the one after is evicted, and so on. One scan evicts every other
    row, and plans what the reference plans, step after step."""
    scans = watch_scans(monkeypatch)
    bs, n = 4, 12
    config = SchedulerConfig(64, 512, 256, 2400)
    both = [
        cls(config, KVCacheManager(2 * n, bs, True, 400), policy, Clock())
        for cls, policy in zip((Scheduler, ReferenceScheduler), policy_pair("rotary", 2 * n, 2400), strict=True)
    ]
    both[0].rows_per_vector = 0
    for s in both:
        for k in range(n):
            prompt = [3 + k, 4, 5, 6, 7]  # two blocks each: the pool is full
            s.add(Request(f"q{k}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), 0.0))
    for _ in range(6):
        plans = [s.schedule() for s in both]
        assert plan_digest(plans[0]) == plan_digest(plans[1])
        for s in both:
            s.clock.now += 0.01
        both[0].update(plans[0], [7] * plans[0].num_sampled)
        both[1].update(plans[1], dict.fromkeys(plans[1].sampled_ids(), 7))
        assert state_digest(both[0]) == state_digest(both[1])
    assert (n // 2, False) in scans


def test_the_traces_rank_many_waiting_and_rotary_requests_in_columns(monkeypatch):
    """With every path in columns, the rotary policy ranks the waiting and the on-time rotary
    requests in their columns, ties and all: lagging ones of both together, with the rotary ones'
    blocks asked one by one while some swapped-out content is in use, and with new requests held
    back by the TBT guard; the first ranked ones that fit are admitted at once; the plans stay the
    reference's."""
    seen, held = [], []
    real_ranked, real_unheld = policies._lagging_ranked, policies._unheld_waiting

    def unheld_waiting(sched: Scheduler, *args: object) -> tuple:
        waiting, slots, num_held = real_unheld(sched, *args)
        held.append(num_held if slots is not None else 0)
        return waiting, slots, num_held

    def lagging_ranked(sched: Scheduler, *args: object) -> tuple:
        ranked, blocks, bounds, patient = real_ranked(sched, *args)
        rotary = [r.status is RequestStatus.ROTARY for r in ranked]
        num_waiting = len(ranked) - sum(rotary)
        seen.append((sum(rotary), num_waiting, int(np.count_nonzero(blocks < 0)) - num_waiting))
        return ranked, blocks, bounds, patient

    at_once, real_at_once = [], policies._admitted_at_once

    def admitted_at_once(blocks: np.ndarray, *args: int) -> int:
        at_once.append((real_at_once(blocks, *args), len(blocks)))
        return at_once[-1][0]

    monkeypatch.setattr(policies, "_lagging_ranked", lagging_ranked)
    monkeypatch.setattr(policies, "_unheld_waiting", unheld_waiting)
    monkeypatch.setattr(policies, "_admitted_at_once", admitted_at_once)
    for seed in SEEDS:
        run_both(seed, rows_per_vector=0)
    # Some at once, the rest in the loop: rare since no new request starts while a rotary one waits.
    assert sum(0 < first < ranked for first, ranked in at_once) >= 2
    assert sum(rotary > 1 for rotary, _, _ in seen) > 50
    assert sum(rotary > 0 and waiting > 0 for rotary, waiting, _ in seen) > 10
    assert sum(asked > 0 for _, _, asked in seen) > 3
    assert sum(n > 0 for n in held) > 10


def test_block_hashes_chain_each_block_to_the_one_before():
    """Hashing many blocks in one call gives what hashing them one at a time gives, and a block's
    hash depends on every token before it."""
    tokens = list(range(1000, 1012))
    at_once = block_hashes(b"", tokens, 4)
    one_by_one = [b""]
    for i in range(3):
        one_by_one += block_hashes(one_by_one[-1], tokens[4 * i : 4 * i + 4], 4)
    assert at_once == one_by_one[1:] and len(set(at_once)) == 3
    assert block_hashes(b"", [9, *tokens[1:]], 4)[2] != at_once[2]
    assert block_hashes(b"", tokens[:7], 4) == at_once[:1]  # a partial block has no hash


@pytest.mark.parametrize("release", ["finish", "rotate_out"])
def test_blocks_a_decode_fills_are_findable_once_the_request_releases_them(release):
    """A block a decode row fills joins the prefix cache when its request releases it, as far
    as the completed steps wrote it: while the request runs (its output is nobody else's
    prefix yet) and beyond its last completed decode row (a step still in flight writes it),
    a lookup does not find it. (A finished request's are hashed only when a lookup reaches them:
    here, a request whose prompt continues its output.)"""
    bs = 4
    kv = KVCacheManager(16, bs, num_cpu_blocks=16)
    req = Request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=16), 0.0)
    assert kv.allocate(req, 5)
    req.num_computed_tokens = 5
    kv.commit_full_blocks(req, 0, 5)  # the prompt's full block: findable at once
    req.token_ids.extend([1, 2, 3, 4, 5, 6, 7])  # decoded: blocks 1 and 2 are full
    assert kv.allocate(req, 7)
    req.num_computed_tokens = 12
    kv.filled([req], [1])  # the step that filled block 1 is done; block 2's still runs

    def found() -> list[int]:
        follower = Request("f", [*req.token_ids, 42], SamplingParams(max_tokens=1), 0.0)
        return kv.cached_prefix(follower)

    assert found() == [req.block_ids[0]]
    blocks = req.block_ids
    if release == "finish":
        kv.free(req)
    else:
        assert kv.swap_out(req, step=1) is not None
        kv.retire(1)  # its copies are done
    assert found() == [blocks[0], blocks[1]]
    assert req.decoded_blocks == 0


def test_write_through_indexes_prompt_blocks_only_and_waits_for_copies_in_flight():
    """Output blocks go to the CPU tier without a content lookup or an index entry (nobody
    else's prefix while the request runs); a block an unfinished copy touches (a copy-in may
    still write it) is not copied, nor its request rotated out, until that copy's step retires."""
    kv = KVCacheManager(16, 2, num_cpu_blocks=16)
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=16), 0.0)
    assert kv.allocate(req, 3)
    req.num_computed_tokens = 3
    req.token_ids.extend([8, 9, 10, 11])  # 7 tokens: block 0 of the prompt, blocks 1 and 2 with output
    assert kv.allocate(req, 4)
    req.num_computed_tokens = 7
    blocks = req.block_ids
    kv.pool.copied([req.block_ids[2]], step=1)  # step 1 copies into its third block
    assert kv.write_through(req, budget=8, step=2) == list(zip(req.block_ids[:2], req.cpu_block_ids, strict=True))
    assert [kv.cpu.hash_of[b] is not None for b in req.cpu_block_ids] == [True, False]
    assert kv.cpu.lookup(kv.update_hashes(req)[0]) == req.cpu_block_ids[0]
    assert kv.swap_out(req, step=2) is None
    kv.retire(1)
    copies = kv.swap_out(req, step=3)
    assert copies is not None and [g for g, _ in copies] == blocks[2:]  # the third block, then the tail


def test_output_blocks_in_one_pass_copy_what_the_general_path_copies():
    """`write_through_outputs` (a step's newly full blocks all output blocks, within the budget)
    plans the copies `write_through_all` plans, and stops a request's copies at a block an
    unfinished copy touches."""

    def prepared() -> tuple[KVCacheManager, list[Request]]:
        kv = KVCacheManager(32, 2, num_cpu_blocks=32)
        reqs = []
        for i in range(3):
            req = Request(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], SamplingParams(max_tokens=16), 0.0)
            req.token_ids.extend([8, 9, 10, 11, 12])  # 8 tokens: the prompt's block, then 3 output blocks
            assert kv.allocate(req, 8)
            req.num_computed_tokens = 8
            assert kv.write_through(req, budget=1, step=1) != []  # the prompt's block is in the tier
            reqs.append(req)
        kv.pool.copied([reqs[1].block_ids[2]], step=2)  # a copy in flight into r1's third block
        return kv, reqs

    kv, reqs = prepared()
    general = kv.write_through_all([(r, 8) for r in reqs], budget=64, step=3)
    kv2, reqs2 = prepared()
    fast = kv2.write_through_outputs([(r, 1, 3) for r in reqs2], step=3)
    assert [r.request_id for r in fast[0]] == [r.request_id for r in general[0]] == ["r0", "r1", "r2"]
    assert fast[1] == general[1]
    assert [len(r.cpu_block_ids) for r in reqs2] == [len(r.cpu_block_ids) for r in reqs] == [4, 2, 4]
    assert all(kv2.cpu.hash_of[b] is None for r in reqs2 for b in r.cpu_block_ids[1:])
    assert kv2.cpu.copying == kv.cpu.copying and kv2.pool.copying == kv.pool.copying


def test_ranking_columns_keep_the_lists_order_and_fields():
    """Slots in `rotary_on_time`'s order (arrival, then the order added) or the waiting queue's
    (added at the front first), freed slots reused, a landed token refreshed, a rebuild in the
    given order."""
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(), arrival_time=t) for i, t in enumerate([2.0, 1.0, 2.0, 0.5])]
    cols = RankingColumns(capacity=2)  # grows on the third

    def ids(slots: np.ndarray) -> list[str]:
        return [cols.requests[k].request_id for k in slots.tolist()]

    for r in reqs:
        cols.add(r, blocks=3, copies=2)
    assert ids(cols.in_arrival_order()) == ["r3", "r1", "r0", "r2"]
    cols.remove(reqs[0])
    cols.add(reqs[0], blocks=4, copies=1)  # back later: after r2, its tie on arrival
    assert ids(cols.in_arrival_order()) == ["r3", "r1", "r2", "r0"]
    assert len(cols) == 4 and cols.blocks[cols.slot_of[reqs[0]]] == 4
    cols.remove(reqs[3])
    cols.add(reqs[3], first=True)  # the queue's front
    assert ids(cols.in_queue_order()) == ["r3", "r1", "r2", "r0"]
    reqs[1].token_ids.append(9)
    reqs[1].t_last_token, reqs[1].max_gap_s = 5.0, 0.25
    cols.refresh(reqs[1])
    k = cols.slot_of[reqs[1]]
    assert (cols.t_last[k], cols.max_gap[k], cols.num_tokens[k]) == (5.0, 0.25, 4)
    assert math.isnan(cols.t_last[cols.slot_of[reqs[2]]])  # no token yet
    cols.rebuild([reqs[2], reqs[3]], [(1, 1), (2, 2)])
    assert ids(cols.in_arrival_order()) == ["r3", "r2"] and reqs[0] not in cols and reqs[1] not in cols


@pytest.mark.parametrize("distinct", [3, 20], ids=["compared", "isin"])
def test_stop_candidates_are_the_running_requests_stop_tokens(distinct):
    """RunningBatch.may_stop: a token that may stop any running request, counted as requests
    come and go (a few EOS ids are compared one by one, many stop ids go through np.isin)."""
    rng = random.Random(distinct)
    batch = RunningBatch()
    reqs = []
    for i in range(30):
        stops = tuple(rng.sample(range(100, 100 + distinct), rng.randint(0, 3)))
        req = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4, stop_token_ids=stops), 0.0, frozenset({7}))
        req.t_run = 0.0
        batch.add(req)
        reqs.append(req)
    for leaving in rng.sample(reqs, 12):
        batch.remove(leaving)
        reqs.remove(leaving)
    union = {t for r in reqs for t in r.stop_token_set}
    assert batch.stop_counts == Counter(t for r in reqs for t in r.stop_token_set)
    tokens = np.array([rng.randrange(0, 100 + distinct) for _ in range(500)] + sorted(union))
    assert batch.may_stop(tokens).tolist() == [t in union for t in tokens.tolist()]
    for req in reqs:
        batch.remove(req)
    assert batch.stop_counts == {} and not batch.may_stop(tokens).any()


def test_a_running_requests_new_tokens_wait_in_its_slot_until_read_full_or_it_stops_running():
    """Decode rows' tokens go into the slot's tail (one numpy write for all rows); the request's
    token list gets them when the tail is full, when something reads the list and when the
    request leaves the batch, in order, and the engine's view (`new_tokens`) matches it."""
    s = Scheduler(SchedulerConfig(8, 64, 64), KVCacheManager(32, 4, True))
    s.rows_per_vector = 0  # every update in columns, however few its rows
    s.batch = RunningBatch(tail=3)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0), 0.0) for i in range(2)]
    for req in reqs:
        s.add(req)
    step = 0

    def decode(n: int) -> None:
        nonlocal step
        for _ in range(n):
            step += 1
            plan = s.schedule()
            assert s.update(plan, [10 * step + k for k in range(plan.num_sampled)]) == reqs
            assert s.new_tokens.tokens == [10 * step, 10 * step + 1]

    decode(1)  # the prefill samples the first tokens (no tail), and the next two go into the tail
    decode(2)
    r0, r1 = reqs
    assert (s.batch.tail_tokens[r0._slot], len(r0._token_ids)) == (2, 4)
    assert r0.token_ids == [1, 2, 3, 10, 20, 30] and s.batch.tail_tokens[r0._slot] == 0  # reading emptied it
    decode(1)  # the third token fills r1's tail: it moves into the list at once
    assert (s.batch.tail_tokens[r1._slot], r1._token_ids) == (0, [1, 2, 3, 11, 21, 31, 41])
    assert s.new_tokens.num_output == [4, 4] and r0.num_tokens == 7
    with pytest.raises(RuntimeError, match="only through the scheduler"):
        r0.token_ids = [1, 2, 3]
    s.abort("r0")  # leaving the batch empties the tail
    assert r0._batch is None and r0._token_ids == [1, 2, 3, 10, 20, 30, 40]


def test_plans_of_the_same_decodes_share_their_columns_and_read_again_only_the_tables_that_grew():
    s = Scheduler(SchedulerConfig(8, 64, 64), KVCacheManager(32, 4, True))
    s.rows_per_vector = 0  # every scan in columns, however few its rows
    sampling = SamplingParams(max_tokens=20, temperature=0)
    reqs = [Request(f"r{i}", [1, 2, 3, 4][: 2 + i], sampling, 0.0) for i in range(3)]
    for req in reqs:
        s.add(req)
    s.update(plan := s.schedule(), [5] * plan.num_sampled)  # the prefills
    plans = []
    for _ in range(4):
        plans.append(plan := s.schedule())
        assert plan.decodes.block_ids == [r.block_ids for r in reqs]
        s.update(plan, [5] * plan.num_sampled)
    for before, after in itertools.pairwise(plans):
        assert after.decodes.request_ids is before.decodes.request_ids
        tables = list(zip(before.decodes.block_ids, after.decodes.block_ids, strict=True))
        assert [a is not b for a, b in tables] == [len(a) != len(b) for a, b in tables]  # only the grown read again
    assert [len(t) for t in plans[0].decodes.block_ids] != [len(t) for t in plans[-1].decodes.block_ids]
    s.abort("r1")  # another set of rows: gathered afresh
    plan = s.schedule()
    assert plan.decodes.request_ids == ["r0", "r2"] and plan.decodes.block_ids == [reqs[0].block_ids, reqs[2].block_ids]
