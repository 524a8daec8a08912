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

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.plan import PLACEHOLDER, DecodeRows, ScheduledSeq, StepPlan
from superinfer.engine.core.policies import FCFSPolicy, Policy, TBTGuard
from superinfer.engine.core.ranking_columns import RankingColumns
from superinfer.engine.core.request import FinishReason, Request, RequestStatus, SamplingParams
from superinfer.engine.core.running_batch import ROWS_PER_VECTOR, RunningBatch
from superinfer.engine.core.step_time import StepShape, StepTimeModel
from superinfer.engine.core.token_timing import TokenTiming

log = logging.getLogger(__name__)
STALL_LOG_PERIOD_S = 10.0  # at most one log line this often about streams past their stall budget

_arrival = attrgetter("arrival_time")
# Full blocks are written through to the CPU tier only while less than this share of the GPU pool
# is free (or requests wait): see Scheduler._write_through.
WRITE_THROUGH_FREE_SHARE = 0.5


def _remove_sorted(requests: list[Request], req: Request) -> None:
    """Remove `req` from a list in arrival order, looked for from its arrival's first place on."""
    del requests[requests.index(req, bisect.bisect_left(requests, req.arrival_time, key=_arrival))]


class NewTokens(NamedTuple):
    """What an update gave the requests it returns, in their order: each one's new token, and
    its output tokens so far."""

    tokens: list[int]
    num_output: list[int]

    def add(self, token: int, num_output: int) -> None:
        self.tokens.append(token)
        self.num_output.append(num_output)


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


# Every (mode, reason) of a preemption: swap for "policy" (chosen to rotate out) or "gpu_full" (out
# of GPU blocks mid-step); recompute for "gpu_full" (no rotation possible), "cpu_full" (the CPU tier
# had no room) or "transfer_budget" (the copies exceed a step's budget).
PREEMPTION_KINDS = (
    ("swap", "policy"),
    ("swap", "gpu_full"),
    ("recompute", "gpu_full"),
    ("recompute", "cpu_full"),
    ("recompute", "transfer_budget"),
)


@dataclass
class SchedulerCounters:
    """Monotonic counters; the metrics layer exports their increments."""

    # Preemptions by (mode, reason), PREEMPTION_KINDS.
    preemption_reasons: dict[tuple[str, str], int] = field(default_factory=dict)
    rotations: int = 0
    # What the TBT guard (policies.tbt_guard) did: steps in which it kept new requests out of
    # admission, and steps that spent a token budget it had cut below the configured one.
    guard_held_steps: int = 0
    guard_overdue_steps: int = 0  # (of those, steps it held them all as a request had waited its turn)
    stall_held_steps: int = 0  # (of those, steps it held them for the started streams off the GPU)
    guard_capped_steps: int = 0
    # Started streams that waited off the GPU past their stall budget (note_stall_overruns): the
    # rotary policy could not bring them back in time (the pool too full of requests that have not
    # stayed the residency floor), or a recompute left them to wait their turn in the queue.
    stall_overruns: int = 0

    @property
    def preemptions(self) -> dict[str, int]:
        """Totals per mode."""
        totals = {"recompute": 0, "swap": 0}
        for (mode, _), n in self.preemption_reasons.items():
            totals[mode] += n
        return totals

    def by_reason(self) -> dict[str, float]:
        """Preemptions per mode and reason, for the benchmarks' reports: {"recompute_cpu_full": n, ...}."""
        return {f"{mode}_{reason}": float(n) for (mode, reason), n in sorted(self.preemption_reasons.items())}

    def preempted(self, mode: str, reason: str) -> None:
        key = (mode, reason)
        self.preemption_reasons[key] = self.preemption_reasons.get(key, 0) + 1


@dataclass(frozen=True)
class _Submitted:
    """What update() needs of a planned step."""

    requests: list[Request]  # the request of each seq
    decoded: list[Request]  # the request of each decode row
    decode_slots: np.ndarray  # their RunningBatch slots and the slots' generations when planned
    decode_gens: np.ndarray
    fill_rows: list[int]  # the decode rows that fill a block
    planned_at: float
    shape: StepShape


@dataclass(frozen=True)
class _DecodeColumns:
    """A plan's decode rows by column: their batch slots, the slots' generations and block
    counts then, and what the plan and its update read of their requests. Consecutive plans may
    share these lists (nobody changes them); a running request's block table is replaced, never
    grown, and its block count in the batch changes with it."""

    slots: np.ndarray
    gens: np.ndarray
    nblocks: np.ndarray
    requests: list[Request]
    request_ids: list[str]
    block_ids: list[list[int]]
    samplings: list[SamplingParams]
    prompts: list[list[int]]


@dataclass(frozen=True)
class _Classified:
    """What a scan found of running rows, in columns. Still true of the rows it stopped before,
    and they keep their places in `order`, until one of them is served: a row stopped a scan for
    want of a block, the general path served it (evicting from the end of the running order,
    `fcfs`'s victims) and the next scan starts after it."""

    first: int  # where order[0] stands in running order, less the rows the scan evicted (all before those it left)
    order: np.ndarray  # the batch slots it looked at
    computed: np.ndarray
    pending: np.ndarray
    decode: np.ndarray
    stops: np.ndarray  # but for the want of blocks
    needs_block: np.ndarray

    def rows(self, i: int, slots: np.ndarray) -> _Classified | None:
        """Itself for running[i:] (batch `slots`), if those rows still stand where it found them."""
        k, n = i - self.first, len(slots)
        if k < 0 or k + n > len(self.order) or not np.array_equal(slots, self.order[k : k + n]):
            return None
        cut = slice(k, k + n)
        return _Classified(
            i, slots, self.computed[cut], self.pending[cut], self.decode[cut], self.stops[cut], self.needs_block[cut]
        )


@dataclass
class _Step:
    """What one schedule() call is building."""

    id: int
    now: float
    budget: int
    transfer_left: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)  # the request of each seq
    # Plain decodes, in rows: their batch slots (in chunks, a scan's each), token and position
    # now, the other columns once planned.
    slot_chunks: list[np.ndarray | list[int]] = field(default_factory=list)
    fill_rows: list[int] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    decode_starts: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out_after: int = 0  # see StepPlan
    swap_in_after: int = 0
    swap_in_after_copy: int = 0
    preempted: bool = False
    writes_through: bool = False  # full blocks are copied to the CPU tier as they fill
    # Batch slot -> tokens with final KV before this step, of its seqs (its decode rows: all but one).
    seq_starts: dict[int, int] = field(default_factory=dict)
    classified: _Classified | None = None  # the last vector scan's look at the rows it did not serve

    def add_decode_row(self, slot: int, token: int, start: int, block_size: int) -> None:
        """A plain decode of the request in batch `slot`: feed `token` at position `start`."""
        self.add_decode_rows([slot], [token], [start], [0] if (start + 1) % block_size == 0 else [])

    def add_decode_rows(
        self, slots: np.ndarray | list[int], tokens: list[int], starts: list[int], fill_rows: list[int]
    ) -> None:
        """Plain decodes found by a scan (`fill_rows`: the indices among them that fill a block)."""
        first = len(self.decode_tokens)
        self.fill_rows += [first + k for k in fill_rows]
        self.slot_chunks.append(slots)
        self.decode_tokens += tokens
        self.decode_starts += starts

    def decode_slots(self) -> np.ndarray:
        """The batch slot of each decode row."""
        chunks = self.slot_chunks
        if len(chunks) == 1 and isinstance(chunks[0], np.ndarray):
            return chunks[0]
        return np.concatenate(chunks, dtype=np.int64) if chunks else np.zeros(0, dtype=np.int64)


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
        self.batch = RunningBatch()  # the running requests, their counters, in running order
        self.token_timing = TokenTiming()  # what the last update timed (for the metrics)
        self.new_tokens = NewTokens([], [])  # what the last update gave its requests (for the outputs)
        self._last_decode_columns: _DecodeColumns | None = None
        # Scans and updates of fewer rows go one row at a time: the decode hot path's in the
        # "small batches" section at the end of this class, the policies' in policies.py.
        self.rows_per_vector = ROWS_PER_VECTOR
        self.rotary: list[Request] = []  # in arrival order (rotated out earlier first on ties)
        # The same apart, in the same order, by whether their TBT SLO is lost (Request.tbt_missed):
        # under overload most are, and the rotary policy only looks at the others one by one.
        self.rotary_on_time: list[Request] = []
        self.rotary_lost: list[Request] = []
        # What the rotary policy ranks them by, in columns: `waiting`'s and `rotary_on_time`'s.
        self.waiting_columns = RankingColumns()
        self.rotary_columns = RankingColumns()
        # Free GPU blocks each rotary request takes to come back while no swapped-out content is
        # in use (kv.swap_in_blocks); 0 for one whose copies may exceed the transfer budget (that
        # one goes to the exact check). Under overload most rotary requests cannot fit, each step:
        # this skips them without a look at their blocks.
        self._swap_in_blocks: dict[Request, int] = {}
        self.counters = SchedulerCounters()
        self.last_guard: TBTGuard | None = None  # the TBT guard's view in the last step (step logs)
        self._released: list[str] = []
        self._step_id = 0
        self._submitted: dict[int, _Submitted] = {}
        self.step_time = StepTimeModel()
        self._t_last_update = -float("inf")
        self._t_stall_logged = -math.inf

    # --- requests in and out -------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already live")
        self.check_fits(req.num_prompt_tokens, req.sampling.max_tokens)
        req.length_limit = min(req.length_limit, self.config.max_model_len)
        if self.kv.enable_prefix_caching or self.kv.cpu is not None:
            self.kv.update_hashes(req)  # its prompt's blocks, now rather than in a step (as vLLM does)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.waiting_columns.add(req)

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

    @property
    def running(self) -> list[Request]:
        """The running requests, in running order (a new list: kept in the batch's `order`)."""
        return self.batch.requests[self.batch.order].tolist()

    @property
    def num_running(self) -> int:
        return len(self.batch.order)

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def known_swap_in_blocks(self) -> dict[Request, int]:
        return self._swap_in_blocks

    def guard_figures(self) -> dict[str, float]:
        """For the benchmarks' reports: the share of steps in which the TBT guard kept new requests
        out (of those, all because a streaming request had waited its whole turn, rather than the
        step-time model's prediction) or cut the token budget, and the step-time model it judges
        by (its coefficients, its mean error against the measured steps)."""
        steps = max(1, self._step_id)
        model = self.step_time
        base, per_token, per_kctx = model.coefficients() if model.ready else (math.nan,) * 3
        return {
            "guard_held_step_share": self.counters.guard_held_steps / steps,
            "guard_overdue_step_share": self.counters.guard_overdue_steps / steps,
            "stall_held_step_share": self.counters.stall_held_steps / steps,
            "stall_overruns": float(self.counters.stall_overruns),
            "guard_capped_step_share": self.counters.guard_capped_steps / steps,
            "step_model_ms": base * 1000.0,
            "step_model_ms_per_token": per_token * 1000.0,
            "step_model_ms_per_kctx": per_kctx * 1000.0,
            "step_model_error": model.relative_error,
        }

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

    def admission_blocks(self, req: Request) -> int:
        """Free GPU blocks a non-running request takes to be admitted and finish its next step."""
        if req.status is RequestStatus.ROTARY:  # (next_tokens, from its own fields: it is not running)
            return self.kv.swap_in_blocks(req, len(req._token_ids) + req._num_pending_tokens - req._num_computed_tokens)
        return self.kv.admission_need(req)

    def admission_copies(self, req: Request) -> int:
        """Blocks copied in to admit a non-running request (a rotary one)."""
        return self.kv.swap_in_copies(req) if req.status is RequestStatus.ROTARY else 0

    def admission_copies_bound(self, req: Request) -> int:
        """At least admission_copies, without looking at the GPU cache: every CPU block and tail."""
        return self.kv.swap_in_copies_bound(req) if req.status is RequestStatus.ROTARY else 0

    # --- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._step_id += 1
        self.kv.pool.begin_step(self._step_id)
        step = _Step(
            self._step_id, self.clock(), self.config.max_num_batched_tokens, self.config.transfer_budget_blocks
        )
        step.writes_through = self.config.write_through and self.policy.uses_cpu_tier and self.kv.cpu is not None
        decision = self.policy.decide(self, step.now)
        self.last_guard = decision.guard
        capped = decision.token_budget is not None and decision.token_budget < step.budget
        if capped:
            step.budget = decision.token_budget
        if decision.held:
            self.counters.guard_held_steps += 1
            # (all of them, as a streaming request had waited its whole turn)
            self.counters.guard_overdue_steps += decision.guard is not None and decision.guard.overdue
            self.counters.stall_held_steps += decision.stall_hold
        for req in decision.rotate_out:  # (out of the running order at once: a wave rotates out hundreds)
            if not self._rotate_out(req, step, "policy", reorder=False):
                break  # the CPU tier or the transfer budget is full: the rest keep running
        self.batch.reorder()
        self._serve_running(step)
        if not step.preempted:
            self._admit(decision.admit, step, decision.strict_order)
            if decision.patient:
                self._admit_patient(decision.patient, step)
        if capped and step.budget <= 0:
            self.counters.guard_capped_steps += 1
        if self.rotary or (self.waiting and self.waiting[0].num_preemptions):
            self.note_stall_overruns(step.now)
        if step.writes_through:
            self._write_through(step)
        released, self._released = self._released, []
        slots = step.decode_slots()
        rows = self._decode_columns(slots)
        plan = StepPlan(
            step_id=step.id,
            seqs=step.seqs,
            decodes=DecodeRows(
                rows.request_ids, step.decode_tokens, step.decode_starts, rows.block_ids, rows.samplings, rows.prompts
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
        self._submitted[step.id] = _Submitted(
            step.requests, rows.requests, slots, rows.gens, step.fill_rows, step.now, shape
        )
        return plan

    def note_stall_overruns(self, now: float) -> None:
        """Count each started stream still off the GPU after this step's admission whose stall
        budget has run out: once per wait, and say so in the log (at most every STALL_LOG_PERIOD_S).
        Those waiting again after a recompute are among the preempted ones at the front of the queue."""
        restarted = []
        for r in self.waiting:
            if not r.num_preemptions:
                break
            restarted.append(r)
        new = 0
        for r in (*self.rotary, *restarted):
            t_last = r._t_last_token
            if t_last is not None and t_last != r.t_overrun_from and (now - t_last) * 1000.0 > r.slo.stall_budget_ms:
                r.t_overrun_from = t_last
                r.stall_overruns += 1
                new += 1
        if new:
            self.counters.stall_overruns += new
            if now - self._t_stall_logged >= STALL_LOG_PERIOD_S:
                self._t_stall_logged = now
                log.warning(
                    "%d started streams waited off the GPU past their stall budget (%d in all)",
                    new,
                    self.counters.stall_overruns,
                )

    def _decode_columns(self, slots: np.ndarray) -> _DecodeColumns:
        """The decode rows' columns for the plan, gathered from the running batch; or, while the
        same requests decode in the same slots as in the last plan (a decode batch's steady
        state), that plan's, with only the block tables that grew since read again (worth its
        comparisons from a few dozen rows on)."""
        b, last = self.batch, self._last_decode_columns
        gens, nblocks = b.np_gen[slots], b.np_nblocks[slots]
        reuse = last is not None and len(slots) >= self.rows_per_vector
        if reuse and np.array_equal(slots, last.slots) and np.array_equal(gens, last.gens):
            tables = last.block_ids.copy()  # (the last plan keeps its own)
            for k in np.flatnonzero(nblocks != last.nblocks).tolist():
                tables[k] = last.requests[k].block_ids
            rows = _DecodeColumns(
                slots, gens, nblocks, last.requests, last.request_ids, tables, last.samplings, last.prompts
            )
        else:
            reqs = b.requests[slots].tolist()
            rows = _DecodeColumns(
                slots,
                gens,
                nblocks,
                reqs,
                b.request_ids[slots].tolist(),
                [r.block_ids for r in reqs],
                b.samplings[slots].tolist(),
                b.prompts[slots].tolist(),
            )
        self._last_decode_columns = rows
        return rows

    def _serve_running(self, step: _Step) -> None:
        b, kv = self.batch, self.kv
        i = self._serve_decodes(0, step)
        while i < len(b.order) and step.budget > 0:
            req = b.requests[b.order[i]]  # a prefill chunk, or a decode with no free block for it
            n = min(self.next_tokens(req), step.budget)
            while not kv.allocate(req, n):
                victim = self.policy.victim(self.batch, i, step.now)
                self._evict(victim, step)
                step.preempted = True
                if victim is req:
                    break
            else:
                self._take(req, n, step)
                i += 1
            i = self._serve_decodes(i, step)

    def _serve_decodes(self, i: int, step: _Step) -> int:
        """Serve running[i:] while they are decodes (one token, and a block for it), skipping
        those whose pending token ends them; returns where it stopped (a prefill chunk, no free
        block, or the token budget spent: the general path takes it, and evicts). The bulk of a
        step with thousands of running requests: vector operations over the running batch's
        columns, the row that stops them found first; the rows that begin a block get theirs in
        one allocation. Plain decodes become decode rows; one under min_tokens (tokens to ban) a
        ScheduledSeq of its own, so they do not stop the scan.

        A row that finds no free block and is itself the policy's victim (the rotary policy's,
        the longest running, is most often the first row without one) is evicted here, as the
        general path would, and the scan goes on after it: under memory contention a step evicts
        a few, each then costs one more look at the rows' columns, not a scan of its own. The
        rows served before and after it become decode rows at once, at the end."""
        b, budget = self.batch, step.budget
        slots = b.order[i:]
        if budget <= 0 or not len(slots):
            return i
        if len(slots) < self.rows_per_vector:
            return self._serve_decodes_by_row(i, slots.tolist(), step)
        bs = self.kv.block_size
        seen = step.classified.rows(i, slots) if step.classified is not None else None
        if seen is None:
            computed, pending = b.np_computed[slots], b.np_pending[slots]
            total = b.np_num_tokens[slots] + pending
            decode = (pending == 0) | (total < b.np_limit[slots])  # else Request.ends_after_pending: skipped
            stops = decode & (total - computed != 1)
            needs_block = decode & (computed >= b.np_nblocks[slots] * bs)
        else:  # a scan after the general path served the row that stopped the last one
            computed, pending, decode, stops, needs_block = (
                seen.computed,
                seen.pending,
                seen.decode,
                seen.stops,
                seen.needs_block,
            )
        start, evicted, total_served = 0, [], 0  # (start: where this segment of the rows begins)
        while True:
            free, needs = self.kv.num_free_blocks, needs_block[start:]
            ends = stops[start:]
            if np.count_nonzero(needs) > free:
                ends = ends | (np.cumsum(needs) > free)  # from the first one that finds no free block
            end = int(ends.argmax())
            if not ends[end]:
                end = len(ends)
            taken = decode[start : start + end]
            served = np.count_nonzero(taken)  # (count_nonzero: numpy's cheapest reduction)
            if served >= budget:  # the row that spends the last of it ends here
                end = int(np.cumsum(taken).searchsorted(budget)) + 1
                served = budget
            end += start
            grow = slots[start:end][needs_block[start:end]]
            if len(grow):
                self.kv.add_block_each(b.requests[grow].tolist())
                b.np_nblocks[grow] += 1
            budget -= served
            total_served += served
            if budget <= 0 or end == len(slots) or stops[end]:
                break
            req, position = b.requests[slots[end]], i + end - len(evicted)  # it has no free block
            if self.policy.victim(b, position, step.now) is not req:
                break
            self._evict(req, step)
            step.preempted = True
            evicted.append(end)
            start = end = end + 1
            if start == len(slots):
                break
        step.budget = budget
        # The next scan may start from this look at the rows it did not serve (those after `end`:
        # the evicted ones, all before it, moved them up).
        step.classified = (
            _Classified(i - len(evicted), slots, computed, pending, decode, stops, needs_block)
            if end < len(slots)
            else None
        )
        i += end - len(evicted)
        if total_served == len(slots):
            self._decode_rows(slots, computed, pending, step)
        elif total_served:
            rows = decode[:end].copy()  # the decodes served: the evicted ones aside
            rows[evicted] = False
            self._decode_rows(slots[:end][rows], computed[:end][rows], pending[:end][rows], step)
        return i

    def _decode_rows(self, rows: np.ndarray, starts: np.ndarray, was_pending: np.ndarray, step: _Step) -> None:
        """Make the decodes a scan served (batch slots `rows`, computing from `starts`) decode rows
        of the step, and count their tokens in the batch's columns."""
        b, bs = self.batch, self.kv.block_size
        tokens = np.where(was_pending > 0, PLACEHOLDER, b.np_last_token[rows])
        plain = b.np_plain[rows]
        if np.count_nonzero(plain) != len(plain):
            self._banned_rows(rows[~plain].tolist(), starts[~plain].tolist(), tokens[~plain].tolist(), step)
            rows, starts, tokens = rows[plain], starts[plain], tokens[plain]
        b.np_computed[rows] = starts + 1
        b.np_prev_step[rows] = b.np_last_step[rows]
        b.np_last_step[rows] = step.id
        b.np_pending[rows] += 1
        step.add_decode_rows(rows, tokens.tolist(), starts.tolist(), np.flatnonzero((starts + 1) % bs == 0).tolist())

    def _banned_rows(self, rows: list[int], starts: list[int], tokens: list[int], step: _Step) -> None:
        """The decodes under min_tokens among a scan's rows: a ScheduledSeq each, with the
        tokens it may not sample yet (as _take does)."""
        b = self.batch
        for slot, start, token in zip(rows, starts, tokens, strict=True):
            req = b.requests[slot]
            banned = req.banned_token_ids()  # before its pending token is counted
            b.computed[slot] = start + 1
            b.prev_step[slot], b.last_step[slot] = b.last_step[slot], step.id
            b.pending[slot] += 1
            step.seqs.append(
                ScheduledSeq(
                    req.request_id, [token], start, req.block_ids, True, req.sampling, banned, req.prompt_token_ids
                )
            )
            step.requests.append(req)

    def _admit_patient(self, requests: list[Request], step: _Step) -> None:
        """Admit the patient requests into what is left, best first, without looking at the
        rotary ones the free blocks cannot hold: under overload most of them, each step. Such a
        one never fits this step: admitting others shrinks the free blocks by at least what it
        shrinks its need (a free block is taken for each of its blocks brought into use). So
        they are left out before ranking, and again after each admission (by `_admit`)."""
        requests = [r for r in requests if not self._known_not_to_fit(r)]
        self._admit(self.policy.rank(requests, step.now), step, strict=False)

    def _known_not_to_fit(self, req: Request) -> bool:
        """A rotary request whose blocks, known without a look while none of any swapped-out
        request's content is in use (`_swap_in_blocks`), exceed the free pool (it could come back
        within the transfer budget)."""
        return not self.kv.pool.watched_in_use and self._swap_in_blocks.get(req, 0) > self.kv.num_free_blocks

    def _admit(self, order: Iterable[Request], step: _Step, strict: bool) -> None:
        """Admit in `order`; a request that does not fit stops admission (strict FCFS order) or
        is skipped for the ones after it."""
        for req in order:
            if step.budget <= 0 or self.num_running >= self.config.max_num_seqs:
                return
            if req.num_pending_tokens:
                continue  # left the GPU while its last step was in flight: back once that completes
            if req.status is RequestStatus.ROTARY:
                if self._known_not_to_fit(req):
                    if strict:
                        return
                    continue
                n = self.next_tokens(req)
                blocks = self.kv.swap_in_blocks(req, n)
                # When it cannot fit (and could come back within the budget), its copies need not
                # be counted.
                may_copy = self.kv.swap_in_copies_bound(req)
                if may_copy <= self.config.transfer_budget_blocks and (
                    n > step.budget or blocks > self.kv.num_free_blocks
                ):
                    if strict:
                        return
                    continue
                # Within what this step can still move, its copies need no count (swap_in makes them).
                copies = may_copy if may_copy <= step.transfer_left else self.kv.swap_in_copies(req)
                if copies > self.config.transfer_budget_blocks:
                    self._leave_rotary(req)  # it could never come back within a step's budget
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
                if self.kv.prefill_blocks_floor(req, step.budget) > self.kv.num_free_blocks:
                    if strict:  # it cannot fit, whatever prefix of it is cached: no lookup
                        return
                    continue
                cached = self.kv.cached_prefix(req)
                num_cached = len(cached) * self.kv.block_size
                n = min(req.num_tokens - num_cached, step.budget)
                if not self.kv.allocate(req, n, cached):
                    if strict:
                        return
                    continue
                self.waiting.remove(req)
                self.waiting_columns.remove(req)
                req.num_computed_tokens = num_cached
                if req.t_scheduled is None:
                    req.t_scheduled = step.now
                    req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.t_run = step.now
            self.batch.add(req)
            self._take(req, n, step)

    def update(self, plan: StepPlan, tokens: Sequence[int] | np.ndarray) -> list[Request]:
        """The step has completed (compute and copies): apply its sampled tokens, in the order of
        `plan.sampled_ids()` (an int64 array, as the runner returns them, or any sequence), and
        retire its quarantine. Returns the requests that got a token; `new_tokens` then holds
        each one's token and output length, in the same order (what the engine's outputs need,
        read without walking their token lists), and `token_timing` which of them got their
        first token, and the gaps before the others' tokens.

        A request that was rotated out or preempted since the step was planned still gets its
        token; one that finished since (abort, stop string, EOS) drops it."""
        if len(tokens) != plan.num_sampled:
            raise ValueError(f"step {plan.step_id} samples {plan.num_sampled} tokens, got {len(tokens)}")
        now = self.clock()
        submitted = self._submitted.pop(plan.step_id)
        self.kv.retire(plan.step_id)  # (first: the blocks of requests that finish now are free at once)
        self.token_timing = TokenTiming()
        token_array = tokens if isinstance(tokens, np.ndarray) else None
        if token_array is not None:
            tokens = token_array.tolist()
        if plan.num_seqs:
            # With async scheduling the step was planned while the one before it still ran.
            self.step_time.observe(submitted.shape, now - max(submitted.planned_at, self._t_last_update))
        self._t_last_update = now
        touched: list[Request] = []
        new = NewTokens([], [])
        k = 0  # the next seq's token
        for req, seq in zip(submitted.requests, plan.seqs, strict=True):
            start, n = seq.start_pos, len(seq.token_ids)
            if seq.sample:
                req.num_pending_tokens -= 1
                k += 1
            if req.status is RequestStatus.FINISHED:
                continue
            if req.status is RequestStatus.RUNNING:
                self.kv.commit_full_blocks(req, start, start + n)
            if seq.sample:
                self._apply_token(req, tokens[k - 1], now)
                touched.append(req)
                new.add(tokens[k - 1], req.num_output_tokens)
        decode_tokens = token_array[k:] if token_array is not None else None
        decoded, decoded_new = self._apply_decodes(submitted, plan.decodes, tokens[k:], now, decode_tokens)
        touched += decoded
        if new.tokens:
            new.tokens.extend(decoded_new.tokens)
            new.num_output.extend(decoded_new.num_output)
        else:  # (a decode-only step: no copy of a thousand rows)
            new = decoded_new
        self.new_tokens = new
        return touched

    def _apply_token(self, req: Request, token: int, now: float) -> None:
        """Append a live request's sampled token, time it, and finish the request if it must stop."""
        req.token_ids.append(token)
        batch = req._batch
        if batch is not None:
            batch.num_tokens[req._slot] += 1
            batch.last_token[req._slot] = token
        if req.t_first_token is None:
            req.t_first_token = now
            self.token_timing.first.append(req)
        else:
            gap = now - req.t_last_token
            req.token_gaps.append(gap)
            self.token_timing.add_gap(req.slo_class, gap)
            if gap > req.max_gap_s:
                lost_now = req.status is RequestStatus.ROTARY and gap * 1000.0 > req.slo.tbt_ms and not req.tbt_missed
                req.max_gap_s = gap
                if lost_now:
                    self._split_rotary()
        req.t_last_token = now
        if req.status is RequestStatus.WAITING:
            self.waiting_columns.refresh(req)
        elif req.status is RequestStatus.ROTARY and req in self.rotary_columns:
            self.rotary_columns.refresh(req)
        reason = req.stop_reason()
        if reason is not None:
            self._finish(req, reason)

    def _apply_decodes(
        self, submitted: _Submitted, rows: DecodeRows, tokens: list[int], now: float, token_array: np.ndarray | None
    ) -> tuple[list[Request], NewTokens]:
        """_apply_token for each decode row (`tokens`: theirs, in row order; `token_array`: the
        same as int64, if at hand); returns the rows' requests that got their token, and those
        tokens and the requests' output lengths. The bulk of update() at thousands of requests:
        the rows whose request still runs in the slot it was planned in (nearly all) get their
        counters in columns, their tokens and gaps into the batch's tails, and the blocks they
        fill committed in one call; what may end a request (a row whose token may stop it, one
        whose request left its slot since planning: it was rotated out, preempted or finished)
        is done one row at a time, in row order."""
        reqs = submitted.decoded
        if not reqs:
            return [], NewTokens([], [])
        if len(reqs) < self.rows_per_vector:
            return self._apply_decodes_by_row(submitted, rows, tokens, now)
        b = self.batch
        if token_array is None:
            token_array = np.array(tokens, dtype=np.int64)
        in_slot = b.np_gen[submitted.decode_slots] == submitted.decode_gens
        everyone = np.count_nonzero(in_slot) == len(in_slot)
        keep = None if everyone else in_slot.tolist()
        live = reqs if keep is None else list(compress(reqs, keep))
        slots = submitted.decode_slots[in_slot]
        b.np_pending[slots] -= 1
        b.np_num_tokens[slots] += 1
        live_array = token_array if keep is None else token_array[in_slot]
        b.np_last_token[slots] = live_array
        b.add_tokens(slots, live_array)
        t_prev = b.np_t_last[slots]  # NaN: its first token
        gaps = now - t_prev
        timed = ~np.isnan(t_prev)
        timed_slots, timed_gaps = slots, gaps
        if np.count_nonzero(timed) != len(timed):
            for k in np.flatnonzero(~timed).tolist():
                live[k].t_first_token = now
                self.token_timing.first.append(live[k])
            timed_slots, timed_gaps = slots[timed], gaps[timed]
        if len(timed_slots):
            b.add_gaps(timed_slots, timed_gaps)
            for slo_class, class_gaps in b.by_class(timed_slots, timed_gaps):
                self.token_timing.add_gaps(slo_class, class_gaps)
        # Running, so its TBT cannot be lost now (that is checked for the rotary: Request.tbt_missed).
        b.np_max_gap[slots] = np.fmax(b.np_max_gap[slots], gaps)
        b.np_t_last[slots] = now
        fills = submitted.fill_rows if self.kv.enable_prefix_caching else []
        if fills:  # (the rows still in their slot, at once; the others one by one below)
            committed = fills if keep is None else [k for k in fills if keep[k]]
            bs = self.kv.block_size
            self.kv.filled([reqs[k] for k in committed], [rows.start_pos[k] // bs for k in committed])
        may_stop = b.may_stop(live_array) | (b.np_num_tokens[slots] >= b.np_limit[slots])
        planned = submitted.decode_slots  # (a row out of its slot gets its request's figure below)
        num_output = (b.np_num_tokens[planned] - b.np_prompt_len[planned]).tolist()
        if keep is not None:  # by row: the live rows' verdicts, and every row out of its slot
            by_row = ~in_slot
            by_row[in_slot] = may_stop
            may_stop = by_row
        dropped = []
        for k in np.flatnonzero(may_stop).tolist():
            req = reqs[k]
            if keep is None or keep[k]:
                if (reason := req.stop_reason()) is not None:
                    self._finish(req, reason, reorder=False)
                continue
            if self._apply_row(req, rows.start_pos[k], tokens[k], k in fills, now):
                num_output[k] = req.num_output_tokens
            else:
                dropped.append(k)
        b.reorder()
        if dropped:
            gone = set(dropped)
            kept = [k for k in range(len(reqs)) if k not in gone]
            return [reqs[k] for k in kept], NewTokens([tokens[k] for k in kept], [num_output[k] for k in kept])
        return reqs, NewTokens(tokens, num_output)

    def _apply_row(self, req: Request, start: int, token: int, fills_block: bool, now: float) -> bool:
        """One decode row's token, applied to its request (wherever it is now); False if the
        request finished since the row was planned (the token is dropped)."""
        req.num_pending_tokens -= 1
        if req.status is RequestStatus.FINISHED:
            return False
        if fills_block and req.status is RequestStatus.RUNNING:
            self.kv.filled((req,), (start // self.kv.block_size,))
        self._apply_token(req, token, now)
        return True

    # --- helpers ---------------------------------------------------------------------------
    def _take(self, req: Request, n: int, step: _Step) -> None:
        self.batch.nblocks[req._slot] = len(req.block_ids)  # allocated for this step
        start = req.num_computed_tokens
        end = req.num_computed_tokens = start + n
        req.step_before_last, req.last_step = req.last_step, step.id
        step.budget -= n
        if n != 1:
            step.seq_starts[req._slot] = start  # (a one-token row computed all but one of its tokens)
        token_ids = req.token_ids[start:end]
        if len(token_ids) < n:
            token_ids += [PLACEHOLDER] * (n - len(token_ids))
        sample = end == len(req.token_ids) + req.num_pending_tokens
        if n == 1 and sample and not req.sampling.min_tokens:  # a decode row (see DecodeRows)
            step.add_decode_row(req._slot, token_ids[0], start, self.kv.block_size)
        else:
            banned = req.banned_token_ids() if sample and req.sampling.min_tokens else ()
            step.seqs.append(
                ScheduledSeq(
                    req.request_id, token_ids, start, req.block_ids, sample, req.sampling, banned, req.prompt_token_ids
                )
            )
            step.requests.append(req)
        if sample:
            req.num_pending_tokens += 1

    def _write_through(self, step: _Step) -> None:
        """Copy the running requests' newly full blocks to the CPU tier, within the transfer
        budget. When the budget or the tier's free blocks cannot take them all, the policy's
        likeliest next rotation victims go first: rotating one out then copies only its tail.

        Nothing is copied while most of the GPU pool is free, nothing is rotated out and the
        waiting requests fit in the free blocks (they wait for the token budget, as a burst's
        prefills do, not for memory): a rotation is unlikely then, and the copies are not free
        where they share the compute lane (on the CPU). The blocks left unwritten are copied once
        that changes, or at rotation. Which running requests have blocks to copy is found in the
        running batch's columns; only those are looked at one by one."""
        kv, b = self.kv, self.batch
        free = kv.pool.num_free
        if free > WRITE_THROUGH_FREE_SHARE * kv.num_blocks and not self.rotary and not self._waiting_outgrow(free):
            return
        found = self._unwritten(step)
        if found is None:
            return
        slots, done, counts = found
        # The step that wrote those blocks: the one before this step, for a request this step computes.
        wrote = np.where(b.np_last_step[slots] == step.id, b.np_prev_step[slots], b.np_last_step[slots])
        reqs = b.requests[slots].tolist()
        firsts = b.np_written[slots]
        if int(counts.sum()) <= min(step.transfer_left, kv.cpu.num_free):
            # All of them fit the budget and the tier's room: the output blocks first, at once
            # (no hash, no lookup), then the prompt blocks (content the tier holds is shared).
            prompt = firsts < b.np_prompt_len[slots] // kv.block_size
            with_prompt = np.count_nonzero(prompt)  # (none: the steady state)
            outputs = zip(reqs, firsts.tolist(), counts.tolist(), strict=True)
            if with_prompt:
                outputs = compress(outputs, (~prompt).tolist())
            copied, copies = kv.write_through_outputs(outputs, step.id)
            if with_prompt:
                done_of = done.tolist()
                targets = [(reqs[k], done_of[k]) for k in np.flatnonzero(prompt).tolist()]
                more, more_copies = kv.write_through_all(targets, step.transfer_left - len(copies), step.id)
                copied, copies = copied + more, copies + more_copies
        else:
            order = reqs if len(reqs) == 1 else self.policy.rotation_order(reqs, step.now)
            complete = dict(zip(reqs, done.tolist(), strict=True))
            copied, copies = kv.write_through_all([(r, complete[r]) for r in order], step.transfer_left, step.id)
        if copies:
            if len(copied) == len(reqs):
                after = int(wrote.max())
            else:
                wrote_in = dict(zip(reqs, wrote.tolist(), strict=True))
                after = max(map(wrote_in.__getitem__, copied))
            step.swap_out_after = max(step.swap_out_after, after)
            step.swap_out += copies
            step.transfer_left -= len(copies)
        b.np_written[slots] = [len(r.cpu_block_ids) for r in reqs]

    def _unwritten(self, step: _Step) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The running requests with full blocks not yet written through, in running order: their
        batch slots, tokens with final KV before this step (a row this step computes one token of,
        all but that one; one it computes more of, where that began; the others, all they
        computed), and how many such blocks each has. None if no request has one."""
        b = self.batch
        if len(b.order) < self.rows_per_vector:
            return self._unwritten_by_row(step)
        done = b.np_computed - (b.np_last_step == step.id)
        if step.seq_starts:
            done[list(step.seq_starts)] = list(step.seq_starts.values())
        slots = b.order
        done = done[slots]
        unwritten = np.minimum(done // self.kv.block_size, b.np_nblocks[slots]) - b.np_written[slots]
        rows = np.flatnonzero(unwritten > 0)
        return (slots[rows], done[rows], unwritten[rows]) if len(rows) else None

    def _waiting_outgrow(self, free: int) -> bool:
        """The waiting requests' tokens need more GPU blocks than `free` (cached prefixes aside)."""
        need = 0
        for req in self.waiting:
            need += self.kv.blocks_for(req.num_tokens)
            if need > free:
                return True
        return False

    def _rotate_out(self, req: Request, step: _Step, reason: str, reorder: bool = True) -> bool:
        """Move a running decode to the CPU tier, if the tier and the transfer budget can take it
        (`reorder`: see RunningBatch.remove)."""
        if step.transfer_left < self.kv.swap_out_cost(req):
            return False
        copies = self.kv.swap_out(req, step.id)
        if copies is None:
            return False
        step.swap_out_after = max(step.swap_out_after, req.last_step)
        self.batch.remove(req, reorder)
        step.swap_out += copies
        step.transfer_left -= len(copies)
        req.status = RequestStatus.ROTARY
        req.num_rotations += 1
        self.counters.rotations += 1
        self.counters.preempted("swap", reason)
        bisect.insort(self.rotary, req, key=_arrival)
        blocks, copies = self._rotary_figures(req)
        if req.tbt_missed:
            bisect.insort(self.rotary_lost, req, key=_arrival)
        else:
            bisect.insort(self.rotary_on_time, req, key=_arrival)
            self.rotary_columns.add(req, blocks, copies)
        self._swap_in_blocks[req] = blocks if copies <= self.config.transfer_budget_blocks else 0
        return True

    def _rotary_figures(self, req: Request) -> tuple[int, int]:
        """A rotary request's blocks to come back while none of its content is in use
        (kv.swap_in_blocks for its next tokens) and the bound on its copies in."""
        return self.kv.blocks_for(req.num_scheduled_tokens), self.kv.swap_in_copies_bound(req)

    def _leave_rotary(self, req: Request) -> None:
        _remove_sorted(self.rotary, req)
        if req in self.rotary_columns:
            _remove_sorted(self.rotary_on_time, req)
            self.rotary_columns.remove(req)
        else:
            _remove_sorted(self.rotary_lost, req)
        del self._swap_in_blocks[req]

    def _split_rotary(self) -> None:
        """A rotary request lost its TBT SLO (its pending token came late): rare, so split again."""
        self.rotary_on_time = [r for r in self.rotary if not r.tbt_missed]
        self.rotary_lost = [r for r in self.rotary if r.tbt_missed]
        self.rotary_columns.rebuild(self.rotary_on_time, map(self._rotary_figures, self.rotary_on_time))

    def _evict(self, req: Request, step: _Step) -> None:
        """A running request must give up its blocks (another ran out): rotate it to the CPU tier
        if the policy uses one and it fits, else preempt it by recompute (blocks freed, tokens kept)."""
        reason = "gpu_full"
        if self.policy.uses_cpu_tier and req.in_decode:
            if self._rotate_out(req, step, "gpu_full"):
                return
            reason = "transfer_budget" if step.transfer_left < self.kv.swap_out_cost(req) else "cpu_full"
        self.batch.remove(req)
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
        self.waiting_columns.add(req, first=True)

    def _finish(self, req: Request, reason: FinishReason, reorder: bool = True) -> None:
        """End a live request and free its blocks (`reorder`: see RunningBatch.remove)."""
        if req.status is RequestStatus.RUNNING:
            self.batch.remove(req, reorder)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            self.waiting_columns.remove(req)
        elif req.status is RequestStatus.ROTARY:
            self._leave_rotary(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._released.append(req.request_id)

    # --- small batches: the decode hot path row by row --------------------------------------
    # Below `rows_per_vector` rows (ROWS_PER_VECTOR, 48) each of the decode hot path's three
    # passes over the running batch hands its rows to its twin here, one Python loop over the
    # batch's columns: `_serve_decodes` to `_serve_decodes_by_row`, `_apply_decodes` to
    # `_apply_decodes_by_row`, `_unwritten` to `_unwritten_by_row`. A vector pass makes ~40 numpy
    # calls whatever its rows (~2-3 µs each here), more than a loop over a few dozen rows costs.
    # Each twin must do what its vector method does: tests/test_scheduler_hot_paths.py runs every
    # trace with the threshold at 0 (always in columns) and at ROWS_PER_VECTOR, against the
    # reference scheduler. Measured with the twins deleted, always in columns (bench.sched
    # --against 123e3f4, 2026-11-29, 3 paired rounds,
    # bench/results/sched-s15-twins-vector-only-vs-123e3f4-cpu-2026-11-29.json): at 8 and 16 live
    # requests every situation took 46-177 µs more a step (0.34-0.80x, paired), at 32 44-243 µs
    # more but for rotary with every request fitting (even); at 47 live with all 47 decoding,
    # just under the threshold, 27-59 µs less (1.11-1.32x): the break-even lies between 32 and 47
    # rows.

    def _serve_decodes_by_row(self, i: int, slots: list[int], step: _Step) -> int:
        """_serve_decodes for the rows running[i:] in batch `slots`, one at a time."""
        b, bs, budget, step_id = self.batch, self.kv.block_size, step.budget, step.id
        computed, pending, num_tokens, nblocks, limit = b.computed, b.pending, b.num_tokens, b.nblocks, b.limit
        prev_step, last_step, last_token, plain = b.prev_step, b.last_step, b.last_token, b.plain
        free, grow, rows, tokens, starts, fills, banned = self.kv.num_free_blocks, [], [], [], [], [], []
        for slot in slots:
            start, waiting_for = computed[slot], pending[slot]
            total = num_tokens[slot] + waiting_for
            if waiting_for and total >= limit[slot]:
                i += 1  # Request.ends_after_pending(): scheduling it again would only waste a step
                continue
            if total - start != 1:
                break
            if start >= nblocks[slot] * bs:
                if not free:
                    break
                free -= 1
                grow.append(slot)
                nblocks[slot] += 1  # (allocated below, all at once)
            token = PLACEHOLDER if waiting_for else last_token[slot]
            if plain[slot]:
                computed[slot] = start + 1
                prev_step[slot], last_step[slot] = last_step[slot], step_id
                pending[slot] = waiting_for + 1
                if (start + 1) % bs == 0:
                    fills.append(len(rows))
                rows.append(slot)
                tokens.append(token)
                starts.append(start)
            else:
                banned.append((slot, start, token))
            i += 1
            budget -= 1
            if budget <= 0:
                break
        if grow:
            self.kv.add_block_each(b.requests[grow].tolist())
        step.budget = budget
        if rows:
            step.add_decode_rows(rows, tokens, starts, fills)
        if banned:
            self._banned_rows(*map(list, zip(*banned, strict=True)), step)
        return i

    def _apply_decodes_by_row(
        self, submitted: _Submitted, rows: DecodeRows, tokens: list[int], now: float
    ) -> tuple[list[Request], NewTokens]:
        """_apply_decodes, one row at a time."""
        b, bs = self.batch, self.kv.block_size
        gen, pending, num_tokens, last_token = b.gen, b.pending, b.num_tokens, b.last_token
        t_last, max_gap, limit, prompt_len = b.t_last, b.max_gap, b.limit, b.prompt_len
        tail_tokens, tail_gaps = b.tail_tokens, b.tail_gaps
        fills = set(submitted.fill_rows) if self.kv.enable_prefix_caching else ()
        add_gap, first = self.token_timing.add_gap, self.token_timing.first
        touched: list[Request] = []
        new = NewTokens([], [])
        new_tokens, new_num_output = new.tokens, new.num_output
        slots, gens = submitted.decode_slots.tolist(), submitted.decode_gens.tolist()
        rows_of = zip(submitted.decoded, slots, gens, tokens, strict=True)
        for k, (req, slot, planned_gen, token) in enumerate(rows_of):
            if gen[slot] != planned_gen:  # it left its slot since: rotated out, preempted or finished
                if self._apply_row(req, rows.start_pos[k], token, k in fills, now):
                    touched.append(req)
                    new.add(token, req.num_output_tokens)
                continue
            pending[slot] -= 1
            if tail_tokens[slot]:  # (what req.token_ids does first)
                b.flush_tokens(slot)
            req._token_ids.append(token)
            n = num_tokens[slot] = num_tokens[slot] + 1
            last_token[slot] = token
            t = t_last[slot]
            if t != t:  # NaN: its first token
                req.t_first_token = now
                first.append(req)
            else:
                gap = now - t
                if tail_gaps[slot]:  # (what req.token_gaps does first)
                    b.flush_gaps(slot)
                req._token_gaps.append(gap)
                add_gap(req.slo_class, gap)
                if gap > max_gap[slot]:
                    max_gap[slot] = gap  # (running: its TBT cannot be lost now, see _apply_decodes)
            t_last[slot] = now
            if k in fills:
                self.kv.filled((req,), (rows.start_pos[k] // bs,))
            new_tokens.append(token)
            new_num_output.append(n - prompt_len[slot])
            if (token in req.stop_token_set or n >= limit[slot]) and (reason := req.stop_reason()) is not None:
                self._finish(req, reason)
            touched.append(req)
        return touched, new

    def _unwritten_by_row(self, step: _Step) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """_unwritten, one row at a time."""
        b, bs, starts = self.batch, self.kv.block_size, step.seq_starts
        computed, last_step, nblocks, written = b.computed, b.last_step, b.nblocks, b.written
        found: list[tuple[int, int, int]] = []
        for slot in b.order.tolist():
            done = starts[slot] if slot in starts else computed[slot] - (last_step[slot] == step.id)
            n = min(done // bs, nblocks[slot]) - written[slot]
            if n > 0:
                found.append((slot, done, n))
        if not found:
            return None
        return tuple(np.array(column, dtype=np.int64) for column in zip(*found, strict=True))
