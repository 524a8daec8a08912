"""Scheduling policies: the decisions a scheduler step delegates.

`fcfs` is the vLLM v1 baseline: running requests first, then waiting ones in arrival order, and
when blocks run out the newest running request is preempted by recompute.
"""

from __future__ import annotations

from collections.abc import Sequence

from superinfer.engine.core.request import Request


class FCFSPolicy:
    name = "fcfs"

    def victim(self, candidates: Sequence[Request]) -> Request:
        """The running request to preempt when blocks run out: the most recently admitted."""
        return candidates[-1]


POLICIES = {"fcfs": FCFSPolicy}
PLANNED = ("rotary", "watermark")


def make_policy(name: str) -> FCFSPolicy:
    if name in POLICIES:
        return POLICIES[name]()
    if name in PLANNED:
        raise ValueError(f"policy {name!r} is not available in this build yet; use 'fcfs'")
    raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
