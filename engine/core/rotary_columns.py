"""The on-time rotary requests' ranking fields in columns.

Under memory contention a few hundred requests wait in the CPU tier, and each step the rotary
policy ranks every one whose TBT SLO can still be met by its Virtual Lag Time, and counts the
blocks and copies each would take to come back. Those figures barely change while a request waits:
its blocks and copies are fixed when it is rotated out, its last token's time and its largest gap
when a token still in flight lands. So they live here, one slot per request (as the running
batch's counters do), and the policy ranks them with a few vector operations instead of reading
each request's fields through its properties every step.

The scheduler keeps the columns equal to `Scheduler.rotary_on_time`: `add` when a request is
rotated out on time, `remove` when it leaves (swapped back in, recomputed, finished), `refresh` when
its pending token lands, `rebuild` when requests lose their TBT SLO. `ordered` gives the slots in
that list's order (arrival, then the order they were rotated out in).
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
    "seq": "q",  # when it was added: ties on arrival keep the list's order
    "priority": "q",
    "ttft_ms": "d",  # its SLOs
    "tbt_ms": "d",
    "t_last": "d",  # its last token's time (NaN: none yet)
    "max_gap": "d",  # its largest gap between tokens
    "num_tokens": "q",  # len(token_ids)
    "blocks": "q",  # GPU blocks it takes to come back while none of its content is in use
    "copies": "q",  # at most the blocks copied to bring it back: its CPU blocks and tail
    "active": "b",
}
_DTYPES = {"q": np.int64, "d": np.float64, "b": np.bool_}


class RotaryColumns:
    """Columns indexed by slot (each an `array.array` under a numpy view, as in RunningBatch)."""

    requests: np.ndarray  # of Request | None

    def __init__(self, capacity: int = 64) -> None:
        self.free_slots: list[int] = []
        self.capacity = 0
        self.next_seq = 0
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
        return self.capacity - len(self.free_slots)

    def add(self, req: Request, blocks: int, copies: int) -> None:
        if not self.free_slots:
            self._grow(2 * self.capacity)
        slot = self.free_slots.pop()
        self.arrival[slot], self.seq[slot] = req.arrival_time, self.next_seq
        self.next_seq += 1
        self.priority[slot] = req.priority
        self.ttft_ms[slot], self.tbt_ms[slot] = req.slo.ttft_ms, req.slo.tbt_ms
        self.blocks[slot], self.copies[slot] = blocks, copies
        self.active[slot] = True
        self.requests[slot] = req
        req._rotary_slot = slot
        self.refresh(req)

    def refresh(self, req: Request) -> None:
        """Its pending token landed: its last token's time, largest gap and token count."""
        slot = req._rotary_slot
        t_last = req._t_last_token
        self.t_last[slot] = math.nan if t_last is None else t_last
        self.max_gap[slot] = req._max_gap_s
        self.num_tokens[slot] = len(req._token_ids)

    def remove(self, req: Request) -> None:
        slot = req._rotary_slot
        self.active[slot] = False
        self.requests[slot] = None
        self.free_slots.append(slot)
        req._rotary_slot = -1

    def rebuild(self, requests: Iterable[Request], figures: Iterable[tuple[int, int]]) -> None:
        """Hold exactly these requests, in this order, with their (blocks, copies)."""
        for slot in np.flatnonzero(self.np_active).tolist():
            self.remove(self.requests[slot])
        for req, (blocks, copies) in zip(requests, figures, strict=True):
            self.add(req, blocks, copies)

    def ordered(self) -> np.ndarray:
        """The slots in `Scheduler.rotary_on_time`'s order: by arrival, then by when added."""
        slots = np.flatnonzero(self.np_active)
        return slots[np.lexsort((self.np_seq[slots], self.np_arrival[slots]))]
