"""Runner settings: the torch thread count."""

from __future__ import annotations

import os

import pytest
import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.engine import EngineCore
from superinfer.engine.worker.runner import torch_threads


def test_torch_threads_default_leaves_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert torch_threads(None) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5}, raising=False)
    assert torch_threads(None) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert torch_threads(None) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert torch_threads(None) == 1
    assert torch_threads(4) == 4


def test_engine_applies_the_thread_setting() -> None:
    before = torch.get_num_threads()
    try:
        EngineCore(EngineConfig(model="tiny", device="cpu", torch_threads=3, num_gpu_blocks=8))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
