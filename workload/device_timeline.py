"""The virtual device time of engine steps, under the executor's own ordering rules.

`StepCost` prices one op: a model step (fixed + per token + per sequence), a copy (per block, each
direction at its own bandwidth). `DeviceTimeline` places each step's ops on lanes the way the
executor does (`engine/worker/duplex.py`, `engine/engine.py`):
- with async scheduling, step t is submitted when the host has collected step t-2 (while step
  t-1 still runs); without it, once step t-1 is collected;
- copy-in waits for the copy-out that wrote a CPU block it reads and for a compute that still
  touches a destination, where the plan names them; copy-out waits for the compute that wrote its
  blocks; compute waits for its copy-in and for a copy-out still reading a block it reuses;
- `full` duplex: the two directions on their own lanes; `half`: one shared copy lane, copy-in
  first; `serial`: copies on the compute lane, before the step;
- a step's tokens reach the host when all its ops have ended (the host waits for them all).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from superinfer.engine.core.plan import StepPlan

# The executor's lanes per duplex mode, (copy-out lane, copy-in lane): engine/worker/duplex.py's
# COPY_LANES, repeated here so the timeline (and the simulator) never import torch; a test keeps
# the two equal.
COPY_LANES: dict[str, tuple[str, str]] = {
    "full": ("copy_out", "copy_in"),
    "half": ("copy_out", "copy_out"),
    "serial": ("compute", "compute"),
}


@dataclass(frozen=True)
class StepCost:
    base_s: float = 0.010
    per_token_s: float = 0.0001
    per_seq_s: float = 0.0002
    per_block_out_s: float = 0.0001  # GPU -> CPU
    per_block_in_s: float = 0.0001  # CPU -> GPU

    def compute(self, plan: StepPlan) -> float:
        if not plan.num_seqs:
            return 0.0
        return self.base_s + self.per_token_s * plan.num_tokens + self.per_seq_s * plan.num_seqs


@dataclass
class DeviceTimeline:
    cost: StepCost = field(default_factory=StepCost)
    duplex: str = "full"
    async_scheduling: bool = True
    lane_free: dict[str, float] = field(default_factory=lambda: {"compute": 0.0, "copy_out": 0.0, "copy_in": 0.0})
    computes: dict[int, tuple[float, float]] = field(default_factory=dict)  # recent steps' compute spans
    done: dict[int, float] = field(default_factory=dict)  # recent steps: when all their ops ended
    copies: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # recent steps' copy spans
    out_end: dict[int, float] = field(default_factory=dict)  # recent steps' copy-out ends
    copy_seconds: float = 0.0
    hidden_seconds: float = 0.0  # copy time that ran while a model step computed

    def run(self, plan: StepPlan, now: float) -> float:
        """Place the step's ops, the host submitting it no earlier than `now`; returns when its
        tokens reach the host."""
        step = plan.step_id
        collected = self.done.get(step - 2 if self.async_scheduling else step - 1, 0.0)
        submit = max(now if now > self.done.get(step - 1, 0.0) else 0.0, collected)
        out_lane, in_lane = COPY_LANES[self.duplex]
        spans: list[tuple[float, float]] = []
        in_end = out_end = submit
        if plan.swap_in:
            seconds = len(plan.swap_in) * self.cost.per_block_in_s
            ready = max(submit, self.out_end.get(plan.swap_in_after_copy, 0.0), self._compute_end(plan.swap_in_after))
            in_end = self._occupy(in_lane, ready, seconds)
            spans.append((in_end - seconds, in_end))
        if plan.swap_out:
            seconds = len(plan.swap_out) * self.cost.per_block_out_s
            ready = max(submit, self._compute_end(plan.swap_out_after))
            out_end = self.out_end[step] = self._occupy(out_lane, ready, seconds)
            spans.append((out_end - seconds, out_end))
        # Each (copy, compute) pair is counted once: when the later of the two is placed.
        self.copy_seconds += sum(b - a for a, b in spans)
        self._hide(spans, list(self.computes.values()))
        self.copies[step] = spans
        seconds = self.cost.compute(plan)
        end = self._occupy("compute", max(submit, in_end, self.out_end.get(plan.compute_after_copy, 0.0)), seconds)
        start = end - seconds
        self.computes[step] = (start, end)
        self._hide([s for recent in self.copies.values() for s in recent], [(start, end)])
        self.done[step] = max(end, in_end, out_end)
        for old in [s for s in self.computes if s < step - 2]:
            del self.computes[old], self.done[old], self.copies[old]
            self.out_end.pop(old, None)
        return self.done[step]

    def _hide(self, copies: list[tuple[float, float]], computes: list[tuple[float, float]]) -> None:
        for a, b in copies:
            self.hidden_seconds += sum(max(0.0, min(b, ce) - max(a, cs)) for cs, ce in computes)

    @property
    def hidden_ratio(self) -> float | None:
        return self.hidden_seconds / self.copy_seconds if self.copy_seconds else None

    def _compute_end(self, step: int) -> float:
        span = self.computes.get(step)
        return span[1] if span else 0.0

    def _occupy(self, lane: str, ready: float, seconds: float) -> float:
        start = max(ready, self.lane_free[lane])
        self.lane_free[lane] = start + seconds
        return start + seconds
