"""bench.policy_cost: the paired ratio and its interval, and one engine's run as the bench counts it."""

from __future__ import annotations

import math

import pytest

from superinfer.bench.policy_cost import Contender, paired_ratio


def test_paired_ratio_is_the_geometric_mean_with_a_t_interval():
    mean, lo, hi = paired_ratio([1.1, 1.0 / 1.1])
    assert mean == pytest.approx(1.0)
    # two pairs: t(1 df) = 12.71 times the standard error of the log ratios, log(1.1) here
    half = 12.71 * math.log(1.1)
    assert (lo, hi) == (pytest.approx(math.exp(-half)), pytest.approx(math.exp(half)))
    mean, lo, hi = paired_ratio([0.98] * 5)
    assert mean == pytest.approx(0.98) and lo == pytest.approx(0.98) and hi == pytest.approx(0.98)


@pytest.mark.parametrize("policy", ["fcfs", "rotary"])
def test_a_run_counts_its_steps_host_time_and_copies(policy):
    contender = Contender(policy)
    figures = contender.run([[17 + i] * (40 + i) for i in range(4)], 6, "t")
    assert figures["steps"] >= 6 and figures["tok_s"] > 0 and figures["cpu_s"] > 0
    assert figures["host_ms_per_step"] > 0
    # ample memory, nobody waiting for blocks: rotary writes nothing through
    assert figures["copied_blocks"] == 0 and figures["copy_ms"] == 0
    assert not contender.core.has_work and contender.core.kv.pool.num_used == 0
