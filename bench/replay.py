"""Replay a workload through the real engine on a virtual clock.

The model runs for real (every token is computed), but time advances by a model of the device's
timeline (`step_cost.py`: op costs, placed under the executor's ordering rules) instead of the
wall clock, so SLO results are reproducible on any machine: the scheduler's
decisions (and VLT) see exactly the same times on every run. Used by the tests and the `slo`
benchmark; HTTP runs against any OpenAI endpoint go through `bench/loadgen.py`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from superinfer.bench.goodput import RequestTiming
from superinfer.bench.step_cost import DeviceTimeline
from superinfer.bench.workload import WorkItem
from superinfer.engine.contract import DEFAULT_SLO_CLASS
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.worker.duplex import CopyStats
from superinfer.engine.worker.runner import SubmittedStep


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def replay(
    core: EngineCore,
    items: Sequence[WorkItem],
    prompts: Sequence[list[int]],
    timeline: DeviceTimeline | None = None,
    copy_stats: list[CopyStats] | None = None,
) -> tuple[list[RequestTiming], float]:
    """Run every item to completion; returns per-request timings and the run's duration.

    With a VirtualClock engine, time advances as `timeline` places each step's ops (default: the
    default costs, under the engine's duplex mode and scheduling); with a real clock, arrivals
    wait for their wall-clock time (an open-loop load driven in-process, no HTTP). Each step's
    measured copies are appended to `copy_stats` if given.
    """
    clock = core.clock
    virtual = isinstance(clock, VirtualClock)
    if timeline is None:
        timeline = DeviceTimeline(duplex=core.config.duplex, async_scheduling=core.async_scheduling)
    order = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
    token_times: dict[str, list[float]] = {}
    in_flight: list[tuple[SubmittedStep, float]] = []  # submitted steps, and when their tokens are out

    def collect(step: SubmittedStep, done: float, phases: dict[str, float]) -> None:
        t0 = time.perf_counter()
        result = core.runner.collect(step)
        phases = {**phases, "wait": time.perf_counter() - t0}  # (host seconds, also on a virtual clock)
        if copy_stats is not None:
            copy_stats.append(result.copies)
        if virtual:
            clock.now = max(clock.now, done)
        for out in core.complete(step.plan, result, phases):
            token_times[out.request_id].append(clock())

    nxt = 0
    start = clock()
    while nxt < len(order) or core.scheduler.has_work or in_flight:
        while nxt < len(order) and start + items[order[nxt]].arrival_s <= clock():
            i = order[nxt]
            rid = f"w{i}"
            sampling = SamplingParams(max_tokens=items[i].output_len, temperature=0, ignore_eos=True)
            label = items[i].label if items[i].label in core.slo_classes else DEFAULT_SLO_CLASS
            core.add_request(
                rid, prompts[i], sampling, items[i].slo, arrival_time=start + items[i].arrival_s, slo_class=label
            )
            token_times[rid] = []
            nxt += 1
        if not core.scheduler.has_work and not in_flight:
            wait = start + items[order[nxt]].arrival_s - clock()
            if virtual:
                clock.now += wait
            else:
                time.sleep(max(0.0, wait))
            continue
        # As EngineCore.step does: with async scheduling, plan and submit step t+1, then collect t.
        t0 = time.perf_counter()
        plan = core.scheduler.schedule()
        t1 = time.perf_counter()
        in_flight.append((core.runner.submit(plan), timeline.run(plan, clock.now) if virtual else 0.0))
        phases = {"schedule": t1 - t0, "submit": time.perf_counter() - t1}
        keep = 1 if core.async_scheduling and not plan.is_empty else 0
        while len(in_flight) > keep:
            collect(*in_flight.pop(0), phases)
            phases = {}
    timings = [
        RequestTiming(start + items[i].arrival_s, tuple(token_times[f"w{i}"]), items[i].slo) for i in range(len(items))
    ]
    return timings, clock() - start
