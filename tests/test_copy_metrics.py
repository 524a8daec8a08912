"""Transfer instrumentation: rotation latency, copy bandwidth, hidden ratio and queueing delay in
/metrics (per step's CopyStats) and in the bench summary (bench/transfers.py)."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from superinfer.bench.transfers import summarize_copies
from superinfer.engine import contract as c
from superinfer.engine.metrics import EngineMetrics
from superinfer.engine.slo import SLO
from superinfer.engine.worker.duplex import CopyStats
from tests.test_engine import engine, run
from tests.test_rotary import PROMPTS, SAMPLING

MIB = 1 << 20
SWAP = {"out": "gpu_to_cpu", "in": "cpu_to_gpu"}


def sample(metrics: EngineMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(c.metric(name), {"model_name": "m", **labels})


def test_one_step_of_copies_is_observed_per_direction_that_moved():
    m = EngineMetrics("m", SLO(), {})
    # 4 MiB out in 2 ms, 1.5 ms of it under compute; nothing in.
    m.on_copies(
        CopyStats(blocks_out=4, seconds_out=0.002, latency_out=0.003, queue_out=0.001, hidden_seconds=0.0015), MIB
    )
    assert sample(m, "rotation_seconds_count", direction="out") == 1
    assert sample(m, "rotation_seconds_sum", direction="out") == pytest.approx(0.003)
    assert sample(m, "kv_copy_queue_seconds_sum", direction="out") == pytest.approx(0.001)
    assert sample(m, "kv_copy_bandwidth_bytes_per_second_sum", direction="out") == pytest.approx(4 * MIB / 0.002)
    assert sample(m, "kv_copy_bandwidth_bytes_per_second_bucket", direction="out", le="2e+09") == 0
    assert sample(m, "kv_copy_bandwidth_bytes_per_second_bucket", direction="out", le="5e+09") == 1
    assert sample(m, "kv_copy_hidden_ratio_sum") == pytest.approx(0.75)
    assert sample(m, "kv_copy_hidden_ratio_bucket", le="0.7") == 0
    assert sample(m, "kv_copy_hidden_ratio_bucket", le="0.8") == 1
    assert sample(m, "kv_swap_bytes_total", direction="gpu_to_cpu") == 4 * MIB
    for name in ("rotation_seconds_count", "kv_copy_queue_seconds_count", "kv_copy_bandwidth_bytes_per_second_count"):
        assert sample(m, name, direction="in") is None  # no block moved in: no observation

    # A copy-in too short for the clock: its latency counts, but no bandwidth and no hidden ratio.
    m.on_copies(CopyStats(blocks_in=2, latency_in=0.0005), MIB)
    assert sample(m, "rotation_seconds_count", direction="in") == 1
    assert sample(m, "kv_copy_bandwidth_bytes_per_second_count", direction="in") is None
    assert sample(m, "kv_copy_hidden_ratio_count") == 1

    m.on_copies(CopyStats(), MIB)  # a step without copies observes nothing
    assert sample(m, "rotation_seconds_count", direction="out") == 1
    assert sample(m, "kv_copy_hidden_ratio_count") == 1


def test_rotation_heavy_run_exports_the_transfer_families(monkeypatch):
    core = engine(
        "tiny",
        max_model_len=256,
        policy="rotary",
        num_gpu_blocks=20,
        num_cpu_blocks=400,
        transfer_budget_blocks=16,
        rotary_min_residency_ms=0,
        slo_admission=False,
    )
    steps: list[CopyStats] = []
    on_copies = core.metrics.on_copies

    def record(copies: CopyStats, block_bytes: int) -> None:
        steps.append(copies)
        on_copies(copies, block_bytes)

    monkeypatch.setattr(core.metrics, "on_copies", record)
    run(core, PROMPTS, SAMPLING)
    assert core.scheduler.counters.rotations > 0  # (how many depends on step times: ~120 here, 5 under load)

    # What a scrape of /metrics reads.
    values = {
        (s.name, s.labels.get("direction", ""), s.labels.get("le", "")): s.value
        for family in text_string_to_metric_families(core.metrics.render().decode())
        for s in family.samples
    }

    def value(name: str, direction: str = "", le: str = "") -> float:
        return values[(c.metric(name), direction, le)]

    for d in ("out", "in"):
        n = value("rotation_seconds_count", d)
        assert n > 0
        assert value("kv_swap_seconds_count", SWAP[d]) == n == value("kv_copy_queue_seconds_count", d)
        # The latency of a copy contains its own span and its queueing.
        assert value("rotation_seconds_sum", d) >= value("kv_swap_seconds_sum", SWAP[d])
        assert value("rotation_seconds_sum", d) >= value("kv_copy_queue_seconds_sum", d) >= 0
        assert 0 < value("kv_copy_bandwidth_bytes_per_second_count", d) <= n
        assert value("kv_copy_bandwidth_bytes_per_second_sum", d) > 0
        for step in steps:  # each step's latency: its copy's queueing, then its own span
            if getattr(step, f"blocks_{d}"):
                latency = getattr(step, f"latency_{d}")
                assert latency >= getattr(step, f"seconds_{d}") > 0 and latency >= getattr(step, f"queue_{d}")
    steps_with_copies = value("kv_copy_hidden_ratio_count")
    assert steps_with_copies >= max(value("rotation_seconds_count", d) for d in ("out", "in"))
    # On CPU the copies run before the step's compute: nothing is hidden.
    assert value("kv_copy_hidden_ratio_sum") == 0
    assert value("kv_copy_hidden_ratio_bucket", le="0.0") == steps_with_copies

    # The bench summary of the same steps agrees with the exported totals.
    summary = summarize_copies(steps, core.block_bytes)
    for d in ("out", "in"):
        assert summary[f"copy_bytes_{d}"] == value("kv_swap_bytes_total", SWAP[d])
        assert summary[f"copy_steps_{d}"] == value("rotation_seconds_count", d)
        assert 0 < summary[f"rotation_{d}_p50_ms"] <= summary[f"rotation_{d}_p99_ms"]
        assert summary[f"copy_bandwidth_{d}_p50_gb_s"] > 0
    assert summary["copy_hidden_ratio"] == 0


def test_summarize_copies():
    mb = 1_000_000
    stats = [
        CopyStats(blocks_out=2, seconds_out=0.001, latency_out=0.004, queue_out=0.002, hidden_seconds=0.0005),
        CopyStats(
            blocks_out=8,
            seconds_out=0.002,
            latency_out=0.002,
            blocks_in=1,
            seconds_in=0.002,
            latency_in=0.003,
            queue_in=0.0005,
            hidden_seconds=0.001,
        ),
        CopyStats(),  # a step without copies
    ]
    s = summarize_copies(stats, mb)
    assert s["rotation_out_p50_ms"] == pytest.approx(3.0)
    assert s["rotation_out_p99_ms"] == pytest.approx(3.98)
    assert s["copy_bandwidth_out_p50_gb_s"] == pytest.approx(3.0)  # 2 and 4 GB/s
    assert s["copy_queue_out_p99_ms"] == pytest.approx(1.98)
    assert s["copy_bytes_out"] == 10 * mb and s["copy_steps_out"] == 2
    assert s["rotation_in_p50_ms"] == s["rotation_in_p99_ms"] == pytest.approx(3.0)
    assert s["copy_bandwidth_in_p50_gb_s"] == pytest.approx(0.5)
    assert s["copy_queue_in_p99_ms"] == pytest.approx(0.5)
    assert s["copy_bytes_in"] == mb and s["copy_steps_in"] == 1
    assert s["copy_hidden_ratio"] == pytest.approx(0.3)  # 1.5 ms of 5 ms

    empty = summarize_copies([CopyStats()], mb)
    assert empty["copy_bytes_out"] == empty["copy_steps_in"] == 0
    assert math.isnan(empty["rotation_out_p99_ms"]) and math.isnan(empty["copy_hidden_ratio"])
