"""RotaSched keeps stall budgets, as a property: under seeded overloads that exhaust GPU KV memory,
on the simulator and on the CPU engine (virtual clock), no started stream's worst gap exceeds its
stall budget plus one step, except in the counted cases: a stream preempted by recompute, or one
the scheduler could not bring back in time and counted (`SchedulerCounters.stall_overruns`, with
a log line); new requests wait instead (docs/rotasched.md, "Stall budgets")."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import Request
from superinfer.engine.engine import EngineCore
from superinfer.engine.slo import SLO
from superinfer.sim.config import SimConfig
from superinfer.sim.simulator import simulate
from superinfer.workload.arrivals import RequestClass, burst_workload, mixed_workload, poisson_workload, prompt_tokens
from superinfer.workload.goodput import RequestTiming, summarize
from superinfer.workload.replay import VirtualClock, replay


def over_budget(timings: list[RequestTiming], step_s: float) -> list[int]:
    """The streams whose worst gap exceeds their stall budget plus one step."""
    return [
        i
        for i, t in enumerate(timings)
        if t.worst_gap is not None and t.worst_gap * 1000.0 > t.slo.stall_budget_ms + step_s * 1000.0
    ]


@pytest.mark.parametrize(("hardware", "seed"), [("gh200", 0), ("h100", 1)])
def test_the_simulator_keeps_every_started_stream_within_its_stall_budget(hardware, seed):
    """Two classes of SLO at twice what the KV memory holds: rotation happens, new requests are
    held for the started streams, and none of those freezes past its budget."""
    items = mixed_workload(
        [
            RequestClass("interactive", 0.7, SLO(500.0, 50.0), prompt_median=100, output_median=60),
            RequestClass("batch", 0.3, SLO(10_000.0, 100.0, stall_ms=800.0), prompt_median=300, output_median=400),
        ],
        rate=40.0,
        duration_s=8.0,
        seed=seed,
        max_prompt=1024,
        max_output=1024,
    )
    requests: dict[str, Request] = {}
    steps: list[float] = []

    def watch(sched, plan) -> None:
        requests.update(sched.requests)
        steps.append(sched.clock())

    result = simulate(SimConfig(hardware=hardware, num_gpu_blocks=1200), items, seed=seed, on_step=watch)
    step_s = max(b - a for a, b in itertools.pairwise(steps))
    assert result.counters.rotations > 50, "the load really exhausts KV memory"
    assert result.counters.stall_held_steps > 10, "new requests were held for the started streams"
    stalled = over_budget(result.timings, step_s)
    recomputed = {i for i in range(len(items)) if requests[f"w{i}"].num_preemptions}
    assert set(stalled) <= recomputed, [result.timings[i].worst_gap for i in stalled]
    assert result.counters.stall_overruns == len(recomputed & set(stalled))


def replay_engine(items, policy: str, num_gpu_blocks: int) -> tuple[list[RequestTiming], float, EngineCore, float]:
    core = EngineCore(
        EngineConfig(
            model="tiny",
            device="cpu",
            policy=policy,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=4000,
            max_model_len=1024,
        ),
        clock=VirtualClock(),
    )
    steps: list[dict] = []
    timings, duration = replay(core, items, prompt_tokens(items, core.model_config.vocab_size), step_log=steps)
    step_s = max(s["done"] - s["t"] for s in steps)
    return timings, duration, core, step_s


@pytest.mark.slow
def test_the_cpu_engine_keeps_every_started_stream_within_its_stall_budget():
    """Sustained Poisson overload on the real engine: every stream that was never preempted by
    recompute, nor counted, stays within its stall budget plus one step, and rotary freezes fewer
    streams past their budget than fcfs does (whose recomputes stall them), at no less TTFT
    attainment or throughput."""
    items = poisson_workload(
        12, 8, SLO(5000, 100), seed=3, prompt_median=40, output_median=60, max_prompt=256, max_output=512
    )
    timings, duration, core, step_s = replay_engine(items, "rotary", 64)
    counters = core.scheduler.counters
    assert counters.rotations > 20 and counters.stall_held_steps > 10
    # Each stream past its budget waited off the GPU (counted, and logged) or was recomputed.
    assert len(over_budget(timings, step_s)) <= counters.stall_overruns + counters.preemptions["recompute"]
    assert counters.stall_overruns <= 0.02 * len(items)
    fcfs_timings, fcfs_duration, _, _ = replay_engine(items, "fcfs", 64)
    rotary, fcfs = summarize(timings, duration), summarize(fcfs_timings, fcfs_duration)
    assert rotary["stalled_budget_share"] <= fcfs["stalled_budget_share"]
    assert rotary["ttft_attainment"] >= fcfs["ttft_attainment"]
    assert rotary["throughput_tok_s"] >= 0.95 * fcfs["throughput_tok_s"]


def test_the_head_of_line_burst_is_served_within_ttft_and_the_long_streams_within_their_stall_budget():
    """The burst behind long decodes: every short request makes its TTFT (the long ones are
    rotated out for it), and the long ones are back before their stall budget runs out."""
    slo = SLO(ttft_ms=1000, tbt_ms=100)
    items = burst_workload(slo, seed=0)
    timings, _, core, step_s = replay_engine(items, "rotary", 48)
    short = [t for t, it in zip(timings, items, strict=True) if it.label == "short"]
    long = [t for t, it in zip(timings, items, strict=True) if it.label == "long"]
    assert core.scheduler.counters.rotations > 10
    assert all(t.ttft_met for t in short)
    assert not over_budget(long, step_s) and core.scheduler.counters.preemptions["recompute"] == 0


def test_the_sim_stalls_bench_judges_each_point_by_issue_47s_lines():
    from superinfer.bench.sim_stalls import Point, verdict

    point = Point("p", SimConfig(), None, 60.0, overloaded=True)  # type: ignore[arg-type]
    fcfs = {"goodput_share": 0.25, "stalled_1s_share": 0.0, "stalled_budget_share": 0.0, "throughput_tok_s": 100.0}
    frozen = fcfs | {"goodput_share": 0.8, "stalled_1s_share": 0.19, "throughput_tok_s": 101.0}
    assert not verdict(point, {"fcfs": fcfs, "rotary": frozen})["met"]
    kept = frozen | {"stalled_1s_share": 0.01, "throughput_tok_s": 96.0}
    assert verdict(point, {"fcfs": fcfs, "rotary": kept}) == pytest.approx(
        {"goodput_ratio": 3.2, "stalled_1s_points_over_fcfs": 1.0, "throughput_ratio": 0.96, "met": True}
    )
    under = dataclasses.replace(point, overloaded=False)
    assert not verdict(under, {"fcfs": fcfs | {"goodput_share": 1.0}, "rotary": kept})["met"]
