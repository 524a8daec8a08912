"""One scheduling step: token budget, chunked prefill, rotation, preemption -> StepPlan.

The policy decides which running decodes to rotate out and the admission order; this module
carries it out with vLLM v1 mechanics. Every step:
1. rotate out the policy's choices (GPU -> CPU copies; recompute if the CPU tier is full);
2. serve running requests (a decode token, or the next chunk of a prefill); when one cannot get
   a block, the policy picks a victim, rotated out or preempted by recompute (tokens kept);
3. admit in the policy's order while the token budget, the sequence limit, the free blocks and the
   transfer budget allow: rotary requests are copied back in and decode in the same step, waiting
   ones prefill (in chunks when the budget is short). No admission in a step that preempted;
4. with the transfer budget left, write newly full blocks through to the CPU tier.
Blocks moved between tiers per step (out + in + write-through) never exceed the transfer budget.

Async scheduling: step t+1 may be planned before step t's sampled tokens are back. A request
then has a pending token: step t+1 feeds a PLACEHOLDER the runner fills from step t's result on
the device, and `update(t)` appends the real token later (even if the request was rotated out or
preempted meanwhile). A request whose pending token ends it by length is not scheduled again; one
that ends by EOS or a stop string wastes one token, dropped when its step completes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from superinfer.engine.core.kv import KVCacheManager
from superinfer.engine.core.plan import PLACEHOLDER, ScheduledSeq, StepPlan
from superinfer.engine.core.policies import FCFSPolicy, Policy
from superinfer.engine.core.request import FinishReason, Request, RequestStatus
from superinfer.engine.core.step_time import StepShape, StepTimeModel


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    transfer_budget_blocks: int = 2400
    write_through: bool = True  # copy full blocks to the CPU tier as they fill (else only on rotation)

    def __post_init__(self) -> None:
        if (
            self.max_num_seqs < 1
            or self.max_num_batched_tokens < 1
            or self.max_model_len < 2
            or self.transfer_budget_blocks < 1
        ):
            raise ValueError(f"invalid scheduler limits: {self}")


@dataclass
class SchedulerCounters:
    """Monotonic counters; the metrics layer exports their increments."""

    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    # The same preemptions by (mode, reason): swap for "policy" (chosen to rotate out) or
    # "gpu_full" (out of GPU blocks mid-step); recompute for "gpu_full" (no rotation possible),
    # "cpu_full" (the CPU tier had no room) or "transfer_budget" (the copies exceed a step's budget).
    preemption_reasons: dict[tuple[str, str], int] = field(default_factory=dict)
    rotations: int = 0

    def preempted(self, mode: str, reason: str) -> None:
        self.preemptions[mode] += 1
        key = (mode, reason)
        self.preemption_reasons[key] = self.preemption_reasons.get(key, 0) + 1


@dataclass
class _Step:
    """What one schedule() call is building."""

    id: int
    now: float
    budget: int
    transfer_left: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)  # the request of each seq
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out_after: int = 0  # see StepPlan
    swap_in_after: int = 0
    swap_in_after_copy: int = 0
    preempted: bool = False
    start_pos: dict[str, int] = field(default_factory=dict)  # tokens with final KV before this step


class Scheduler:
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
        self.rotary: list[Request] = []
        self.counters = SchedulerCounters()
        self._released: list[str] = []
        self._step_id = 0
        self._submitted: dict[int, tuple[list[Request], float]] = {}  # step id -> (request of each seq, planned at)
        self.step_time = StepTimeModel()
        self._t_last_update = -float("inf")

    # --- requests in and out -------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already live")
        self.check_fits(req.num_prompt_tokens, req.sampling.max_tokens)
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

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def ends_after_pending(self, req: Request) -> bool:
        """Its pending tokens end it by length: scheduling it again would only waste a step."""
        return req.ends_after_pending(self.config.max_model_len)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_rotary(self) -> int:
        return len(self.rotary)

    # --- what requests need --------------------------------------------------------------
    def next_tokens(self, req: Request) -> int:
        """Tokens the request would compute next step (a decode token, or its whole remaining prefill)."""
        return req.num_scheduled_tokens - req.num_computed_tokens

    def admission_cost(self, req: Request) -> tuple[int, int]:
        """(free GPU blocks taken, blocks copied in) for a non-running request to be admitted and
        finish its next step."""
        if req.status is RequestStatus.ROTARY:
            return self.kv.swap_in_need(req, self.next_tokens(req))
        return self.kv.admission_need(req), 0

    # --- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._step_id += 1
        self.kv.pool.begin_step()
        step = _Step(
            self._step_id, self.clock(), self.config.max_num_batched_tokens, self.config.transfer_budget_blocks
        )
        decision = self.policy.decide(self, step.now)
        if decision.token_budget is not None:
            step.budget = min(step.budget, decision.token_budget)
        for req in decision.rotate_out:
            if not self._rotate_out(req, step, "policy"):
                break  # the CPU tier or the transfer budget is full: the rest keep running
        self._serve_running(step)
        if not step.preempted:
            self._admit(decision.admit, step, decision.strict_order)
        if self.config.write_through and self.policy.uses_cpu_tier and self.kv.cpu is not None:
            self._write_through(step)
        self._submitted[step.id] = (step.requests, step.now)
        released, self._released = self._released, []
        return StepPlan(
            step_id=step.id,
            seqs=step.seqs,
            swap_out=step.swap_out,
            swap_in=step.swap_in,
            swap_out_after=step.swap_out_after,
            swap_in_after=step.swap_in_after,
            swap_in_after_copy=step.swap_in_after_copy,
            compute_after_copy=self.kv.pool.copy_fence_taken,
            released=released,
        )

    def _serve_running(self, step: _Step) -> None:
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            if self.ends_after_pending(req):
                i += 1
                continue
            n = min(self.next_tokens(req), step.budget)
            while not self.kv.allocate(req, n):
                victim = self.policy.victim(self.running[i:], step.now)
                self._evict(victim, step)
                step.preempted = True
                if victim is req:
                    break
            else:
                self._take(req, n, step)
                i += 1

    def _admit(self, order: list[Request], step: _Step, strict: bool) -> None:
        """Admit in `order`; a request that does not fit stops admission (strict FCFS order) or
        is skipped for the ones after it."""
        for req in order:
            if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if req.num_pending_tokens:
                continue  # left the GPU while its last step was in flight: back once that completes
            if req.status is RequestStatus.ROTARY:
                n = self.next_tokens(req)
                blocks, copies = self.kv.swap_in_need(req, n)
                if copies > self.config.transfer_budget_blocks:
                    self.rotary.remove(req)  # it could never come back within a step's budget
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
                self.rotary.remove(req)
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
            self._take(req, n, step)

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """The step has completed (compute and copies): apply its sampled tokens and retire its
        quarantine. Returns the requests that got a token or finished.

        A request that was rotated out or preempted since the step was planned still gets its
        token; one that finished since (abort, stop string, EOS) drops it."""
        now = self.clock()
        requests, planned_at = self._submitted.pop(plan.step_id)
        if plan.seqs:
            # With async scheduling the step was planned while the one before it still ran.
            context = sum(seq.context_len for seq in plan.seqs)
            self.step_time.observe(StepShape(plan.num_tokens, context), now - max(planned_at, self._t_last_update))
        self._t_last_update = now
        touched = []
        for req, seq in zip(requests, plan.seqs, strict=True):
            if seq.sample:
                req.num_pending_tokens -= 1
            if req.is_finished:
                continue
            if req.status is RequestStatus.RUNNING:
                self.kv.commit_full_blocks(req, seq.start_pos, seq.context_len)
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
            reason = req.stop_reason(self.config.max_model_len)
            if reason is not None:
                self._finish(req, reason)
            touched.append(req)
        self.kv.retire(plan.step_id)
        return touched

    # --- helpers ---------------------------------------------------------------------------
    def _take(self, req: Request, n: int, step: _Step) -> None:
        start = req.num_computed_tokens
        req.num_computed_tokens += n
        req.step_before_last, req.last_step = req.last_step, step.id
        step.budget -= n
        step.start_pos[req.request_id] = start
        token_ids = req.token_ids[start : start + n]
        token_ids += [PLACEHOLDER] * (n - len(token_ids))
        sample = req.num_computed_tokens == req.num_scheduled_tokens
        step.seqs.append(
            ScheduledSeq(
                request_id=req.request_id,
                token_ids=token_ids,
                start_pos=start,
                block_ids=list(req.block_ids),
                sample=sample,
                sampling=req.sampling,
                banned_token_ids=req.banned_token_ids() if sample else (),
            )
        )
        step.requests.append(req)
        if sample:
            req.num_pending_tokens += 1

    def _write_through(self, step: _Step) -> None:
        """Copy the running requests' newly full blocks to the CPU tier, within the transfer
        budget. When the budget or the tier's free blocks cannot take them all, the policy's
        likeliest next rotation victims go first: rotating one out then copies only its tail."""
        order: list[Request] = []
        done: dict[str, int] = {}  # tokens with final KV before this step
        total = 0
        for req in self.running:
            complete = step.start_pos.get(req.request_id, req.num_computed_tokens)
            n = self.kv.unwritten_blocks(req, complete)
            if n > 0:
                order.append(req)
                done[req.request_id] = complete
                total += n
        if len(order) > 1 and total > min(step.transfer_left, self.kv.cpu.num_free):
            order = self.policy.rotation_order(order, step.now)
        for req in order:
            if step.transfer_left <= 0:
                break
            copies = self.kv.write_through(req, step.transfer_left, step.id, done[req.request_id])
            if copies:  # blocks full before this step: written by the request's compute before it
                written = req.step_before_last if req.last_step == step.id else req.last_step
                step.swap_out_after = max(step.swap_out_after, written)
            step.swap_out += copies
            step.transfer_left -= len(copies)

    def _rotate_out(self, req: Request, step: _Step, reason: str) -> bool:
        """Move a running decode to the CPU tier, if the tier and the transfer budget can take it."""
        if step.transfer_left < self.kv.swap_out_cost(req):
            return False
        copies = self.kv.swap_out(req, step.id)
        if copies is None:
            return False
        step.swap_out_after = max(step.swap_out_after, req.last_step)
        self.running.remove(req)
        step.swap_out += copies
        step.transfer_left -= len(copies)
        req.status = RequestStatus.ROTARY
        req.num_rotations += 1
        self.counters.rotations += 1
        self.counters.preempted("swap", reason)
        self.rotary.append(req)
        return True

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
            self.rotary.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._released.append(req.request_id)
