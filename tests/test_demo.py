"""The demo end to end: a real server (its engine in a process of its own, the default) under a
burst, with the preemption and rotation counters read from its /metrics."""

from __future__ import annotations

from superinfer.bench.demo import run_policy
from superinfer.engine.config import EngineConfig
from superinfer.engine.slo import SLO
from superinfer.workload.arrivals import burst_workload


async def test_demo_reports_what_the_engine_process_counted() -> None:
    config = EngineConfig(model="tiny", device="cpu", port=0, num_gpu_blocks=12, block_size=16, policy="fcfs")
    assert config.engine_process
    # Three long requests fit at admission (4 blocks each) and outgrow the 12 blocks as they decode:
    # fcfs must preempt by recompute.
    items = burst_workload(SLO(1000, 100), long_requests=3, long_output=96, long_prompt_len=(48, 60), burst=4)
    report, timings = await run_policy(config, items)
    assert report["requests"] == len(items) == len(timings)
    assert all(t.error is None and t.token_times for t in timings)
    assert report["recomputes"] >= 1 and report["rotations"] == 0
