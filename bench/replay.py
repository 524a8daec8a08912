"""Replay a workload through the real engine on a virtual clock.

The model runs for real (every token is computed), but time advances by a step cost model
instead of the wall clock, so SLO results are reproducible on any machine: the scheduler's
decisions (and VLT) see exactly the same times on every run. Used by the tests and the `slo`
benchmark; HTTP runs against any OpenAI endpoint go through `engine.loadgen`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from superinfer.bench.goodput import RequestTiming
from superinfer.bench.workload import WorkItem
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class StepCost:
    """Virtual seconds one engine step takes: fixed cost, per token computed, per sequence, per
    block copied between tiers (copies overlap the step, so only the excess over compute counts)."""

    base_s: float = 0.010
    per_token_s: float = 0.0001
    per_seq_s: float = 0.0002
    per_block_copied_s: float = 0.0001

    def __call__(self, plan: StepPlan) -> float:
        compute = self.base_s + self.per_token_s * plan.num_tokens + self.per_seq_s * len(plan.seqs)
        copies = self.per_block_copied_s * max(len(plan.swap_out), len(plan.swap_in))
        return max(compute, copies)


def replay(
    core: EngineCore, items: Sequence[WorkItem], prompts: Sequence[list[int]], cost: StepCost | None = None
) -> tuple[list[RequestTiming], float]:
    """Run every item to completion; returns per-request timings and the run's duration.

    With a VirtualClock engine, time advances by `cost` per step; with a real clock, arrivals
    wait for their wall-clock time (an open-loop load driven in-process, no HTTP).
    """
    clock = core.clock
    virtual = isinstance(clock, VirtualClock)
    cost = cost or StepCost()
    order = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
    token_times: dict[str, list[float]] = {}
    nxt = 0
    start = clock()
    while nxt < len(order) or core.has_work:
        while nxt < len(order) and start + items[order[nxt]].arrival_s <= clock():
            i = order[nxt]
            rid = f"w{i}"
            sampling = SamplingParams(max_tokens=items[i].output_len, temperature=0, ignore_eos=True)
            core.add_request(rid, prompts[i], sampling, items[i].slo, arrival_time=start + items[i].arrival_s)
            token_times[rid] = []
            nxt += 1
        if not core.has_work:
            wait = start + items[order[nxt]].arrival_s - clock()
            if virtual:
                clock.now += wait
            else:
                time.sleep(max(0.0, wait))
            continue
        t0 = time.perf_counter()
        plan = core.scheduler.schedule()
        result = core.runner.execute(plan)
        if virtual:
            clock.now += cost(plan)
        for out in core.complete(plan, result, {"execute": time.perf_counter() - t0}):
            token_times[out.request_id].append(clock())
    timings = [
        RequestTiming(start + items[i].arrival_s, tuple(token_times[f"w{i}"]), items[i].slo) for i in range(len(items))
    ]
    return timings, clock() - start
