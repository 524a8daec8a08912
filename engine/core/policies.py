"""Scheduling policies: each step, a policy decides which running requests to rotate out to the
CPU tier and in what order non-running requests are admitted. The scheduler executes that.

- `fcfs`: the vLLM v1 baseline. Waiting requests in arrival order; when blocks run out the newest
  running request is preempted by recompute. Never rotates.
- `rotary`: RotaSched (SuperInfer, arXiv 2601.20309). Requests are ranked by Virtual Lag Time
  against their SLOs, Largest-VLT-First; under contention, long-running decodes are rotated to
  CPU memory so requests close to violating an SLO get GPU memory first. SLO-aware admission
  (`tbt_guard`) keeps that within what the measured step time allows: new requests wait rather
  than push streaming ones past their TBT SLO, and residency on the GPU is as long as it may be.
  Stall budgets come first: a started stream off the GPU that is due to come back
  (`stall_due_at`) goes before anything else, and no new request starts while one is
  (`stall_hold`): queueing time is spent before stalls.
- `watermark`: the reference code's behaviour, as an ablation: oldest-waiting-first admission,
  and the oldest running decodes rotated out whenever free blocks fall under a watermark.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from typing import Protocol

import numpy as np

from superinfer.engine.core.ranking_columns import RankingColumns
from superinfer.engine.core.request import Request, RequestStatus
from superinfer.engine.core.running_batch import RunningBatch
from superinfer.engine.core.scheduler_view import SchedulerView


@dataclass
class Decision:
    rotate_out: list[Request] = field(default_factory=list)  # running decodes to move to the CPU tier
    admit: list[Request] = field(default_factory=list)  # waiting/rotary requests, in admission order
    strict_order: bool = True  # stop at the first that does not fit (FCFS), or skip it
    token_budget: int | None = None  # a tighter token budget for this step than the configured one
    held: int = 0  # new requests kept out of this step's admission (TBTGuard.new_requests, stall_hold)
    stall_hold: bool = False  # they were all held for the started streams off the GPU (stall_hold)
    guard: TBTGuard | None = None  # the TBT guard's view this step, when the policy has one
    # Admitted after `admit` into what is left, best first by the policy's `rank`, each skipped if
    # it does not fit (never in strict order): the scheduler ranks only those that may fit.
    patient: list[Request] = field(default_factory=list)


class Policy(Protocol):
    name: str
    uses_cpu_tier: bool

    def decide(self, sched: SchedulerView, now: float) -> Decision: ...

    def victim(self, running: RunningBatch, first: int, now: float) -> Request:
        """Out of blocks mid-step: which of the running requests from the `first`-th on (in
        running order) gives up its blocks."""
        ...

    def rotation_order(self, running: Sequence[Request], now: float) -> list[Request]:
        """Running requests, the likeliest to be rotated out next first."""
        ...

    def rank(self, requests: Sequence[Request], now: float) -> list[Request]:
        """Non-running requests, the first to be admitted first (`Decision.patient`)."""
        ...


def by_arrival(requests: Sequence[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival_time)


class FCFSPolicy:
    name = "fcfs"
    uses_cpu_tier = False

    def decide(self, sched: SchedulerView, now: float) -> Decision:
        return Decision(admit=[*sched.waiting, *sched.rotary])

    def victim(self, running: RunningBatch, first: int, now: float) -> Request:
        """The running request to preempt when blocks run out: the most recently admitted."""
        return running.requests[running.order[-1]]

    def rotation_order(self, running: Sequence[Request], now: float) -> list[Request]:
        return list(running)  # never rotates

    def rank(self, requests: Sequence[Request], now: float) -> list[Request]:
        return by_arrival(requests)


@dataclass(frozen=True)
class RotaryParams:
    alpha: float = 3.0  # weight of TBT lag against TTFT lag: larger favours TBT
    beta_f: float = 0.5  # a waiting request starts lagging after beta_f * its TTFT SLO
    beta_b: float = 0.0  # a rotary request starts lagging after beta_b * its TBT SLO
    transfer_budget_blocks: int = 2400  # B_xfer: blocks moved between tiers per step
    # A request that entered the GPU runs at least this long before it can leave (the guard's residency
    # can be a few steps past ~1.2x what fits, and none while it protects nobody: on the CPU engine's
    # overload 10-15 rotations per request, against 2-3 with this floor at the same goodput).
    min_residency_s: float = 0.25
    slo_admission: bool = True  # keep live requests within their TBT SLO (see tbt_guard)
    tbt_headroom: float = 0.8  # share of the TBT SLO that the guard lets a token's turn take


def virtual_lag_time(req: Request, now: float, p: RotaryParams) -> float:
    """How far a request lags behind its SLO, in seconds (larger = more urgent).

    waiting, no token yet:     max(0, now - t_arr - beta_f * S_F)
    rotary, or waiting after a recompute with tokens out:  alpha * max(0, now - t_last - beta_b * S_B)
    running:                   -(now - t_run): the longer it has run, the sooner it yields
    """
    if req.status is RequestStatus.RUNNING:
        return -(now - (req.t_run if req.t_run is not None else now))
    if req.t_last_token is None:
        return max(0.0, now - req.arrival_time - p.beta_f * req.slo.ttft_ms / 1000.0)
    return p.alpha * max(0.0, now - req.t_last_token - p.beta_b * req.slo.tbt_ms / 1000.0)


# A started stream off the GPU is due once it has waited this share of its stall budget: from then
# on it comes back before any request that has not started, and no new request starts. The rest of
# the budget is for the copies and the step that bring it back, and for jitter.
STALL_DUE_SHARE = 0.5


def stall_due_at(t_last: float, stall_budget_ms: float) -> float:
    """When a started stream whose last token came at `t_last` is due to come back."""
    return t_last + STALL_DUE_SHARE * stall_budget_ms / 1000.0


# A due stream still waits for free blocks (requests finish all the time) until this share of its
# budget; from then on it displaces a running one that has stayed the residency floor. Displacing
# as soon as it is due made each return push another stream out, due in its turn: on `superinfer
# simulate` at 60 req/s, 8 rotations a request instead of 1, and 0.41 goodput instead of 0.69.
STALL_URGENT_SHARE = 0.75


def _waited(r: Request, now: float, share: float) -> bool:
    """A started stream off the GPU has waited `share` of its stall budget since its last token."""
    t_last = r._t_last_token
    return t_last is not None and now >= t_last + share * r.slo.stall_budget_ms / 1000.0


MIN_PREFILL_CHUNK = 32  # tokens a capped step still gives prefills, so they always progress
# A request that leaves waits at most this share of its turn; the rest is for the step that brings
# it back and for jitter (a full turn lets every small delay break the SLO).
RESIDENCY_SHARE = 0.5


@dataclass(frozen=True)
class TBTGuard:
    """What the live requests' TBT SLO leaves room for this step."""

    new_requests: int  # requests that may start (their first prefill) without breaking it
    token_budget: int  # tokens the step may compute
    residency_s: float  # how long a request may stay on the GPU while others wait their turn
    overdue: bool = False  # a streaming request has waited its whole turn: no new request starts
    # What it judged by (for the benchmarks' step logs): the live requests it protects, how many of
    # them fit on the GPU at once, and the time left until the first of their turns ends.
    live: int = 0
    fit: int = 0
    turn_left_s: float = math.inf


def _live_columns(
    cols: RunningBatch | RankingColumns, slots: np.ndarray, now: float, turn_share: float
) -> tuple[int, int, float, float]:
    """`_live_stats` of the requests in these slots of the running batch or of ranking columns."""
    tbt, num_tokens, t_last = cols.np_tbt_ms[slots], cols.np_num_tokens[slots], cols.np_t_last[slots]
    waited = now - t_last  # NaN without a token: fmax takes the gap
    live = np.fmax(cols.np_max_gap[slots], waited) * 1000.0 <= tbt
    count = int(np.count_nonzero(live))
    if not count:
        return 0, 0, math.inf, math.inf
    if count < len(live):
        tbt, num_tokens, t_last = tbt[live], num_tokens[live], t_last[live]
    turn_end = float(np.fmin.reduce(t_last + tbt * turn_share))  # fmin: past the NaNs
    return count, int(num_tokens.sum()), float(tbt.min()), turn_end if turn_end == turn_end else math.inf


def _live_stats(
    groups: Iterable[Iterable[Request]],
    headroom: float,
    running: RunningBatch,
    by_row: bool,
    now: float,
    columns: Iterable[tuple[RankingColumns, np.ndarray]] = (),
) -> tuple[int, int, float, float]:
    """Of the running requests, those in `columns` (slots of ranking columns) and those in
    `groups` (neither) whose TBT SLO is not lost yet (no gap between their tokens, nor the wait
    since their last one, past it): how many, their tokens, the tightest TBT SLO (ms) and when the
    first of their turns ends (`headroom` x its own TBT SLO after its last token; inf if none has a
    token). The running ones in columns (by row when `by_row`: few), the groups in one pass over
    their own fields: hot at thousands of requests."""
    turn_share = headroom / 1000.0
    count = tokens = 0
    min_tbt_ms = turn_end = math.inf
    if by_row:
        tbt_col, max_gap, num_tokens, t_last = running.tbt_ms, running.max_gap, running.num_tokens, running.t_last
        for slot in running.order.tolist():
            tbt_ms = tbt_col[slot]
            if max(max_gap[slot], now - t_last[slot]) * 1000.0 > tbt_ms:  # (NaN, no token yet: max_gap)
                continue
            count += 1
            tokens += num_tokens[slot]
            min_tbt_ms = min(min_tbt_ms, tbt_ms)
            t = t_last[slot]
            if t == t and (end := t + tbt_ms * turn_share) < turn_end:  # (NaN: no token yet)
                turn_end = end
    else:
        count, tokens, min_tbt_ms, turn_end = _live_columns(running, running.order, now, turn_share)
    for cols, slots in columns:
        n, t, least, first_end = _live_columns(cols, slots, now, turn_share)
        count, tokens, min_tbt_ms, turn_end = count + n, tokens + t, min(min_tbt_ms, least), min(turn_end, first_end)
    for group in groups:
        for r in group:
            tbt_ms = r.slo.tbt_ms
            t = r._t_last_token
            if r._max_gap_s * 1000.0 > tbt_ms or (t is not None and (now - t) * 1000.0 > tbt_ms):
                continue  # lost already, or will be with its next token
            count += 1
            tokens += len(r._token_ids)
            if tbt_ms < min_tbt_ms:
                min_tbt_ms = tbt_ms
            if t is not None and (end := t + tbt_ms * turn_share) < turn_end:
                turn_end = end
    return count, tokens, min_tbt_ms, turn_end


def tbt_guard(sched: SchedulerView, now: float, headroom: float) -> TBTGuard | None:
    """SLO-aware admission: from measured step times, how much new work the requests that already
    stream tokens (running, rotary, or waiting again after a recompute) can take while each still
    gets a token within `headroom` x its TBT SLO (its turn). With n of the D live requests fitting
    on the GPU at once, a request gets a token every D / n steps of step time s(n): a new request
    raises D, and a prefill chunk raises s. A request that leaves waits (D - n) / n residencies of
    whoever replaced it, so a residency of RESIDENCY_SHARE x turn x n / (D - n) keeps that wait
    within its turn while rotating as little as that allows. Past twice what fits (D > 2n) no
    residency keeps every turn, and a shorter one only multiplies rotations (each buys a token or
    two): the residency stays at RESIDENCY_SHARE x turn, and the requests that wait too long lose
    their TBT and return only into free blocks. Requests whose TBT SLO is already lost are not
    protected. None when there is nothing to protect, no step model yet, or when even one request
    alone could not meet the SLO on this machine.
    """
    model = sched.step_time
    if not model.ready:
        return None
    by_row = sched.num_running < sched.rows_per_vector
    groups: list[Iterable[Request]] = []
    columns: list[tuple[RankingColumns, np.ndarray]] = []
    if len(sched.waiting) < sched.rows_per_vector:  # those waiting again after a recompute
        restarted = [r for r in sched.waiting if r.t_first_token is not None]
        groups.append(restarted)
        num_new = len(sched.waiting) - len(restarted)
    else:
        waiting = sched.waiting_columns
        slots = np.flatnonzero(waiting.np_active)
        restarted_slots = slots[~np.isnan(waiting.np_t_last[slots])]
        columns.append((waiting, restarted_slots))
        num_new = len(slots) - len(restarted_slots)
    if len(sched.rotary_on_time) < sched.rows_per_vector:
        groups.append(sched.rotary_on_time)
    else:
        columns.append((sched.rotary_columns, np.flatnonzero(sched.rotary_columns.np_active)))
    d, tokens, min_tbt_ms, turn_end = _live_stats(groups, headroom, sched.batch, by_row, now, columns)
    if not d:
        return None
    kv = sched.kv
    turn = headroom * min_tbt_ms / 1000.0
    fit = max(1, min(sched.max_num_seqs, kv.num_blocks * d // max(1, kv.blocks_for(tokens) + d)))

    def gap(num_live: int) -> float:
        n = min(num_live, fit)
        return model.time_for(n, n * tokens // d) * num_live / n

    if gap(1) > turn:
        return None
    allowed = 0
    # What the model predicts, and what the streaming requests feel: none starts while one of them
    # has already waited a whole turn (its own: a batch request's is longer) for its next token.
    overdue = now >= turn_end
    if not overdue:
        allowed = bisect.bisect_right(range(1, num_new + 1), turn, key=lambda k: gap(d + k))
    # Rotating, a request waits D / n steps for its turn: each step gets that share of the turn.
    step_s = turn * min(d, fit) / d
    b = sched.batch
    context = sum(map(b.num_tokens.__getitem__, b.order.tolist())) if by_row else int(b.np_num_tokens[b.order].sum())
    budget = model.tokens_within(step_s, context)
    residency = RESIDENCY_SHARE * turn * max(1.0, fit / (d - fit)) if d > fit else math.inf
    budget = max(budget, sched.num_running + MIN_PREFILL_CHUNK)
    return TBTGuard(allowed, budget, residency, overdue, d, fit, turn_end - now)


def _due_in_columns(cols: RankingColumns, now: float) -> bool:
    slots = np.flatnonzero(cols.np_active)  # (NaN, no token yet: not due)
    return bool(np.any(now >= cols.np_t_last[slots] + STALL_DUE_SHARE * cols.np_stall_ms[slots] / 1000.0))


def _top_priority_off_gpu(sched: SchedulerView) -> int | None:
    """The highest priority among the started streams off the GPU (rotated out, or waiting again
    after a recompute); None if there is none."""
    few = sched.rows_per_vector
    top = max((r.priority for r in sched.rotary_lost), default=None)
    if len(sched.rotary_on_time) < few:
        on_time = max((r.priority for r in sched.rotary_on_time), default=None)
    else:
        cols = sched.rotary_columns
        slots = np.flatnonzero(cols.np_active)
        on_time = int(cols.np_priority[slots].max()) if len(slots) else None
    if len(sched.waiting) < few:
        restarted = max((r.priority for r in sched.waiting if r._t_last_token is not None), default=None)
    else:
        cols = sched.waiting_columns
        slots = np.flatnonzero(cols.np_active)
        slots = slots[~np.isnan(cols.np_t_last[slots])]
        restarted = int(cols.np_priority[slots].max()) if len(slots) else None
    return max((p for p in (top, on_time, restarted) if p is not None), default=None)


def _started_stream_due(sched: SchedulerView, now: float) -> bool:
    """Some started stream off the GPU is due to come back (stall_due_at)."""
    few = sched.rows_per_vector
    if len(sched.rotary_on_time) < few:
        if any(_waited(r, now, STALL_DUE_SHARE) for r in sched.rotary_on_time):
            return True
    elif _due_in_columns(sched.rotary_columns, now):
        return True
    if any(_waited(r, now, STALL_DUE_SHARE) for r in sched.rotary_lost):
        return True
    if len(sched.waiting) < few:
        return any(_waited(r, now, STALL_DUE_SHARE) for r in sched.waiting)
    return _due_in_columns(sched.waiting_columns, now)


def _ttft_lost_waiting(sched: SchedulerView, now: float) -> bool:
    """Some new request in the queue has already lost its TTFT SLO."""
    if len(sched.waiting) < sched.rows_per_vector:
        return any(r._t_last_token is None and now > _ttft_deadline(r) for r in sched.waiting)
    cols = sched.waiting_columns
    slots = np.flatnonzero(cols.np_active)
    deadline = cols.np_arrival[slots] + cols.np_ttft_ms[slots] / 1000.0
    return bool(np.any(np.isnan(cols.np_t_last[slots]) & (now > deadline)))


def stall_hold(sched: SchedulerView, now: float) -> int | None:
    """The priority at and below which no new request may start this step, for the sake of the
    started streams off the GPU (rotated out, or waiting again after a recompute): theirs, while
    one is due to come back (stall_due_at), and, once the load has outrun what rotation can save
    (a new request in the queue has lost its TTFT SLO already), while any is off the GPU at all;
    None: no hold. The GPU memory that frees then goes to the streams users already watch, and
    new requests of their class or below spend their TTFT slack, where nobody sees it (a class of
    higher priority still starts: under the two-class overload of `bench.vllm_peer`, holding it
    too left 16% of the interactive requests within their TTFT). Measured on `superinfer
    simulate` at 60 req/s (8 GiB KV, Llama-3-8B): holding them only while one is due rotated twice
    a request and left 20% of the copies unhidden on the H100 profile (0.88x fcfs's tokens/s);
    holding them whenever one is off the GPU lost the head-of-line burst
    (`tests/test_slo_scenario.py`: TTFT 37% against 100%). docs/rotasched.md has the table."""
    top = _top_priority_off_gpu(sched)
    if top is None or not (_ttft_lost_waiting(sched, now) or _started_stream_due(sched, now)):
        return None
    return top


# Each of these reads the running batch's columns: one row at a time below `rows_per_vector` rows
# (numpy's cost per call exceeds the loop's there), in vector operations from there on.


def _growth_blocks(sched: SchedulerView, by_row: bool) -> int:
    """GPU blocks the running requests need for their next step: kv.growth_blocks of each for its
    next_tokens."""
    b, slots, bs = sched.batch, sched.batch.order, sched.kv.block_size
    if by_row:
        num_tokens, pending, nblocks = b.num_tokens, b.pending, b.nblocks
        return sum(max(0, -(-(num_tokens[s] + pending[s]) // bs) - nblocks[s]) for s in slots.tolist())
    need = -(-(b.np_num_tokens[slots] + b.np_pending[slots]) // bs) - b.np_nblocks[slots]
    return int(np.maximum(need, 0).sum())


def _prefilling(running: RunningBatch, by_row: bool) -> bool:
    """Some running request computes more than one token next (a prefill chunk): what the TBT
    guard's token budget can bind (it always leaves a token for each running request)."""
    slots = running.order
    if by_row:
        num_tokens, pending, computed = running.num_tokens, running.pending, running.computed
        return any(num_tokens[s] + pending[s] - computed[s] > 1 for s in slots.tolist())
    next_tokens = running.np_num_tokens[slots] + running.np_pending[slots] - running.np_computed[slots]
    return bool(np.count_nonzero(next_tokens > 1))


def _running_worst_first(running: RunningBatch, now: float, residency_s: float, by_row: bool) -> list[Request]:
    """The running requests ranked by (-priority, tbt_missed, -VLT), worst first (the reverse of
    a stable sort), only those that have stayed the residency `_may_rotate_out` asks for: under
    contention most have not, and each would cost a look of its own."""
    slots = running.order
    if by_row:
        prio, max_gap, tbt, t_run = running.priority, running.max_gap, running.tbt_ms, running.t_run
        stayed_enough = [
            s
            for s in slots.tolist()
            if now - t_run[s] >= (min(residency_s, tbt[s] / 1000.0) if max_gap[s] * 1000.0 > tbt[s] else residency_s)
        ]
        ranked = sorted(stayed_enough, key=lambda s: (-prio[s], max_gap[s] * 1000.0 > tbt[s], now - t_run[s]))
        return [running.requests[s] for s in reversed(ranked)]
    tbt, stayed = running.np_tbt_ms[slots], now - running.np_t_run[slots]
    missed = running.np_max_gap[slots] * 1000.0 > tbt
    stayed_enough = stayed >= np.where(missed, np.minimum(residency_s, tbt / 1000.0), residency_s)
    if np.count_nonzero(stayed_enough) < len(slots):
        slots, stayed, missed = slots[stayed_enough], stayed[stayed_enough], missed[stayed_enough]
    order = np.lexsort((stayed, missed, -running.np_priority[slots]))
    return running.requests[slots[order[::-1]]].tolist()


def _rank(now: float, p: RotaryParams, r: Request) -> tuple[bool, int, bool, float, float]:
    """A non-running request's ranking key, inlined: they are many (and, not running, its
    counters are its own fields: no property to go through). A started stream due to come back
    (stall_due_at) first, by when its stall budget runs out, then arrival; then (-priority, SLO
    lost (its TTFT if it has not started, else its TBT), -VLT)."""
    t_last = r._t_last_token
    if t_last is None:
        vlt = max(0.0, now - r.arrival_time - p.beta_f * r.slo.ttft_ms / 1000.0)
        return True, -r.priority, now > _ttft_deadline(r), -vlt, 0.0
    stall_ms = r.slo.stall_budget_ms
    if now >= stall_due_at(t_last, stall_ms):
        return False, 0, False, t_last + stall_ms / 1000.0, r.arrival_time
    vlt = p.alpha * max(0.0, now - t_last - p.beta_b * r.slo.tbt_ms / 1000.0)
    return True, -r.priority, r._max_gap_s * 1000.0 > r.slo.tbt_ms, -vlt, 0.0


def _lags(key: tuple[bool, int, bool, float, float]) -> bool:
    """A `_rank` key of a request that may displace a running one: due, or lagging (VLT > 0)
    with its SLO not lost (its TTFT if it has not started, else its TBT)."""
    not_due, _, missed, x, _ = key
    return not not_due or (not missed and x < 0)


def _ttft_deadline(r: Request) -> float:
    return r.arrival_time + r.slo.ttft_ms / 1000.0


def _ttft_slack(now: float, r: Request) -> tuple[bool, float]:
    """Least TTFT slack first, but those whose TTFT is lost already last."""
    deadline = _ttft_deadline(r)
    return deadline < now, deadline


def _unheld_waiting(
    sched: SchedulerView, allowed: int | None, hold_priority: int | None, now: float
) -> tuple[list[Request], np.ndarray | None, int]:
    """The waiting requests that may start this step, in queue order: all but the new ones of
    `hold_priority` or below (None: none of those), and of the others those past the `allowed`
    (None: all) with the least TTFT slack (they wait; their VLT keeps growing). Also their slots
    in the waiting columns when they are many (None: few, looked at one by one), and how many
    are held."""
    may_hold = (allowed is not None and allowed < len(sched.waiting)) or hold_priority is not None
    if len(sched.waiting) < sched.rows_per_vector:
        waiting = list(sched.waiting)
        if not may_hold:
            return waiting, None, 0
        new = [r for r in waiting if r.t_first_token is None]  # in queue order
        held = {id(r) for r in new if hold_priority is not None and r.priority <= hold_priority}
        if allowed is not None:
            free = sorted((r for r in new if id(r) not in held), key=partial(_ttft_slack, now))
            held.update(id(r) for r in free[allowed:])
        return ([r for r in waiting if id(r) not in held] if held else waiting), None, len(held)
    cols = sched.waiting_columns
    slots = cols.in_queue_order()
    num_held = 0
    if may_hold:
        new = np.flatnonzero(np.isnan(cols.np_t_last[slots]))
        held = np.zeros(len(slots), dtype=bool)
        if hold_priority is not None:
            below = cols.np_priority[slots[new]] <= hold_priority
            held[new[below]] = True
            new = new[~below]
        if allowed is not None and len(new) > allowed:
            new_slots = slots[new]
            deadline = cols.np_arrival[new_slots] + cols.np_ttft_ms[new_slots] / 1000.0
            held[new[np.lexsort((deadline, deadline < now))[allowed:]]] = True  # as _ttft_slack
        num_held = int(np.count_nonzero(held))
        if num_held:
            slots = slots[~held]
    return cols.requests[slots].tolist(), slots, num_held


def _keys_by_row(requests: Iterable[Request], now: float, p: RotaryParams) -> tuple[np.ndarray, ...]:
    """Whether each request lags (`_lags`), and its `_rank` key but the SLO-lost flag, in columns."""
    keys = [_rank(now, p, r) for r in requests]
    lags = np.array([_lags(k) for k in keys], dtype=bool)
    not_due = np.array([k[0] for k in keys], dtype=bool)
    neg_priority = np.array([k[1] for k in keys], dtype=np.int64)
    return lags, not_due, neg_priority, np.array([k[3] for k in keys], dtype=float), np.array([k[4] for k in keys])


def _keys_in_columns(cols: RankingColumns, slots: np.ndarray, now: float, p: RotaryParams) -> tuple[np.ndarray, ...]:
    """`_keys_by_row` of the requests in these slots, as `_rank` computes them."""
    tbt, t_last = cols.np_tbt_ms[slots], cols.np_t_last[slots]
    stall_s = cols.np_stall_ms[slots] / 1000.0
    due = now >= t_last + STALL_DUE_SHARE * stall_s  # (False without a token: NaN)
    vlt = np.where(
        np.isnan(t_last),  # no token yet: its TTFT lag, else its TBT lag
        np.maximum(0.0, now - cols.np_arrival[slots] - p.beta_f * cols.np_ttft_ms[slots] / 1000.0),
        p.alpha * np.maximum(0.0, now - t_last - p.beta_b * tbt / 1000.0),
    )
    lost = np.where(
        np.isnan(t_last),
        now > cols.np_arrival[slots] + cols.np_ttft_ms[slots] / 1000.0,
        cols.np_max_gap[slots] * 1000.0 > tbt,
    )
    lags = due | ((vlt > 0.0) & ~lost)
    deadline = np.where(due, t_last + stall_s, -vlt)
    return lags, ~due, np.where(due, 0, -cols.np_priority[slots]), deadline, np.where(due, cols.np_arrival[slots], 0.0)


def _lagging_ranked(
    sched: SchedulerView, p: RotaryParams, waiting: list[Request], waiting_slots: np.ndarray | None, now: float
) -> tuple[list[Request], np.ndarray, np.ndarray, list[Request]]:
    """The lagging ones (`_lags`) of `waiting` and of the rotary requests as `rank` orders them,
    with each one's admission blocks and copies bound where the rotary columns know them (-1: to
    be asked), and the others (patient), in list order (the waiting first, the TBT-lost rotary
    ones last). Many (under contention, hundreds each step) are ranked in their columns; few, one
    at a time. Of the TBT-lost rotary ones only those due (stall_due_at) lag: they are looked at
    one by one."""
    on_time = sched.rotary_on_time
    due_lost: list[Request] = []
    lost: list[Request] = []
    for r in sched.rotary_lost:
        (due_lost if _waited(r, now, STALL_DUE_SHARE) else lost).append(r)
    many_rotary = len(on_time) >= sched.rows_per_vector
    if waiting_slots is None and not many_rotary:
        lagging, patient = [], []  # (the lagging with their ranking keys, computed once)
        for r in [*waiting, *on_time, *due_lost]:
            key = _rank(now, p, r)
            if _lags(key):
                lagging.append((key, r))
            else:
                patient.append(r)
        ranked = [r for _, r in sorted(lagging, key=itemgetter(0))]
        # A rotary one's blocks are known while none of its content is in use (SchedulerView.known_swap_in_blocks).
        known = {} if sched.kv.pool.watched_in_use else sched.known_swap_in_blocks
        blocks = [known.get(r, 0) or -1 for r in ranked]
        bounds = [sched.admission_copies_bound(r) if n > 0 else -1 for r, n in zip(ranked, blocks, strict=True)]
        return ranked, np.array(blocks, dtype=np.int64), np.array(bounds, dtype=np.int64), patient + lost
    if waiting_slots is None:
        waiting_keys = _keys_by_row(waiting, now, p)
        waiting_requests = np.empty(len(waiting), dtype=object)
        waiting_requests[:] = waiting
    else:
        waiting_keys = _keys_in_columns(sched.waiting_columns, waiting_slots, now, p)
        waiting_requests = sched.waiting_columns.requests[waiting_slots]
    unknown = np.full(len(waiting), -1, dtype=np.int64)
    if many_rotary:
        cols = sched.rotary_columns
        slots = cols.in_arrival_order()
        rotary = cols.requests[slots]
        rotary_keys = _keys_in_columns(cols, slots, now, p)
        unshared = not sched.kv.pool.watched_in_use  # (the blocks column counts no block shared with another)
        rotary_blocks = cols.np_blocks[slots] if unshared else np.full(len(slots), -1, dtype=np.int64)
        rotary_bounds = cols.np_copies[slots]
    else:
        rotary = np.empty(len(on_time), dtype=object)
        rotary[:] = on_time
        rotary_keys = _keys_by_row(on_time, now, p)
        rotary_blocks = rotary_bounds = np.full(len(on_time), -1, dtype=np.int64)
    due = np.empty(len(due_lost), dtype=object)
    due[:] = due_lost
    due_keys = _keys_by_row(due_lost, now, p)
    everyone = np.concatenate((waiting_requests, rotary, due))
    lags, not_due, neg_priority, x, arrival = (
        np.concatenate(k) for k in zip(waiting_keys, rotary_keys, due_keys, strict=True)
    )
    lagging = np.flatnonzero(lags)
    keys = (arrival[lagging], x[lagging], neg_priority[lagging], not_due[lagging])
    order = lagging[np.lexsort(keys)]  # stable: ties in list order
    no_figures = np.full(len(due_lost), -1, dtype=np.int64)
    blocks = np.concatenate((unknown, rotary_blocks, no_figures))
    bounds = np.concatenate((unknown, rotary_bounds, no_figures))
    return everyone[order].tolist(), blocks[order], bounds[order], everyone[~lags].tolist() + lost


def _admitted_at_once(blocks: np.ndarray, bounds: np.ndarray, left: int, xfer_left: int) -> int:
    """How many of the ranked requests at the front `decide`'s admission loop admits one after
    the other, each known (blocks and copies bound) and within what is left of both when its turn
    comes: the loop starts after them."""
    if not len(blocks) or left <= 0 or xfer_left <= 0:
        return 0
    took, moved = np.cumsum(blocks), np.cumsum(bounds)
    fails = (blocks < 0) | (bounds < 0) | (took > left) | (moved > xfer_left)
    fails[1:] |= (took[:-1] >= left) | (moved[:-1] >= xfer_left)  # nothing left before its turn
    first = int(fails.argmax())
    return first if fails[first] else len(blocks)


class RotaryPolicy:
    name = "rotary"
    uses_cpu_tier = True

    def __init__(self, params: RotaryParams | None = None) -> None:
        self.params = params or RotaryParams()

    def decide(self, sched: SchedulerView, now: float) -> Decision:
        kv, p = sched.kv, self.params
        by_row = sched.num_running < sched.rows_per_vector
        if not sched.waiting and not sched.rotary and not _prefilling(sched.batch, by_row):
            return Decision()  # only decodes run: no token budget binds them, nothing to admit
        guard = tbt_guard(sched, now, p.tbt_headroom) if p.slo_admission else None
        hold = stall_hold(sched, now) if p.slo_admission else None
        allowed = guard.new_requests if guard is not None else None
        waiting, waiting_slots, held = _unheld_waiting(sched, allowed, hold, now)
        budget = guard.token_budget if guard is not None else None
        residency = max(p.min_residency_s, guard.residency_s if guard is not None else 0.0)
        others = [*waiting, *sched.rotary]  # the rotary ones in arrival order
        held_for_streams = hold is not None and held > 0
        if not others:  # nothing to admit: no contention
            return Decision(token_budget=budget, held=held, guard=guard, stall_hold=held_for_streams)
        free = kv.num_free_blocks - _growth_blocks(sched, by_row)
        taken: dict[str, int] = {}

        def blocks(r: Request) -> int:
            if r.request_id not in taken:
                taken[r.request_id] = sched.admission_blocks(r)
            return taken[r.request_id]

        total = 0
        for r in others:  # contention check; stops at the first sign of contention
            total += blocks(r)
            if total > free:
                break
        else:  # no contention: plain FCFS, rotate nothing
            return Decision(
                admit=by_arrival(others), token_budget=budget, held=held, guard=guard, stall_hold=held_for_streams
            )

        # Not due, and not lagging or its SLO is lost anyway: patient, it takes free blocks only,
        # never displaces a running one (a lost request bounced in and out costs two copies per
        # token). Under overload most rotary requests are: the scheduler ranks only those that
        # fit. (In `others` order but for the TBT-lost rotary ones last.)
        ranked, known_blocks, known_bounds, patient = _lagging_ranked(sched, p, waiting, waiting_slots, now)
        xfer = p.transfer_budget_blocks
        left = free + xfer
        # Rule 6 at selection: what cannot move this step is not chosen. A request's copies are at
        # most its CPU blocks and tail (admission_copies_bound); while the admitted ones' bounds fit
        # B_xfer every check passes whatever their exact counts, which look up each block in the GPU
        # cache: they are counted once the budget may bind (`xfer_left` is exact then, else a
        # lower bound).
        xfer_left, exact = xfer, False
        admit: list[Request] = []

        def exact_left() -> int:
            return xfer - sum(map(sched.admission_copies, admit))

        # Under contention most of the ranked rotary ones are known and the first of them fit:
        # they are admitted at once.
        first = _admitted_at_once(known_blocks, known_bounds, left, xfer) if len(ranked) >= sched.rows_per_vector else 0
        if first:
            admit = ranked[:first]
            left -= int(known_blocks[:first].sum())
            xfer_left -= int(known_bounds[:first].sum())
        rest = zip(ranked[first:], known_blocks[first:].tolist(), known_bounds[first:].tolist(), strict=True)
        for r, n, bound in rest:
            if xfer_left <= 0 and not exact:
                xfer_left, exact = exact_left(), True
            if left <= 0 or xfer_left <= 0:
                break  # Prioritize is done: nothing more fits under free + B_xfer
            if n < 0:
                n = blocks(r)
            if n > left:
                continue
            if bound < 0:
                bound = sched.admission_copies_bound(r)
            copies = sched.admission_copies(r) if exact else bound
            if copies > xfer_left:
                if not exact:
                    xfer_left, exact = exact_left(), True
                    copies = sched.admission_copies(r)
                # A request that could never come back within one step's budget still goes to the
                # scheduler, which prefills it again instead.
                if copies > xfer_left and copies <= xfer:
                    continue
            admit.append(r)
            left -= n
            xfer_left -= copies
        to_free = xfer - left
        rotate_out = []
        if ranked and _waited(ranked[0], now, STALL_URGENT_SHARE):
            # The stream first in line will stall past its budget unless it comes back now: it
            # displaces any that has stayed the floor, even where the TBT guard keeps everyone.
            residency = min(residency, p.min_residency_s)
        if to_free > 0:
            for r in _running_worst_first(sched.batch, now, residency, by_row):
                if to_free <= 0:
                    break
                if self._may_rotate_out(sched, r, now, residency):
                    rotate_out.append(r)
                    to_free -= kv.owned_blocks(r)
        return Decision(
            rotate_out,
            admit,
            strict_order=False,
            token_budget=budget,
            patient=patient,
            held=held,
            guard=guard,
            stall_hold=held_for_streams,
        )

    @staticmethod
    def _may_rotate_out(sched: SchedulerView, req: Request, now: float, residency_s: float) -> bool:
        """A running decode that has stayed `residency_s` (no thrash: one rotation buys several
        tokens; one whose TBT SLO is already missed may leave at once) and will still compute after
        its pending token."""
        stayed = now - (req.t_run if req.t_run is not None else now)
        if req.tbt_missed:  # it may leave sooner, but not before one TBT SLO: no bouncing every step
            residency_s = min(residency_s, req.slo.tbt_ms / 1000.0)
        return (
            stayed >= residency_s
            and req.status is RequestStatus.RUNNING
            and req.in_decode
            and not req.ends_after_pending()
        )

    def rank(self, requests: Sequence[Request], now: float) -> list[Request]:
        """Priority first (SLO classes), then the requests whose TBT can still be met, then lag;
        stable: arrival order on ties. Admission takes the non-running requests best first, and
        rotation the running ones worst first: each group is ranked on its own."""
        return sorted(requests, key=partial(_rank, now, self.params))

    def victim(self, running: RunningBatch, first: int, now: float) -> Request:
        """The candidate with the smallest VLT, -(now - t_run): the longest running (the first
        in running order on a tie)."""
        slots = running.order[first:]
        return running.requests[slots[int(np.argmin(-(now - running.np_t_run[slots])))]]

    def rotation_order(self, running: Sequence[Request], now: float) -> list[Request]:
        """The reverse of `decide`'s ranking: lowest priority, TBT already missed, longest running."""
        return sorted(running, key=lambda r: (r.priority, not r.tbt_missed, virtual_lag_time(r, now, self.params)))


class WatermarkPolicy:
    name = "watermark"
    uses_cpu_tier = True

    def __init__(self, watermark_blocks: int) -> None:
        self.watermark_blocks = watermark_blocks

    def decide(self, sched: SchedulerView, now: float) -> Decision:
        rotate_out = []
        free = sched.kv.num_free_blocks
        for r in sorted(sched.running, key=lambda r: r.t_run or 0.0):
            if free >= self.watermark_blocks:
                break
            if r.in_decode and not r.ends_after_pending():
                rotate_out.append(r)
                free += sched.kv.owned_blocks(r)
        return Decision(rotate_out, by_arrival([*sched.waiting, *sched.rotary]))

    def victim(self, running: RunningBatch, first: int, now: float) -> Request:
        return running.requests[running.order[-1]]

    def rotation_order(self, running: Sequence[Request], now: float) -> list[Request]:
        return sorted(running, key=lambda r: r.t_run or 0.0)  # the oldest first, as `decide` rotates

    def rank(self, requests: Sequence[Request], now: float) -> list[Request]:
        return by_arrival(requests)


def make_policy(name: str, rotary: RotaryParams | None = None, num_gpu_blocks: int = 0) -> Policy:
    rotary = rotary or RotaryParams()
    if name == "fcfs":
        return FCFSPolicy()
    if name == "rotary":
        return RotaryPolicy(rotary)
    if name == "watermark":
        return WatermarkPolicy(min(rotary.transfer_budget_blocks, max(1, num_gpu_blocks // 10)))
    raise ValueError(f"unknown policy {name!r}; choose one of fcfs, rotary, watermark")
