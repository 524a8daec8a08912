"""The straightforward scheduler that the engine's hot paths must plan exactly like.

A frozen copy of `engine/core/scheduler.py` as it was before its hot paths (inlined decode loops,
write-through of only the requests that filled a block, decode state in columns, ...), written
for clarity: one request at a time, one block lookup at a time, everything ranked. The hot-path
tests run the same random traces through both and compare every plan and every request's state.
It needs no RunningBatch: its requests keep their counters in themselves.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.plan import PLACEHOLDER, DecodeRows, ScheduledSeq, StepPlan
from superinfer.engine.core.policies import FCFSPolicy, Policy, RotaryPolicy, virtual_lag_time
from superinfer.engine.core.request import FinishReason, Request, RequestStatus
from superinfer.engine.core.scheduler import WRITE_THROUGH_FREE_SHARE, SchedulerConfig, SchedulerCounters
from superinfer.engine.core.step_time import StepShape, StepTimeModel

_arrival = attrgetter("arrival_time")


def reference_victim(policy: Policy, candidates: list[Request], now: float) -> Request:
    """The running request that gives up its blocks when another finds none: rotary's smallest
    VLT (the longest running, the first on a tie), the others' most recently admitted."""
    if isinstance(policy, RotaryPolicy):
        return min(candidates, key=lambda r: virtual_lag_time(r, now, policy.params))
    return candidates[-1]


def _remove_sorted(requests: list[Request], req: Request) -> None:
    """Remove `req` from a list in arrival order, looked for from its arrival's first place on."""
    del requests[requests.index(req, bisect.bisect_left(requests, req.arrival_time, key=_arrival))]


@dataclass(frozen=True)
class _Submitted:
    """What update() needs of a planned step."""

    requests: list[Request]  # the request of each seq
    decoded: list[Request]  # the request of each decode row
    planned_at: float
    shape: StepShape


@dataclass
class _Step:
    """What one schedule() call is building."""

    id: int
    now: float
    budget: int
    transfer_left: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)  # the request of each seq
    # Plain decodes, in rows: their token and position now, the other columns once planned.
    decoded: list[Request] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    decode_starts: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out_after: int = 0  # see StepPlan
    swap_in_after: int = 0
    swap_in_after_copy: int = 0
    preempted: bool = False
    writes_through: bool = False  # full blocks are copied to the CPU tier as they fill
    # Tokens with final KV before this step, of the requests that may have blocks to write through.
    start_pos: dict[str, int] = field(default_factory=dict)
    filled: list[Request] = field(default_factory=list)  # a block of theirs fills in this step


class ReferenceScheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy or FCFSPolicy()
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rotary: list[Request] = []  # in arrival order (rotated out earlier first on ties)
        # The same apart, in the same order, by whether their TBT SLO is lost (Request.tbt_missed):
        # under overload most are, and the rotary policy only looks at the others one by one.
        self.rotary_on_time: list[Request] = []
        self.rotary_lost: list[Request] = []
        # Free GPU blocks each rotary request takes to come back while no swapped-out content is
        # in use (kv.swap_in_blocks); 0 for one whose copies may exceed the transfer budget (that
        # one goes to the exact check). Under overload most rotary requests cannot fit, each step:
        # this skips them without a look at their blocks.
        self._swap_in_blocks: dict[Request, int] = {}
        self.counters = SchedulerCounters()
        self._released: list[str] = []
        self._step_id = 0
        self._submitted: dict[int, _Submitted] = {}
        # Running requests that may have full blocks not yet written through to the CPU tier.
        self._unwritten: set[Request] = set()
        self.step_time = StepTimeModel()
        self._t_last_update = -float("inf")

    # --- requests in and out -------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already live")
        self.check_fits(req.num_prompt_tokens, req.sampling.max_tokens)
        req.length_limit = min(req.length_limit, self.config.max_model_len)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject what could never finish: past the context length, or larger than the pool."""
        limit = self.config.max_model_len
        if num_prompt_tokens >= limit:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens; this model's maximum context length "
                f"is {limit} tokens, including at least one output token"
            )
        total = min(num_prompt_tokens + max_tokens, limit)
        if self.kv.blocks_for(total) > self.kv.num_blocks:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs more KV "
                f"cache than this server has ({self.kv.num_blocks * self.kv.block_size} tokens)"
            )

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, FinishReason.ABORT)
        return req

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """End a live request from outside (e.g. a stop string matched in its text)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, reason)

    # --- what requests need --------------------------------------------------------------
    def next_tokens(self, req: Request) -> int:
        """Tokens the request would compute next step (a decode token, or its whole remaining prefill)."""
        return req.num_scheduled_tokens - req.num_computed_tokens

    def admission_blocks(self, req: Request) -> int:
        """Free GPU blocks a non-running request takes to be admitted and finish its next step."""
        if req.status is RequestStatus.ROTARY:
            return self.kv.swap_in_blocks(req, self.next_tokens(req))
        return self.kv.admission_need(req)

    def admission_copies(self, req: Request) -> int:
        """Blocks copied in to admit a non-running request (a rotary one)."""
        return self.kv.swap_in_copies(req) if req.status is RequestStatus.ROTARY else 0

    # --- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._step_id += 1
        self.kv.pool.begin_step(self._step_id)
        step = _Step(
            self._step_id, self.clock(), self.config.max_num_batched_tokens, self.config.transfer_budget_blocks
        )
        step.writes_through = self.config.write_through and self.policy.uses_cpu_tier and self.kv.cpu is not None
        decision = self.policy.decide(self, step.now)
        capped = decision.token_budget is not None and decision.token_budget < step.budget
        if capped:
            step.budget = decision.token_budget
        self.counters.guard_held_steps += decision.held > 0
        self.counters.guard_overdue_steps += decision.held > 0 and decision.guard is not None and decision.guard.overdue
        self.counters.stall_held_steps += decision.held > 0 and decision.stall_hold
        for req in decision.rotate_out:
            if not self._rotate_out(req, step, "policy"):
                break  # the CPU tier or the transfer budget is full: the rest keep running
        self._serve_running(step)
        if not step.preempted:
            self._admit(decision.admit, step, decision.strict_order)
            if decision.patient:
                self._admit_patient(decision.patient, step)
        self.counters.guard_capped_steps += capped and step.budget <= 0
        for r in [*self.rotary, *(r for r in self.waiting if r.t_first_token is not None)]:
            t_last = r.t_last_token
            if t_last is not None and t_last != r.t_overrun_from and (step.now - t_last) * 1000 > r.slo.stall_budget_ms:
                r.t_overrun_from = r.t_last_token
                r.stall_overruns += 1
                self.counters.stall_overruns += 1
        if step.writes_through:
            self._write_through(step)
            self._unwritten.update(step.filled)  # their blocks are final once this step ran
        released, self._released = self._released, []
        decoded = step.decoded
        plan = StepPlan(
            step_id=step.id,
            seqs=step.seqs,
            decodes=DecodeRows(
                [r.request_id for r in decoded],
                step.decode_tokens,
                step.decode_starts,
                [r.block_ids for r in decoded],
                [r.sampling for r in decoded],
                [r.prompt_token_ids for r in decoded],
            ),
            swap_out=step.swap_out,
            swap_in=step.swap_in,
            swap_out_after=step.swap_out_after,
            swap_in_after=step.swap_in_after,
            swap_in_after_copy=step.swap_in_after_copy,
            compute_after_copy=self.kv.pool.copy_fence_taken,
            released=released,
        )
        shape = StepShape(plan.num_tokens, plan.num_context_tokens)
        self._submitted[step.id] = _Submitted(step.requests, decoded, step.now, shape)
        return plan

    def _admit_patient(self, requests: list[Request], step: _Step) -> None:
        """Admit the patient requests into what is left, best first, without looking at the
        rotary ones the free blocks cannot hold: under overload most of them, each step. Such a
        one never fits this step: admitting others shrinks the free blocks by at least what it
        shrinks its need (a free block is taken for each of its blocks brought into use). So
        they are left out before ranking, and again after each admission."""
        pool, need = self.kv.pool, self._swap_in_blocks
        if not pool.watched_in_use:  # (`need` is exact only then)
            free = pool.num_free
            requests = [r for r in requests if need.get(r, 0) <= free]

        def may_fit(req: Request) -> bool:
            return pool.watched_in_use > 0 or need.get(req, 0) <= pool.num_free

        self._admit(filter(may_fit, self.policy.rank(requests, step.now)), step, strict=False)

    def _rotate_out(self, req: Request, step: _Step, reason: str) -> bool:
        """Move a running decode to the CPU tier, if the tier and the transfer budget can take it."""
        if step.transfer_left < self.kv.swap_out_cost(req):
            return False
        copies = self.kv.swap_out(req, step.id)
        if copies is None:
            return False
        step.swap_out_after = max(step.swap_out_after, req.last_step)
        self.running.remove(req)
        self._unwritten.discard(req)
        step.swap_out += copies
        step.transfer_left -= len(copies)
        req.status = RequestStatus.ROTARY
        req.num_rotations += 1
        self.counters.rotations += 1
        self.counters.preempted("swap", reason)
        bisect.insort(self.rotary, req, key=_arrival)
        bisect.insort(self.rotary_lost if req.tbt_missed else self.rotary_on_time, req, key=_arrival)
        may_copy = len(req.cpu_block_ids) + (req.cpu_tail is not None)
        fits = may_copy <= self.config.transfer_budget_blocks
        # kv.swap_in_blocks(req, self.next_tokens(req)) while none of its content is in use
        self._swap_in_blocks[req] = self.kv.blocks_for(req.num_scheduled_tokens) if fits else 0
        return True

    def _leave_rotary(self, req: Request) -> None:
        _remove_sorted(self.rotary, req)
        _remove_sorted(self.rotary_lost if req in self.rotary_lost else self.rotary_on_time, req)
        del self._swap_in_blocks[req]

    def _split_rotary(self) -> None:
        """A rotary request lost its TBT SLO (its pending token came late): rare, so split again."""
        self.rotary_on_time = [r for r in self.rotary if not r.tbt_missed]
        self.rotary_lost = [r for r in self.rotary if r.tbt_missed]

    def _evict(self, req: Request, step: _Step) -> None:
        """A running request must give up its blocks (another ran out): rotate it to the CPU tier
        if the policy uses one and it fits, else preempt it by recompute (blocks freed, tokens kept)."""
        reason = "gpu_full"
        if self.policy.uses_cpu_tier and req.in_decode:
            if self._rotate_out(req, step, "gpu_full"):
                return
            reason = "transfer_budget" if step.transfer_left < self.kv.swap_out_cost(req) else "cpu_full"
        self.running.remove(req)
        self._recompute(req, reason)

    def _recompute(self, req: Request, reason: str) -> None:
        """Drop the request's KV in both tiers; it waits at the front and is prefilled again
        (its tokens are kept, and its blocks still cached on the GPU are found again)."""
        self.kv.free(req)
        self._unwritten.discard(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.counters.preempted("recompute", reason)
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.ROTARY:
            self._leave_rotary(req)
        self.kv.free(req)
        self._unwritten.discard(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._released.append(req.request_id)

    def _serve_running(self, step) -> None:
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            if req.ends_after_pending():
                i += 1
                continue
            n = min(self.next_tokens(req), step.budget)
            while not self.kv.allocate(req, n):
                victim = reference_victim(self.policy, self.running[i:], step.now)
                self._evict(victim, step)
                step.preempted = True
                if victim is req:
                    break
            else:
                self._take(req, n, step)
                i += 1

    def _take(self, req: Request, n: int, step) -> None:
        start = req.num_computed_tokens
        req.num_computed_tokens += n
        req.step_before_last, req.last_step = req.last_step, step.id
        step.budget -= n
        token_ids = req.token_ids[start : start + n]
        token_ids += [PLACEHOLDER] * (n - len(token_ids))
        sample = req.num_computed_tokens == req.num_scheduled_tokens
        banned = req.banned_token_ids() if sample else ()
        if n == 1 and sample and not req.sampling.min_tokens:  # the plan's format: a decode row
            step.decode_tokens.append(token_ids[0])
            step.decode_starts.append(start)
            step.decoded.append(req)
        else:
            step.seqs.append(
                ScheduledSeq(
                    req.request_id,
                    token_ids,
                    start,
                    list(req.block_ids),
                    sample,
                    req.sampling,
                    banned,
                    req.prompt_token_ids,
                )
            )
            step.requests.append(req)
        if sample:
            req.num_pending_tokens += 1

    def _write_through(self, step) -> None:
        pressed = self.kv.num_free_blocks <= WRITE_THROUGH_FREE_SHARE * self.kv.num_blocks
        waiting_need = sum(self.kv.blocks_for(r.num_tokens) for r in self.waiting)
        if not (pressed or waiting_need > self.kv.num_free_blocks or self.rotary):
            return
        start_pos = {seq.request_id: seq.start_pos for seq in step.seqs}
        start_pos |= {req.request_id: start for req, start in zip(step.decoded, step.decode_starts, strict=True)}
        order: list[Request] = []
        done: dict[str, int] = {}
        total = 0
        for req in self.running:
            complete = start_pos.get(req.request_id, req.num_computed_tokens)
            n = self.kv.unwritten_blocks(req, complete)
            if n > 0:
                order.append(req)
                done[req.request_id] = complete
                total += n
        if len(order) > 1 and total > min(step.transfer_left, self.kv.cpu.num_free):
            order = self.policy.rotation_order(order, step.now)
        else:  # all fit: output blocks first, then those with prompt blocks (only block ids differ)
            bs = self.kv.block_size
            prompt = [r for r in order if len(r.cpu_block_ids) < len(r.prompt_token_ids) // bs]
            order = [r for r in order if r not in prompt] + prompt
        for req in order:
            if step.transfer_left <= 0:
                break
            copies = self.kv.write_through(req, step.transfer_left, step.id, done[req.request_id])
            if copies:
                written = req.step_before_last if req.last_step == step.id else req.last_step
                step.swap_out_after = max(step.swap_out_after, written)
            step.swap_out += copies
            step.transfer_left -= len(copies)

    def admission_cost(self, req: Request) -> tuple[int, int]:
        if req.status is RequestStatus.ROTARY:
            return reference_swap_in_need(self.kv, req, self.next_tokens(req))
        cached = self.kv.cached_prefix(req)
        return self.kv.blocks_for(req.num_tokens) - len(cached) + self.kv._free_taken(cached), 0

    def _admit(self, order: list[Request], step, strict: bool) -> None:
        for req in order:
            if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if req.num_pending_tokens:
                continue
            if req.status is RequestStatus.ROTARY:
                n = self.next_tokens(req)
                blocks, copies = reference_swap_in_need(self.kv, req, n)
                if copies > self.config.transfer_budget_blocks:
                    self._leave_rotary(req)
                    self._recompute(req, "transfer_budget")
            if req.status is RequestStatus.ROTARY:
                if n > step.budget or blocks > self.kv.num_free_blocks or copies > step.transfer_left:
                    if strict:
                        return
                    continue
                moved = self.kv.swap_in(req, n, step.id)
                step.swap_in += moved.copies
                step.swap_in_after = max(step.swap_in_after, moved.after_compute)
                step.swap_in_after_copy = max(step.swap_in_after_copy, moved.after_copy)
                step.transfer_left -= len(moved.copies)
                self._leave_rotary(req)
            else:
                cached = self.kv.cached_prefix(req)
                num_cached = len(cached) * self.kv.block_size
                n = min(req.num_tokens - num_cached, step.budget)
                if not self.kv.allocate(req, n, cached):
                    if strict:
                        return
                    continue
                self.waiting.remove(req)
                req.num_computed_tokens = num_cached
                if req.t_scheduled is None:
                    req.t_scheduled = step.now
                    req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.t_run = step.now
            self.running.append(req)
            if step.writes_through:
                self._unwritten.add(req)
            self._take(req, n, step)

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        now = self.clock()
        submitted = self._submitted.pop(plan.step_id)
        self.kv.retire(plan.step_id)
        seqs = plan.all_seqs()
        if seqs:
            context = sum(seq.context_len for seq in seqs)
            shape = StepShape(plan.num_tokens, context)
            self.step_time.observe(shape, now - max(submitted.planned_at, self._t_last_update))
        self._t_last_update = now
        touched = []
        for k, (req, seq) in enumerate(zip(submitted.requests + submitted.decoded, seqs, strict=True)):
            if seq.sample:
                req.num_pending_tokens -= 1
            if req.is_finished:
                continue
            if req.status is RequestStatus.RUNNING:
                if k < len(plan.seqs):
                    self.kv.commit_full_blocks(req, seq.start_pos, seq.context_len)
                elif seq.context_len % self.kv.block_size == 0:  # a decode row that filled its block
                    self.kv.filled([req], [seq.start_pos // self.kv.block_size])
            if not seq.sample:
                continue
            req.append_token(sampled[seq.request_id])
            if req.t_first_token is None:
                req.t_first_token = now
            else:
                gap = now - req.t_last_token
                req.token_gaps.append(gap)
                req.max_gap_s = max(req.max_gap_s, gap)
            req.t_last_token = now
            reason = req.stop_reason()
            if reason is not None:
                self._finish(req, reason)
            touched.append(req)
        return touched


def reference_swap_in_need(kv: KVCacheManager, req: Request, num_new_tokens: int) -> tuple[int, int]:
    """A lookup per full block: free blocks taken (all but those another request holds) and copies."""
    hashes = kv.update_hashes(req)
    taken = copies = 0
    for i in range(len(req.cpu_block_ids)):
        block = kv.pool.lookup(hashes[i])
        copies += block is None
        taken += block is None or kv.pool.ref_cnt[block] == 0
    copies += req.cpu_tail is not None
    return taken + kv.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.cpu_block_ids), copies
