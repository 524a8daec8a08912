"""The simulator's cost model against hand calculations (the roofline terms of docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from superinfer.engine.core.plan import ScheduledSeq, StepPlan
from superinfer.engine.core.request import SamplingParams
from superinfer.sim.config import SimConfig
from superinfer.sim.hardware import get_profile
from superinfer.sim.model_spec import PRESETS, from_hf_config, load_model_spec
from superinfer.sim.step_cost import CalibratedCost, RooflineCost, load_calibration, roofline_cost, spread_quantiles
from superinfer.workload.device_timeline import COPY_LANES

LLAMA = load_model_spec("llama-3-8b")
# Nominal rates, no launch cost: the bare roofline.
H100 = dataclasses.replace(get_profile("h100"), hbm_efficiency=1.0, flops_efficiency=1.0, launch_s=0.0)


def plan(*seqs: tuple[int, int]) -> StepPlan:
    """(start_pos, new tokens) per sequence."""
    return StepPlan(1, [ScheduledSeq(f"r{i}", [0] * n, s, [], True, SamplingParams()) for i, (s, n) in enumerate(seqs)])


def test_llama_3_8b_shape():
    assert LLAMA.num_params == 8_030_261_248  # embeddings + 32 layers + untied head
    assert LLAMA.weight_bytes == 2 * 8_030_261_248
    assert LLAMA.kv_bytes_per_token() == 128 * 1024  # 2 x 32 layers x 8 heads x 128 x 2 bytes


def test_decode_is_bound_by_weights_and_kv_bytes():
    cost = roofline_cost(LLAMA, H100, 16, "full")
    # B=1: 16.06 GB of weights plus one token's KV at 3.35 TB/s.
    assert cost.compute(plan((0, 1))) == pytest.approx((16_060_522_496 + 131_072) / 3.35e12)
    # B=64 at 2k context: the KV read (64 x 2048 x 128 KiB = 17.2 GB) doubles it, ~9.9 ms.
    b64 = cost.compute(plan(*[(2047, 1)] * 64))
    assert b64 == pytest.approx((16_060_522_496 + 64 * 2048 * 131_072) / 3.35e12)
    assert 9.8e-3 < b64 < 10.0e-3


def test_prefill_is_bound_by_flops():
    cost = roofline_cost(LLAMA, H100, 16, "full")
    # 1024 new tokens: 2 x 7.5e9 active params x 1024 plus causal attention 4 x 32 x 4096 x 1024 x 512.5.
    flops = 2 * LLAMA.active_params * 1024 + 4 * 32 * 4096 * 1024 * 512.5
    assert cost.compute(plan((0, 1024))) == pytest.approx(flops / 989e12)
    assert 15e-3 < flops / 989e12 < 16.5e-3


def test_efficiency_and_launch_cost_apply():
    hw = dataclasses.replace(H100, hbm_efficiency=0.5, launch_s=0.001)
    assert roofline_cost(LLAMA, hw, 16, "full").compute(plan((0, 1))) == pytest.approx(
        0.001 + (16_060_522_496 + 131_072) / 1.675e12
    )
    assert roofline_cost(LLAMA, hw, 16, "full").compute(StepPlan(1, [])) == 0.0


def test_block_copies_at_link_bandwidth_per_direction():
    gh200, h100 = get_profile("gh200"), get_profile("h100")
    block = 16 * 128 * 1024  # 2 MiB
    full = roofline_cost(LLAMA, gh200, 16, "full")
    assert full.per_block_out_s == full.per_block_in_s == pytest.approx(block / 192e9)  # both ways at once
    assert roofline_cost(LLAMA, h100, 16, "half").per_block_in_s == pytest.approx(block / 50e9)  # one at a time
    assert roofline_cost(LLAMA, h100, 16, "full").per_block_in_s == pytest.approx(block / 41.5e9)


def test_moe_weight_traffic_counts_the_experts_in_use():
    mixtral = load_model_spec("mixtral-8x7b")
    assert 46e9 < mixtral.num_params < 47.5e9 and 12.5e9 < mixtral.active_params < 13.2e9
    assert mixtral.experts_touched(1) == pytest.approx(2.0)  # top-2
    assert mixtral.experts_touched(2) == pytest.approx(8 * (1 - 0.75**2))
    assert mixtral.experts_touched(256) == pytest.approx(8.0)
    one = mixtral.weight_bytes_read(1)
    assert one == pytest.approx((mixtral.shared_params + 32 * 2 * mixtral.expert_params) * 2)
    assert mixtral.weight_bytes_read(256) == pytest.approx(mixtral.weight_bytes, rel=1e-9)
    assert load_model_spec("llama-3-8b").weight_bytes_read(256) == LLAMA.weight_bytes  # dense: all of it


def test_qwen3_moe_reads_its_routed_experts_and_its_dense_layers():
    qwen = load_model_spec("qwen3-30b-a3b")
    # The checkpoint's counts, less the q/k norms (2 x 128 per layer) the cost model leaves out.
    assert qwen.num_params == 30_532_122_624 - 48 * 256
    assert qwen.active_params == 3_041_867_776 - 48 * 256
    assert qwen.expert_params == 3 * 2048 * 768 and qwen.num_moe_layers == 48
    assert qwen.experts_touched(1) == pytest.approx(8.0)
    assert qwen.experts_touched(16) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 16))
    assert qwen.weight_bytes_read(1) == pytest.approx((qwen.shared_params + 48 * 8 * qwen.expert_params) * 2)
    raw = json.loads((PRESETS / "qwen3-30b-a3b.json").read_text())
    two_dense = from_hf_config("q", {**raw, "mlp_only_layers": [0, 5]})
    assert (
        two_dense.num_dense_layers == 2
        and from_hf_config("q", {**raw, "decoder_sparse_step": 2}).num_dense_layers == 24
    )
    # A dense layer reads its whole MLP and no router; an MoE layer its router and the experts hit.
    dense_mlp, moe_one_token = 3 * 2048 * 6144, 2048 * 128 + 8 * qwen.expert_params
    assert two_dense.weight_bytes_read(1) - qwen.weight_bytes_read(1) == pytest.approx(
        2 * (dense_mlp - moe_one_token) * 2
    )


def test_calibration_replaces_the_roofline(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(
        json.dumps(
            {
                "calibration": {
                    "base_s": 0.002,
                    "per_token_s": 1e-5,
                    "per_kcontext_s": 0.001,
                    "copy_out_gb_s": 20,
                    "per_block_in_s": 3e-4,
                }
            }
        )
    )
    cost = load_calibration(path, LLAMA, 16)
    assert isinstance(cost, CalibratedCost)
    assert cost.compute(plan((999, 1), (0, 100))) == pytest.approx(0.002 + 101e-5 + 0.001 * 1.1)
    assert cost.per_block_out_s == pytest.approx(16 * 128 * 1024 / 20e9)
    assert cost.per_block_in_s == 3e-4
    assert SimConfig(calibration=path).step_cost() == cost
    record = Path(__file__).parents[1] / "bench/results/sim-fidelity-rotary-6rps-cpu-2026-11-23.json"
    assert load_calibration(record, LLAMA, 16).per_block_out_s > 0  # bench.sim_fidelity's own record
    path.write_text(json.dumps({"base_s": 0.01}))
    with pytest.raises(ValueError, match="copy-out"):
        load_calibration(path, LLAMA, 16)


def test_a_calibrated_spread_draws_each_step_from_the_measured_ratios(tmp_path):
    assert spread_quantiles([5.0, 1.0, 4.0, 2.0, 3.0], points=3) == [1.0, 3.0, 5.0]  # min, median, max
    assert spread_quantiles([]) == []
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"base_s": 0.01, "copy_out_gb_s": 1, "copy_in_gb_s": 1, "step_time_spread": [0.5, 1.5]}))
    step = plan((0, 1))
    draws = [load_calibration(path, LLAMA, 16).compute(step) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]  # each cost starts from the same seed: a simulation repeats
    cost = load_calibration(path, LLAMA, 16)
    seconds = [cost.compute(step) for _ in range(4000)]
    assert len(set(seconds)) > 3000 and min(seconds) >= 0.005 and max(seconds) <= 0.015
    assert sum(seconds) / len(seconds) == pytest.approx(0.01, rel=0.02)  # uniform between the two quantiles
    flat = dataclasses.replace(cost, spread=(1.0, 1.0, 1.0))
    assert flat.compute(step) == dataclasses.replace(cost, spread=()).compute(step) == pytest.approx(0.01)


def test_fidelity_calibration_keeps_the_spread_around_the_fit():
    from superinfer.bench.sim_fidelity import RecordedStepTimes, calibration
    from superinfer.engine.core.step_time import StepShape
    from superinfer.engine.worker.duplex import CopyStats

    steps = RecordedStepTimes()
    for i in range(200):  # 2 ms + 0.1 ms per token, every fourth step 20% slower, every fourth 20% faster
        shape = StepShape(1 + i % 7, 0)
        steps.observe(shape, (0.002 + 0.0001 * shape.tokens) * (1.0, 1.2, 1.0, 0.8)[i % 4])
    cal = calibration(steps, [CopyStats(blocks_out=10, seconds_out=0.01, blocks_in=0, seconds_in=0.0)])
    assert cal["base_s"] == pytest.approx(0.002, rel=0.05) and cal["per_token_s"] == pytest.approx(1e-4, rel=0.05)
    spread = cal["step_time_spread"]
    assert len(spread) == 101 and spread == sorted(spread)
    assert spread[0] == pytest.approx(0.8, abs=0.02) and spread[-1] == pytest.approx(1.2, abs=0.02)
    assert spread[50] == pytest.approx(1.0, abs=0.02)
    assert cal["per_block_out_s"] == pytest.approx(0.001) and cal["per_block_in_s"] == 0.0


def test_a_step_log_calibrates_the_simulator(tmp_path):
    """A `bench.slo --step-log` file (gzip) as --calibration: its decode steps' times fitted (4 ms +
    0.02 ms a token + 1 ms per thousand context tokens) apart from those with prompt tokens (20 ms +
    0.005 ms a token: op by op on a GPU), the decode steps alternately 10% slower and faster and
    the others 30% (each kind keeps its own spread), planned while the step before ran (async) or
    after an idle gap; and its copies' time per block."""
    import gzip

    steps: dict[str, list[float]] = {k: [] for k in ("t", "done", "tokens", "seqs", "context")}
    steps |= {"blocks_out": [], "blocks_in": [], "copy_seconds": []}
    done = 0.0
    for i in range(600):
        tokens, context = 1 + (i * 37) % 300, (i * 1009) % 5_000
        prompt = i % 3 == 0
        seqs = tokens // 4 + 1 if prompt and tokens > 1 else tokens
        prompt = seqs < tokens
        cost = 0.020 + 5e-6 * tokens if prompt else 0.004 + 2e-5 * tokens + 1e-3 * context / 1000
        planned = done + (0.5 if i % 50 == 0 else -0.001)  # every 50th after an idle half second
        done = max(done, planned) + cost * ((1.3, 0.7) if prompt else (1.1, 0.9))[i // 3 % 2]  # (each kind alternates)
        for key, value in zip(steps, (planned, done, tokens, seqs, context, 2, 3, 5 * 0.0004), strict=True):
            steps[key].append(value)
    path = tmp_path / "steps-rotary-60.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"steps": steps, "requests": {}}).encode()))
    cost = SimConfig(calibration=path).step_cost()
    assert isinstance(cost, CalibratedCost)
    assert cost.base_s == pytest.approx(0.004, rel=0.05) and cost.per_token_s == pytest.approx(2e-5, rel=0.05)
    assert cost.per_kcontext_s == pytest.approx(1e-3, rel=0.05)
    assert cost.prompt is not None and cost.prompt.base_s == pytest.approx(0.020, rel=0.05)
    assert cost.prompt.per_token_s == pytest.approx(5e-6, rel=0.1)
    assert cost.spread[0] == pytest.approx(0.9, abs=0.05) and cost.spread[-1] == pytest.approx(1.1, abs=0.05)
    assert cost.prompt.spread[0] == pytest.approx(0.7, abs=0.05) and cost.prompt.spread[-1] == pytest.approx(1.3, 0.05)
    assert cost.per_block_out_s == cost.per_block_in_s == pytest.approx(0.0004)
    flat = dataclasses.replace(cost, spread=(), prompt=dataclasses.replace(cost.prompt, spread=()))
    assert flat.compute(plan((0, 100))) == pytest.approx(0.020 + 5e-6 * 100, rel=0.05)  # a prompt chunk
    assert flat.compute(plan((0, 1), (999, 1))) == pytest.approx(0.004 + 4e-5 + 1e-3, rel=0.05)  # two decodes


def test_kv_pool_sizing_leaves_out_the_weights():
    config = SimConfig(model="llama-3-8b", hardware="h100", gpu_memory_utilization=0.9)
    blocks = config.num_gpu_blocks_sized()
    assert 25e9 < blocks * 2 * 1024 * 1024 < 72e9 - 16e9
    assert SimConfig(gpu_kv_gib=4).num_gpu_blocks_sized() == 2048
    with pytest.raises(ValueError, match="no KV memory"):
        SimConfig(model="mixtral-8x7b", hardware="h100").num_gpu_blocks_sized()


def test_timeline_lanes_are_the_executors():
    from superinfer.engine.worker.duplex import COPY_LANES as EXECUTOR_LANES

    assert COPY_LANES == EXECUTOR_LANES


def _step_record_cost(tmp_path: Path, **figures: float) -> RooflineCost:
    """The simulator's H100 step cost calibrated by a `bench.step` record of these figures."""
    path = tmp_path / "step-nvidia-h100-2026-11-27.json"
    path.write_text(json.dumps({"bench": "step", "figures": {"hbm_gb_s_measured": 3000.0, **figures}}))
    cost = SimConfig(hardware="h100", calibration=path, duplex="full").step_cost()
    assert isinstance(cost, RooflineCost)
    return cost


def test_a_bench_step_record_sets_the_roofline_rates(tmp_path):
    shares = {"decode_b1_share_of_roofline": 0.6, "decode_b64_share_of_roofline": 0.85}
    cost = _step_record_cost(tmp_path, **shares, prefill_share_of_bf16_peak=0.5)
    assert cost.hw.hbm_bw == 3000e9 and cost.hw.hbm_efficiency == 0.85 and cost.hw.flops_efficiency == 0.5
    assert cost.compute(plan((0, 1))) == pytest.approx(cost.hw.launch_s + (16_060_522_496 + 131_072) / 2550e9)
    assert cost.hw.eager_step_s == 0.0  # the record has no op-by-op figure: not modelled


def test_a_bench_step_record_floors_the_steps_outside_the_graphs(tmp_path):
    """A step with a prompt chunk runs op by op on a GPU, host-bound: at least the record's
    op-by-op batch-1 decode time; steps of one new token a sequence replay the graphs."""
    cost = _step_record_cost(
        tmp_path, decode_b64_share_of_roofline=0.8, decode_b1_ms_eager=20.0, prefill_share_of_bf16_peak=0.5
    )
    assert cost.compute(plan(*[(2047, 1)] * 8)) < 0.01
    assert cost.compute(plan(*[(2047, 1)] * 8, (0, 64))) == pytest.approx(0.02)  # the floor
    flops = 2 * 7_504_924_672 * 8192 + 4 * 32 * 32 * 128 * 8192 * 8193 / 2  # weights, causal attention
    assert cost.compute(plan((0, 8192))) == pytest.approx(cost.hw.launch_s + flops / (989e12 * 0.5))  # past it


def test_host_time_between_steps_is_the_median_gap_so_idle_waits_do_not_count():
    from superinfer.bench.sim_fidelity import RecordedStepTimes
    from superinfer.engine.core.step_time import StepShape

    steps = RecordedStepTimes()
    # Steps of 2 s ending at 10, 13, 16.5 and, after an idle wait for arrivals, 100: gaps 1, 1.5, 82.
    for end in (10.0, 13.0, 16.5, 100.0):
        steps.seen.append((StepShape(1, 10), 2.0))
        steps.ends.append(end)
    assert steps.host_seconds() == pytest.approx(1.5)
    assert RecordedStepTimes().host_seconds() == 0.0


def test_a_step_log_charges_each_step_its_own_launches():
    """With async scheduling the host submits a step before it collects the one before: an
    op-by-op step's launches (25 ms of host time here, 30 ms on the device) fall in the interval
    that ends with the earlier step's collection. Fitted from such a log, a step with a prompt
    chunk costs at least its own 30 ms and a decode step at most its 8 ms (less where it ran under
    the next step's launches), not the other way round (18 and 16 ms without the correction)."""
    from superinfer.sim.step_cost import calibration_from_step_log

    steps: dict[str, list[float]] = {k: [] for k in ("t", "done", "submit_s", "tokens", "seqs", "context")}
    steps |= {"blocks_out": [], "blocks_in": [], "copy_seconds": []}
    host = device_end = previous_end = 0.0
    for i in range(300):
        prompt = i % 3 == 0 or i % 7 == 0
        tokens, seqs = (200, 41) if prompt else (40, 40)
        submit, cost = (0.025, 0.030) if prompt else (0.001, 0.008)
        planned = host
        host += 0.0005 + submit  # plan, then launch
        device_end = max(max(device_end, planned + 0.0005) + cost, host)
        for key, value in zip(steps, (planned, 0.0, submit, tokens, seqs, 10_000, 0, 0, 0.0), strict=True):
            steps[key].append(value)
        if i:  # then collect the step before
            host = steps["done"][i - 1] = max(previous_end, host)
        previous_end = device_end
    steps["done"][-1] = max(previous_end, host)
    cal = calibration_from_step_log({"steps": steps})
    decode = cal["base_s"] + cal["per_token_s"] * 40 + cal["per_kcontext_s"] * 10
    p = cal["prompt_step"]
    with_prompt = p["base_s"] + p["per_token_s"] * 200 + p["per_kcontext_s"] * 10
    assert decode <= 0.0085 and with_prompt >= 0.030
