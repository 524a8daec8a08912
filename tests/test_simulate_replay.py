"""Fidelity of the simulator's loop: on the same workload, costs and scheduler limits, it makes
the same decisions at the same virtual times as workload.replay driving the real engine (tiny model)."""

from __future__ import annotations

import json

import pytest

from superinfer.engine.config import EngineConfig
from superinfer.engine.engine import EngineCore
from superinfer.engine.model.tiny import ensure_tiny_model
from superinfer.engine.slo import SLO
from superinfer.sim.config import SimConfig
from superinfer.sim.simulator import simulate
from superinfer.workload.arrivals import poisson_workload, prompt_tokens
from superinfer.workload.device_timeline import DeviceTimeline, StepCost
from superinfer.workload.replay import VirtualClock, replay


@pytest.mark.parametrize("policy", ["fcfs", "rotary"])
def test_simulator_matches_replay_of_the_real_engine(policy, tmp_path):
    cost = StepCost()  # replay's default costs, as a calibration file
    calibration = tmp_path / "cal.json"
    calibration.write_text(
        json.dumps(
            {k: getattr(cost, k) for k in ("base_s", "per_token_s", "per_seq_s", "per_block_out_s", "per_block_in_s")}
        )
    )
    slo = SLO(1000.0, 100.0)
    items = poisson_workload(10, 3, slo, seed=1, prompt_median=40, output_median=40, max_prompt=128, max_output=96)
    limits = {"num_gpu_blocks": 24, "num_cpu_blocks": 400, "max_model_len": 256}
    core = EngineCore(
        EngineConfig(model="tiny", device="cpu", async_scheduling=True, policy=policy, **limits),
        clock=VirtualClock(),
    )
    prompts = prompt_tokens(items, core.model_config.vocab_size, seed=0)
    timeline = DeviceTimeline(cost, duplex="full", async_scheduling=True)
    real, _ = replay(core, items, prompts, timeline)

    model = str(ensure_tiny_model() / "config.json")
    config = SimConfig(model=model, policy=policy, calibration=calibration, host_s=0.0, **limits)
    sim = simulate(config, items, seed=0)

    assert [len(t.token_times) for t in sim.timings] == [len(t.token_times) for t in real]
    flat = [x for t in sim.timings for x in t.token_times]
    assert flat == pytest.approx([x for t in real for x in t.token_times], abs=1e-9)
    assert sim.counters.rotations == core.scheduler.counters.rotations
    assert sum(sim.counters.preemption_reasons.values()) > 0  # the KV pool ran out: the hard path was compared
    assert sim.counters.preemption_reasons == core.scheduler.counters.preemption_reasons
