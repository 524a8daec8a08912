"""retain_freed_heap: a process that allocates and frees step-sized tensors stops faulting in
fresh pages for them (each variant in its own interpreter: the setting is process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from superinfer.engine.worker.heap import retain_freed_heap

SCRIPT = """
import resource, sys, torch
from superinfer.engine.worker.heap import retain_freed_heap
torch.set_num_threads(1)
if sys.argv[1] == "retain":
    assert retain_freed_heap()
x = torch.randn(1024, 3072)
def step():
    p = x.softmax(-1)
    return p.cumsum(-1).sum() + p.masked_fill(p < 1e-4, 0.0).sum()
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return float(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_step_buffers_are_reused_instead_of_mapped_again():
    default, retained = faults_per_step("default"), faults_per_step("retain")
    assert default > 500  # 4 to 28 MB of fresh pages a step, as glibc adjusts its thresholds
    assert retained < default / 4


def test_it_is_safe_to_call_again():
    first = retain_freed_heap()
    assert retain_freed_heap() == first
