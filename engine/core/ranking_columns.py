"""The ranking fields of the requests that wait off the GPU, in columns.

Under memory contention hundreds of requests wait: new ones in the waiting queue, others rotated
out to the CPU tier. Each step the rotary policy ranks every one whose TBT SLO can still be met by
its Virtual Lag Time, and counts the blocks and copies each rotary one would take to come back.
Those figures barely change while a request waits: its SLOs, arrival and priority never, its
blocks and copies are fixed when it is rotated out, its last token's time and largest gap change
when a token still in flight lands. So they live here, one slot per request (as the running
batch's counters do), and the policy ranks them with a few vector operations instead of reading
each request's fields through its properties every step.

The scheduler keeps two: one equal to `Scheduler.waiting` (in queue order: `add` at the back,
`add(first=True)` at the front), one equal to `Scheduler.rotary_on_time` (in arrival order, ties in
the order added); `remove` when a request leaves, `refresh` when its pending token lands, `rebuild`
when rotary requests lose their TBT SLO.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from itertools import repeat

import numpy as np

from superinfer.engine.core.request import Request

_COLUMNS = {
    "arrival": "d",  # arrival_time
    "seq": "q",  # when it was added (negative: at the front): the order among equals
    "priority": "q",
    "ttft_ms": "d",  # its SLOs
    "tbt_ms": "d",
    "stall_ms": "d",  # its stall budget (SLO.stall_budget_ms)
    "t_last": "d",  # its last token's time (NaN: none yet)
    "max_gap": "d",  # its largest gap between tokens
    "num_tokens": "q",  # len(token_ids)
    "blocks": "q",  # rotary: GPU blocks it takes to come back while none of its content is in use
    "copies": "q",  # rotary: at most the blocks copied to bring it back (its CPU blocks and tail)
    "active": "b",
}
_DTYPES = {"q": np.int64, "d": np.float64, "b": np.bool_}


class RankingColumns:
    """Columns indexed by slot (each an `array.array` under a numpy view, as in RunningBatch)."""

    requests: np.ndarray  # of Request | None

    def __init__(self, capacity: int = 64) -> None:
        self.slot_of: dict[Request, int] = {}
        self.free_slots: list[int] = []
        self.capacity = 0
        self.next_seq = 1
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        for name, code in _COLUMNS.items():
            new = array(code, getattr(self, name, array(code)))  # a copy: views of the old may exist
            new.extend(repeat(0, capacity - len(new)))
            setattr(self, name, new)
            setattr(self, f"np_{name}", np.frombuffer(new, dtype=_DTYPES[code]))
        requests = np.full(capacity, None, dtype=object)
        requests[: self.capacity] = getattr(self, "requests", ())
        self.requests = requests
        self.free_slots.extend(range(capacity - 1, self.capacity - 1, -1))  # lowest slot first
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, req: Request) -> bool:
        return req in self.slot_of

    def add(self, req: Request, blocks: int = 0, copies: int = 0, first: bool = False) -> None:
        if not self.free_slots:
            self._grow(2 * self.capacity)
        slot = self.slot_of[req] = self.free_slots.pop()
        self.arrival[slot], self.seq[slot] = req.arrival_time, -self.next_seq if first else self.next_seq
        self.next_seq += 1
        self.priority[slot] = req.priority
        self.ttft_ms[slot], self.tbt_ms[slot] = req.slo.ttft_ms, req.slo.tbt_ms
        self.stall_ms[slot] = req.slo.stall_budget_ms
        self.blocks[slot], self.copies[slot] = blocks, copies
        self.active[slot] = True
        self.requests[slot] = req
        self.refresh(req)

    def refresh(self, req: Request) -> None:
        """Its pending token landed: its last token's time, largest gap and token count."""
        slot = self.slot_of[req]
        t_last = req._t_last_token
        self.t_last[slot] = math.nan if t_last is None else t_last
        self.max_gap[slot] = req._max_gap_s
        self.num_tokens[slot] = len(req._token_ids)

    def remove(self, req: Request) -> None:
        slot = self.slot_of.pop(req)
        self.active[slot] = False
        self.requests[slot] = None
        self.free_slots.append(slot)

    def rebuild(self, requests: Iterable[Request], figures: Iterable[tuple[int, int]]) -> None:
        """Hold exactly these requests, in this order, with their (blocks, copies)."""
        for req in list(self.slot_of):
            self.remove(req)
        for req, (blocks, copies) in zip(requests, figures, strict=True):
            self.add(req, blocks, copies)

    def in_queue_order(self) -> np.ndarray:
        """The slots in the order added, those added at the front first (the waiting queue's)."""
        slots = np.flatnonzero(self.np_active)
        return slots[np.argsort(self.np_seq[slots], kind="stable")]

    def in_arrival_order(self) -> np.ndarray:
        """The slots by arrival, then in the order added (`Scheduler.rotary_on_time`'s)."""
        slots = np.flatnonzero(self.np_active)
        return slots[np.lexsort((self.np_seq[slots], self.np_arrival[slots]))]
