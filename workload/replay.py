"""Replay a workload through the real engine on a virtual clock.

The model runs for real (every token is computed), but time advances by a model of the device's
timeline (`device_timeline.py`: op costs, placed under the executor's ordering rules) instead of the
wall clock, so SLO results are reproducible on any machine: the scheduler's
decisions (and VLT) see exactly the same times on every run. Used by the tests and the `slo`
benchmark; HTTP runs against any OpenAI endpoint go through `workload/loadgen.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from superinfer.engine.contract import DEFAULT_SLO_CLASS
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.core.scheduler import PREEMPTION_KINDS
from superinfer.engine.engine import EngineCore
from superinfer.engine.worker.duplex import CopyStats
from superinfer.engine.worker.runner import SubmittedStep
from superinfer.workload.arrivals import WorkItem
from superinfer.workload.device_timeline import DeviceTimeline
from superinfer.workload.gc_pauses import GCPauses
from superinfer.workload.goodput import RequestTiming

StepLogLine = dict[str, float | str]  # one step of a step log (`step_entry`, completed at collection)


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
    step_log: list[StepLogLine] | None = None,
) -> tuple[list[RequestTiming], float]:
    """Run every item to completion; returns per-request timings and the run's duration.

    With a VirtualClock engine, time advances as `timeline` places each step's ops (default: the
    default costs, under the engine's duplex mode and scheduling); with a real clock, arrivals
    wait for their wall-clock time (an open-loop load driven in-process, no HTTP). Each step's
    measured copies are appended to `copy_stats` if given, and a line per step (`step_entry`, then
    when it was done and how its copies went) to `step_log`.
    """
    clock = core.clock
    virtual = isinstance(clock, VirtualClock)
    if timeline is None:
        timeline = DeviceTimeline(duplex=core.config.duplex, async_scheduling=core.async_scheduling)
    order = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
    token_times: dict[str, list[float]] = {}
    # submitted steps, when their tokens are out, and their step-log line
    in_flight: list[tuple[SubmittedStep, float, StepLogLine | None]] = []

    def collect(step: SubmittedStep, done: float, entry: StepLogLine | None, phases: dict[str, float]) -> None:
        t0 = time.perf_counter()
        result = core.runner.collect(step)
        phases = {**phases, "wait": time.perf_counter() - t0}  # (host seconds, also on a virtual clock)
        if copy_stats is not None:
            copy_stats.append(result.copies)
        if virtual:
            clock.now = max(clock.now, done)
        for out in core.complete(step.plan, result, phases):
            token_times[out.request_id].append(clock())
        if entry is not None:
            copies = result.copies
            entry.update(done=clock() - start, copy_latency_out=copies.latency_out, copy_latency_in=copies.latency_in)
            entry.update(copy_hidden=copies.hidden_seconds, copy_seconds=copies.copy_seconds)
            entry.update(forward=step.forward, compute_s=copies.compute_seconds, compute_queue_s=copies.compute_queue)

    nxt = 0
    start = clock()
    with GCPauses() as gc_pauses:  # (the step log counts the host's collections)
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
            entry = None
            if step_log is not None:
                step_log.append(entry := step_entry(core, plan, clock() - start))
            in_flight.append((core.runner.submit(plan), timeline.run(plan, clock.now) if virtual else 0.0, entry))
            phases = {"schedule": t1 - t0, "submit": time.perf_counter() - t1}
            if entry is not None:
                entry.update(schedule_s=phases["schedule"], submit_s=phases["submit"])
                entry.update(gc_s=gc_pauses.seconds, gc_full=gc_pauses.full)  # (cumulative, as the counters)
            keep = 1 if core.async_scheduling and not plan.is_empty else 0
            while len(in_flight) > keep:
                collect(*in_flight.pop(0), phases)
                phases = {}
    timings = [
        RequestTiming(start + items[i].arrival_s, tuple(token_times[f"w{i}"]), items[i].slo) for i in range(len(items))
    ]
    return timings, clock() - start


def step_entry(core: EngineCore, plan: StepPlan, t: float) -> StepLogLine:
    """A step-log line at planning time `t` (seconds into the run): the step's shape and copies,
    the queues it left, the scheduler's counters so far (preemptions by mode and reason too) and
    the TBT guard's view (NaN without one)."""
    sched, counters = core.scheduler, core.scheduler.counters
    guard = sched.last_guard
    return {
        "t": t,
        "tokens": plan.num_tokens,
        "seqs": plan.num_seqs,
        "context": plan.num_context_tokens,
        "blocks_out": len(plan.swap_out),
        "blocks_in": len(plan.swap_in),
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "rotary": len(sched.rotary),
        "free_blocks": sched.kv.num_free_blocks,
        "rotations": counters.rotations,
        "recomputes": counters.preemptions["recompute"],
        **{f"{mode}_{why}": counters.preemption_reasons.get((mode, why), 0) for mode, why in PREEMPTION_KINDS},
        "guard_held_steps": counters.guard_held_steps,
        "guard_overdue_steps": counters.guard_overdue_steps,
        "guard_new_requests": guard.new_requests if guard else math.nan,
        "guard_token_budget": guard.token_budget if guard else math.nan,
        "guard_residency_s": guard.residency_s if guard else math.nan,
        "guard_live": guard.live if guard else math.nan,
        "guard_fit": guard.fit if guard else math.nan,
        "guard_turn_left_s": guard.turn_left_s if guard else math.nan,
        "predicted_s": sched.step_time.time_for(plan.num_tokens, plan.num_context_tokens)
        if sched.step_time.ready
        else math.nan,
    }
