"""The device timeline that replay's virtual clock follows: each duplex mode's ordering rules."""

from __future__ import annotations

import pytest

from superinfer.engine.core.plan import ScheduledSeq, StepPlan
from superinfer.engine.core.request import SamplingParams
from superinfer.workload.device_timeline import DeviceTimeline, StepCost

COST = StepCost(base_s=0.010, per_token_s=0.0, per_seq_s=0.0, per_block_out_s=0.001, per_block_in_s=0.001)
SEQ = ScheduledSeq("r", [1], 0, [0], True, SamplingParams())


def plan(step: int, swap_in: int = 0, swap_out: int = 0, **after: int) -> StepPlan:
    return StepPlan(
        step,
        [SEQ],
        swap_out=[(i, i) for i in range(swap_out)],
        swap_in=[(i, i) for i in range(swap_in)],
        **after,
    )


def test_serial_copies_run_before_the_step_and_hide_nothing():
    t = DeviceTimeline(COST, "serial", async_scheduling=True)
    assert t.run(plan(1), 0.0) == pytest.approx(0.010)
    assert t.run(plan(2, swap_in=4, swap_out=3), 0.010) == pytest.approx(0.010 + 0.007 + 0.010)
    assert t.hidden_ratio == 0.0


def test_full_duplex_copy_in_overlaps_the_running_step_unless_it_waits_for_it():
    free = DeviceTimeline(COST, "full", async_scheduling=True)
    free.run(plan(1), 0.0)
    # Step 2 is submitted while step 1 computes (async): its 4 ms copy-in runs under it.
    assert free.run(plan(2, swap_in=4), 0.010) == pytest.approx(0.020)
    assert free.hidden_ratio == pytest.approx(1.0)
    fenced = DeviceTimeline(COST, "full", async_scheduling=True)
    fenced.run(plan(1), 0.0)
    # A destination block is still used by step 1: the copy-in waits for it, then the step for the copy.
    assert fenced.run(plan(2, swap_in=4, swap_in_after=1), 0.010) == pytest.approx(0.024)
    assert fenced.hidden_ratio == 0.0


def test_full_duplex_copy_out_overlaps_the_next_step_and_half_duplex_queues_directions():
    full = DeviceTimeline(COST, "full", async_scheduling=True)
    full.run(plan(1), 0.0)
    # Copy-out waits for step 1 (which wrote the blocks), then runs beside step 2's compute.
    assert full.run(plan(2, swap_in=3, swap_out=5, swap_out_after=1), 0.010) == pytest.approx(0.020)
    half = DeviceTimeline(COST, "half", async_scheduling=True)
    half.run(plan(1), 0.0)
    half.run(plan(2, swap_out=8, swap_out_after=1), 0.010)  # busy on the one copy lane until 18 ms
    # Step 3's copy-in queues behind step 2's copy-out on the shared lane, then step 3 behind it.
    assert half.run(plan(3, swap_in=5), 0.020) == pytest.approx(0.023 + 0.010)


def test_without_async_scheduling_nothing_is_submitted_before_the_previous_step_is_collected():
    t = DeviceTimeline(COST, "full", async_scheduling=False)
    t.run(plan(1), 0.0)
    assert t.run(plan(2, swap_in=4), 0.010) == pytest.approx(0.024)
