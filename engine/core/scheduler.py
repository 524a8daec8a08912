"""One scheduling step: token budget, chunked prefill, preemption -> StepPlan.

vLLM v1 semantics: every step first serves the running requests (a decode token, or the next
chunk of a prefill), then admits waiting requests in order while the token budget, the sequence
limit and the free blocks allow. A prefill larger than the remaining budget is split into chunks
across steps; decodes and prefill chunks share one step. When a running request cannot get a
block, the policy picks a victim to preempt by recompute (blocks freed, tokens kept, prefilled
again later), and no waiting request is admitted in that step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from superinfer.engine.core.kv import KVCacheManager
from superinfer.engine.core.plan import ScheduledSeq, StepPlan
from superinfer.engine.core.policies import FCFSPolicy
from superinfer.engine.core.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(f"invalid scheduler limits: {self}")


@dataclass
class SchedulerCounters:
    """Monotonic counters; the metrics layer exports their increments."""

    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    rotations: int = 0
    steps: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        policy: FCFSPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy or FCFSPolicy()
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()
        self._released: list[str] = []
        self._step_id = 0

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
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        now = self.clock()
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, n):
                victim = self.policy.victim(self.running[i:])
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                seqs.append(self._take(req, n))
                budget -= n
                i += 1

        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            cached = self.kv.cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate(req, n, cached):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            req.t_run = now
            if req.t_scheduled is None:
                req.t_scheduled = now
                req.num_cached_tokens = num_cached
            self.running.append(req)
            seqs.append(self._take(req, n))
            budget -= n

        self._step_id += 1
        self.counters.steps += 1
        released, self._released = self._released, []
        return StepPlan(step_id=self._step_id, seqs=seqs, released=released)

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that got a token or finished."""
        now = self.clock()
        touched = []
        for seq in plan.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            self.kv.commit_full_blocks(req, seq.start_pos)
            if not seq.sample:
                continue
            req.append_token(sampled[seq.request_id])
            if req.t_first_token is None:
                req.t_first_token = now
            req.t_last_token = now
            reason = req.stop_reason(self.config.max_model_len)
            if reason is not None:
                self._finish(req, reason)
            touched.append(req)
        return touched

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """End a live request from outside (e.g. a stop string matched in its text)."""
        req = self.requests.get(request_id)
        if req is not None:
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            self._finish(req, reason)

    # --- helpers ---------------------------------------------------------------------------
    def _take(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        req.num_computed_tokens += n
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.token_ids[start : start + n],
            start_pos=start,
            block_ids=list(req.block_ids),
            sample=req.num_computed_tokens == req.num_tokens,
            sampling=req.sampling,
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.counters.preemptions["recompute"] += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._released.append(req.request_id)
