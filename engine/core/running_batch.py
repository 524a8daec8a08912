"""The running requests' per-step counters in columns: what vLLM v1 calls its persistent batch.

A running request owns a slot. While it runs, its counters that change every step
(`num_computed_tokens`, `num_pending_tokens`, `last_step`, `step_before_last`, `t_last_token`,
`max_gap_s`) live in the slot, not in the Request: the Request's properties read and write the
slot, and the scheduler serves thousands of plain decodes with a few vector operations instead of
a Python loop over them. The batch also mirrors what the decode path reads of each request (its
token count and newest token, block count and blocks written through to the CPU tier, length
limit, prompt length, TBT SLO, whether it is a plain decode), kept current by the scheduler, and
counts the tokens that may stop a running request. When the request stops running, its counters
go back into the Request.

A decode's new tokens and the gaps between them wait in the slot's tails (rows of two 2-D
arrays: one numpy write a step for all rows) and move into the request's `token_ids` and
`token_gaps` lists when a tail is full, when the request stops running, or when something reads
the list (the Request properties empty the tail first). The gaps are read when the request ends
(its p99 gap), its tokens when a token may stop it, when its blocks are hashed, and when it
leaves the batch; the engine takes each update's tokens from the scheduler (`Scheduler.update`),
the metrics its gaps from the TokenTiming. Appending to a thousand Python lists every step cost
about a tenth of the scheduler's host time for the gaps, a fifth for the tokens.

A slot freed and handed to another request gets a new generation: a plan made before that
(async scheduling) names its rows by slot and generation, so its update finds which rows still
belong to the same running request.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from itertools import repeat

import numpy as np

from superinfer.engine.core.request import Request

# (column, array typecode): the Request counters first (moved in and out by add and remove).
_COLUMNS = {
    "computed": "q",  # Request._num_computed_tokens
    "pending": "q",  # ._num_pending_tokens
    "last_step": "q",  # ._last_step
    "prev_step": "q",  # ._step_before_last
    "t_last": "d",  # ._t_last_token (NaN: no token yet)
    "max_gap": "d",  # ._max_gap_s
    "num_tokens": "q",  # len(token_ids)
    "last_token": "q",  # token_ids[-1]
    "nblocks": "q",  # len(block_ids)
    "written": "q",  # len(cpu_block_ids): its first blocks with a copy in the CPU tier
    "limit": "q",  # length_limit
    "prompt_len": "q",  # len(prompt_token_ids)
    "plain": "b",  # no min_tokens: a decode row of it samples with nothing banned
    "tbt_ms": "d",  # its TBT SLO
    "priority": "q",
    "t_run": "d",  # when it started running
    "gen": "q",  # bumped each time the slot is freed
    "tail_gaps": "q",  # gaps in the slot's tail, not yet in token_gaps
    "tail_tokens": "q",  # tokens in the slot's tail, not yet in token_ids
    "slo_class": "q",  # its SLO class, as an index into slo_classes
}
_DTYPES = {"q": np.int64, "d": np.float64, "b": np.bool_}  # "b": 0 or 1 only
# Below this many rows a loop over the columns beats vector operations (numpy's cost per call):
# the scheduler's default Scheduler.rows_per_vector (its "small batches" section has the
# measurement) and blocks_written's.
ROWS_PER_VECTOR = 48


# Each running request, and what its plan rows share.
_OBJECTS = ("requests", "request_ids", "samplings", "prompts")


def _into_tails(
    slots: np.ndarray, values: np.ndarray, tails: np.ndarray, counts: np.ndarray, flush: Callable[[int], None]
) -> None:
    """One value for each of these (distinct) slots into its row of `tails` (`counts`: how many
    each row holds); a row that fills up is flushed."""
    n = counts[slots]
    tails[slots, n] = values
    n += 1
    counts[slots] = n
    full = n == tails.shape[1]
    if np.count_nonzero(full):
        for slot in slots[full].tolist():
            flush(slot)


class RunningBatch:
    """Columns indexed by slot. `order` holds the running requests' slots in running order.

    Each counter column is an `array.array` (the Request properties index it: a plain Python
    int, fast) under a numpy view of the same memory (`np_<column>`: the vector operations). The
    object columns (`requests`, `request_ids`, `samplings`, `prompts`) are numpy object arrays: a
    plan's or an update's rows gather them by an array of slots. `gap_tail` and `token_tail` hold
    each slot's newest gaps and tokens, `tail` of each at most."""

    requests: np.ndarray  # of Request | None
    request_ids: np.ndarray  # of str | None
    samplings: np.ndarray  # of SamplingParams | None
    prompts: np.ndarray  # of list[int] | None

    def __init__(self, capacity: int = 64, tail: int = 64) -> None:
        self.gap_tail = np.zeros((0, tail), dtype=np.float64)  # by slot: its newest gaps
        self.token_tail = np.zeros((0, tail), dtype=np.int64)  # by slot: its newest tokens
        self.slo_classes: list[str] = []  # every SLO class a running request has had, in order seen
        self.free_slots: list[int] = []
        self.leaving: list[int] = []  # freed slots still in `order` (see remove)
        # Every token that may stop a running request (its EOS ids, its stop_token_ids), with how
        # many running requests it may stop: few distinct ones (a model's EOS ids, mostly).
        self.stop_counts: dict[int, int] = {}
        self.stop_tokens: list[int] = []
        self.order = np.empty(0, dtype=np.int64)
        self.capacity = 0
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        for name, code in _COLUMNS.items():
            old = getattr(self, name, array(code))
            new = array(code, old)  # a copy: numpy views of the old one may still exist
            new.extend(repeat(0, capacity - len(old)))
            setattr(self, name, new)
            setattr(self, f"np_{name}", np.frombuffer(new, dtype=_DTYPES[code]))
        for name in _OBJECTS:
            column = np.full(capacity, None, dtype=object)
            column[: self.capacity] = getattr(self, name, ())
            setattr(self, name, column)
        for name in ("gap_tail", "token_tail"):
            old_tail = getattr(self, name)
            tail = np.zeros((capacity, old_tail.shape[1]), dtype=old_tail.dtype)
            tail[: self.capacity] = old_tail
            setattr(self, name, tail)
        self.free_slots.extend(range(capacity - 1, self.capacity - 1, -1))  # lowest slot first
        self.capacity = capacity

    def blocks_written(self) -> int:
        """GPU blocks of the running requests that have a copy in the CPU tier."""
        order = self.order
        if len(order) < ROWS_PER_VECTOR:
            written, nblocks = self.written, self.nblocks
            return sum(min(written[slot], nblocks[slot]) for slot in order.tolist())
        return int(np.minimum(self.np_written[order], self.np_nblocks[order]).sum())

    def add_gaps(self, slots: np.ndarray, gaps: np.ndarray) -> None:
        """A gap for each of these (distinct) slots: into their tails, the full tails into the lists."""
        _into_tails(slots, gaps, self.gap_tail, self.np_tail_gaps, self.flush_gaps)

    def add_tokens(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """A new token for each of these (distinct) slots: into their tails, the full tails into
        the requests' token lists. (The caller keeps num_tokens and last_token.)"""
        _into_tails(slots, tokens, self.token_tail, self.np_tail_tokens, self.flush_tokens)

    def flush_gaps(self, slot: int) -> None:
        """Move the slot's gap tail into its request's gap list."""
        self.requests[slot]._token_gaps.extend(self.gap_tail[slot, : self.tail_gaps[slot]].tolist())
        self.tail_gaps[slot] = 0

    def flush_tokens(self, slot: int) -> None:
        """Move the slot's token tail into its request's token list."""
        self.requests[slot]._token_ids.extend(self.token_tail[slot, : self.tail_tokens[slot]].tolist())
        self.tail_tokens[slot] = 0

    def by_class(self, slots: np.ndarray, values: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """`values` (one per slot) grouped by their slots' SLO classes."""
        if len(self.slo_classes) == 1:
            return [(self.slo_classes[0], values)]
        codes = self.np_slo_class[slots]
        return [(self.slo_classes[code], values[codes == code]) for code in np.unique(codes).tolist()]

    def may_stop(self, tokens: np.ndarray) -> np.ndarray:
        """Whether each token may stop a running request (some running request's stop token)."""
        if len(self.stop_tokens) > 8:
            return np.isin(tokens, self.stop_tokens)
        found = np.zeros(len(tokens), dtype=bool)
        for token in self.stop_tokens:
            found |= tokens == token
        return found

    def add(self, req: Request) -> None:
        """The request starts running (last in running order): its counters move into a slot."""
        if not self.free_slots:
            self._grow(2 * self.capacity)
        slot = self.free_slots.pop()
        self.computed[slot], self.pending[slot] = req._num_computed_tokens, req._num_pending_tokens
        self.last_step[slot], self.prev_step[slot] = req._last_step, req._step_before_last
        self.max_gap[slot] = req._max_gap_s
        t_last = req._t_last_token
        self.t_last[slot] = math.nan if t_last is None else t_last
        self.num_tokens[slot] = len(req.token_ids)
        self.last_token[slot] = req.token_ids[-1]
        self.nblocks[slot], self.written[slot] = len(req.block_ids), len(req.cpu_block_ids)
        self.limit[slot] = req.length_limit
        self.prompt_len[slot] = len(req.prompt_token_ids)
        self.plain[slot] = not req.sampling.min_tokens
        self.tbt_ms[slot] = req.slo.tbt_ms
        if req.slo_class not in self.slo_classes:
            self.slo_classes.append(req.slo_class)
        self.slo_class[slot] = self.slo_classes.index(req.slo_class)
        self.priority[slot] = req.priority
        self.t_run[slot] = req.t_run
        counts = self.stop_counts
        for token in req.stop_token_set:
            counts[token] = counts.get(token, 0) + 1
            if counts[token] == 1:
                self.stop_tokens = list(counts)
        self.requests[slot], self.request_ids[slot] = req, req.request_id
        self.samplings[slot], self.prompts[slot] = req.sampling, req.prompt_token_ids
        req._batch, req._slot = self, slot
        self.order = np.concatenate((self.order, (slot,)))

    def remove(self, req: Request, reorder: bool = True) -> None:
        """The request stops running: its counters go back into it and its slot is freed. With
        `reorder=False` the slot stays in `order` until `reorder()` (a wave of them at once)."""
        slot = req._slot
        self.flush_gaps(slot)
        self.flush_tokens(slot)
        req._num_computed_tokens, req._num_pending_tokens = self.computed[slot], self.pending[slot]
        req._last_step, req._step_before_last = self.last_step[slot], self.prev_step[slot]
        req._max_gap_s = self.max_gap[slot]
        t_last = self.t_last[slot]
        req._t_last_token = None if t_last != t_last else t_last
        req._batch, req._slot = None, -1
        counts = self.stop_counts
        for token in req.stop_token_set:
            counts[token] -= 1
            if not counts[token]:
                del counts[token]
                self.stop_tokens = list(counts)
        for name in _OBJECTS:
            getattr(self, name)[slot] = None
        self.gen[slot] += 1
        self.free_slots.append(slot)
        self.leaving.append(slot)
        if reorder:
            self.reorder()

    def reorder(self) -> None:
        """Take the slots freed since out of `order`."""
        slots, self.leaving = self.leaving, []
        if len(slots) > 8:  # (isin's cost is mostly fixed)
            self.order = self.order[np.isin(self.order, slots, invert=True)]
        elif slots:
            keep = self.order != slots[0]
            for slot in slots[1:]:
                keep &= self.order != slot
            self.order = self.order[keep]
