"""What a policy may read of the scheduler (`Policy.decide` gets this, not the scheduler).

The queues in their orders, the running batch, the KV cache, the step-time model, and what
admitting a non-running request would take. The `Scheduler` is one, structurally: a policy is
handed the scheduler itself (no copy on the hot path), typed as this view, so that what a policy
depends on is written down here and nowhere else.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Protocol

from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.ranking_columns import RankingColumns
from superinfer.engine.core.request import Request
from superinfer.engine.core.running_batch import RunningBatch
from superinfer.engine.core.step_time import StepTimeModel


class SchedulerView(Protocol):
    @property
    def waiting(self) -> deque[Request]:
        """Requests not started yet, in arrival order."""

    @property
    def rotary(self) -> list[Request]:
        """Requests rotated out to the CPU tier, in arrival order."""

    @property
    def rotary_on_time(self) -> list[Request]:
        """The rotary requests whose TBT SLO still holds, in the same order."""

    @property
    def rotary_lost(self) -> list[Request]:
        """The others."""

    @property
    def waiting_columns(self) -> RankingColumns:
        """What the rotary policy ranks `waiting` by, in columns."""

    @property
    def rotary_columns(self) -> RankingColumns:
        """The same for `rotary_on_time`."""

    @property
    def batch(self) -> RunningBatch:
        """The running requests and their counters, in running order."""

    @property
    def running(self) -> list[Request]: ...

    @property
    def num_running(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def rows_per_vector(self) -> int:
        """From how many rows on a scan is worth numpy's cost per call."""

    @property
    def kv(self) -> KVCacheManager: ...

    @property
    def step_time(self) -> StepTimeModel: ...

    @property
    def known_swap_in_blocks(self) -> Mapping[Request, int]:
        """Free GPU blocks each rotary request takes to come back (0: look at its blocks)."""

    def admission_blocks(self, req: Request) -> int:
        """Free GPU blocks a non-running request takes to be admitted and finish its next step."""
        ...

    def admission_copies(self, req: Request) -> int:
        """Blocks copied in to admit it (a rotary one)."""
        ...

    def admission_copies_bound(self, req: Request) -> int:
        """At least admission_copies, without looking at the GPU cache."""
        ...
