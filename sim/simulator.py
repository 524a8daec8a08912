"""Drive the real scheduler, policy and KV manager on a virtual clock; the device is a cost model.

The loop is workload/replay.py's without the model: with async scheduling the host plans and submits
step t+1 (taking `host_s`) before it collects step t; `DeviceTimeline` places each step's copies
and compute under the executor's ordering rules and says when its tokens reach the host. Every
sampled token is token 0: requests run to their fixed output length (`ignore_eos`), as in the
evaluation protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from superinfer.engine.contract import DEFAULT_SLO_CLASS
from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.policies import make_policy
from superinfer.engine.core.request import Request, SamplingParams
from superinfer.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerCounters
from superinfer.engine.slo import SLO
from superinfer.engine.slo_classes import class_table
from superinfer.sim.config import SimConfig
from superinfer.workload.arrivals import WorkItem, prompt_tokens
from superinfer.workload.device_timeline import DeviceTimeline
from superinfer.workload.goodput import RequestTiming

SAMPLED_TOKEN = 0
MAX_IDLE_STEPS = 1000  # empty plans in a row with nothing in flight and nothing to arrive: stuck


class VirtualClock:
    """workload.replay's clock (that module imports the engine, hence torch)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass
class SimResult:
    timings: list[RequestTiming]
    duration_s: float  # virtual seconds from the first arrival slot to the last token
    steps: int
    blocks_out: int  # GPU -> CPU block copies
    blocks_in: int
    block_bytes: int
    counters: SchedulerCounters
    num_gpu_blocks: int
    num_cpu_blocks: int
    copy_seconds: float
    copy_hidden_ratio: float | None
    wall_s: float  # real seconds the simulation took
    guard: dict[str, float]  # Scheduler.guard_figures


def build_scheduler(config: SimConfig, clock: Callable[[], float]) -> Scheduler:
    num_blocks = config.num_gpu_blocks_sized()
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, config.num_cpu_blocks_sized())
    sched_config = SchedulerConfig(
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.max_model_len,
        config.transfer_budget_blocks,
        config.write_through,
    )
    return Scheduler(sched_config, kv, make_policy(config.policy, config.rotary_params(), num_blocks), clock)


def run_step(
    sched: Scheduler,
    timeline: DeviceTimeline,
    clock: VirtualClock,
    host_s: float,
    async_scheduling: bool,
    in_flight: list[tuple[StepPlan, float]],
    collect: Callable[[StepPlan, float], None],
    on_step: Callable[[Scheduler, StepPlan], None] | None = None,
) -> StepPlan:
    """Plan one step, place it on the device timeline, and collect the steps that must be done
    before the next is planned (all of them; with async scheduling all but this one)."""
    plan = sched.schedule()
    if on_step is not None:
        on_step(sched, plan)
    clock.now += host_s  # the host planned it; with async scheduling the device was busy meanwhile
    in_flight.append((plan, timeline.run(plan, clock.now)))
    keep = 1 if async_scheduling and not plan.is_empty else 0
    while len(in_flight) > keep:
        collect(*in_flight.pop(0))
    return plan


def simulate(
    config: SimConfig,
    items: Sequence[WorkItem],
    seed: int = 0,
    on_step: Callable[[Scheduler, StepPlan], None] | None = None,
) -> SimResult:
    """Run every item to completion; `on_step` sees the scheduler after each plan (invariant checks)."""
    t0 = time.perf_counter()
    clock = VirtualClock()
    sched = build_scheduler(config, clock)
    timeline = DeviceTimeline(config.step_cost(), config.duplex, config.async_scheduling)
    host_s = config.host_seconds()
    prompts = prompt_tokens(items, config.model_spec().vocab_size, seed)
    classes = class_table(None, SLO())  # the engine's default classes: the built-in ones and `default`
    order = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
    token_times: dict[str, list[float]] = {f"w{i}": [] for i in range(len(items))}
    in_flight: list[tuple[StepPlan, float]] = []
    steps = blocks_out = blocks_in = idle = 0

    def collect(plan: StepPlan, done: float) -> None:
        clock.now = max(clock.now, done)
        now = clock.now
        for req in sched.update(plan, [SAMPLED_TOKEN] * plan.num_sampled):
            token_times[req.request_id].append(now)

    nxt = 0
    while nxt < len(order) or sched.has_work or in_flight:
        while nxt < len(order) and items[order[nxt]].arrival_s <= clock.now:
            i = order[nxt]
            item = items[i]
            sampling = SamplingParams(max_tokens=item.output_len, temperature=0, ignore_eos=True)
            slo_class = item.label if item.label in classes else DEFAULT_SLO_CLASS  # as workload.replay
            sched.add(
                Request(
                    f"w{i}",
                    prompts[i],
                    sampling,
                    item.arrival_s,
                    slo=item.slo,
                    priority=classes[slo_class].priority,
                    slo_class=slo_class,
                )
            )
            nxt += 1
        if not sched.has_work and not in_flight:
            clock.now = items[order[nxt]].arrival_s
            continue
        plan = run_step(sched, timeline, clock, host_s, config.async_scheduling, in_flight, collect, on_step)
        steps += 1
        blocks_out += len(plan.swap_out)
        blocks_in += len(plan.swap_in)
        if plan.is_empty and not in_flight:
            idle += 1
            if nxt < len(order):
                clock.now = max(clock.now, items[order[nxt]].arrival_s)
            elif idle > MAX_IDLE_STEPS:
                raise RuntimeError(f"the scheduler made no progress with {len(sched.requests)} requests left")
        else:
            idle = 0
    timings = [RequestTiming(items[i].arrival_s, tuple(token_times[f"w{i}"]), items[i].slo) for i in range(len(items))]
    return SimResult(
        timings=timings,
        duration_s=clock.now,
        steps=steps,
        blocks_out=blocks_out,
        blocks_in=blocks_in,
        block_bytes=config.block_bytes(),
        counters=sched.counters,
        num_gpu_blocks=sched.kv.num_blocks,
        num_cpu_blocks=sched.kv.cpu.num_blocks if sched.kv.cpu else 0,
        copy_seconds=timeline.copy_seconds,
        copy_hidden_ratio=timeline.hidden_ratio,
        guard=sched.guard_figures(),
        wall_s=time.perf_counter() - t0,
    )
