"""bench.attn's launch sweep: configurations that change the output are dropped, the rest are timed
in interleaved rounds and each reports its median (the timer here is a stand-in for CUDA events)."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch

from superinfer.bench import attn


def test_sweep_keeps_correct_configs_and_reports_their_median(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = types.SimpleNamespace(TILE=2, WARPS=4)  # the launch constants a kernel module reads at launch

    def launch() -> torch.Tensor:
        wrong = kernel.TILE == 8  # a tile size that computes something else must not be kept
        return torch.full((4,), 1.0 + wrong)

    # The "time" of a launch: fixed per configuration, plus a spike on the first round of TILE 2.
    seen: dict[tuple[int, int], int] = {}

    def fake_time(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
        fn()
        config = (kernel.TILE, kernel.WARPS)
        seen[config] = seen.get(config, 0) + 1
        spike = 1000.0 if config == (2, 4) and seen[config] == 1 else 0.0
        return 10.0 * config[0] + config[1] + spike

    monkeypatch.setattr(attn, "cuda_time_us", fake_time)
    figures = attn.time_configs("toy", kernel, {"TILE": (2, 4, 8), "WARPS": (4, 8)}, lambda: launch, str, rounds=5)
    assert figures == {
        "sweep_toy_tile2_warps4_us": 24.0,  # the spike is one round of five: the median ignores it
        "sweep_toy_tile2_warps8_us": 28.0,
        "sweep_toy_tile4_warps4_us": 44.0,
        "sweep_toy_tile4_warps8_us": 48.0,
    }
    assert set(seen.values()) == {5} and (kernel.TILE, kernel.WARPS) == (2, 4)  # constants restored
