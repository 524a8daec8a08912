"""Happens-before: DuplexKV's copies and the model's steps are ordered exactly as they must be.

The real engine (scheduler, KV manager, runner, DuplexKV, tiny model) serves rotation-heavy traces
with async scheduling on `RecordingStreams`, which records every compute, copy-out and copy-in
with the blocks it touches and the ops it waits for, and runs them in a random order the graph
allows. On that graph: every two accesses to one block, one of them a write, are ordered by a
path; copy-in of step t+1 has no path from step t's compute unless it writes a block step t
touches. The tokens equal the serial executor's, and two random orders leave identical KV.
`pytest -k happens_before` selects these tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.block_pool import BlockPool
from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.request import Request, SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.worker.streams import RecordingStreams
from tests.happens_before import copy_ins_after_compute, copy_ins_waiting_without_cause, unordered_conflicts

ROTATING = dict(
    model="tiny",
    device="cpu",
    dtype="float32",
    max_model_len=256,
    policy="rotary",
    num_gpu_blocks=14,
    num_cpu_blocks=400,
    transfer_budget_blocks=12,
    ttft_slo_ms=20,
    tbt_slo_ms=10,
)


class TickClock:
    """A clock that advances a fixed step per reading: runs with the same calls see the same times."""

    def __init__(self, tick: float = 0.003) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: tuple[int, ...]
    max_tokens: int
    abort_step: int | None = None


def serve(trace: list[Arrival], streams: RecordingStreams | None = None, **overrides) -> tuple[dict, EngineCore]:
    core = EngineCore(EngineConfig(**{**ROTATING, **overrides}), clock=TickClock(), streams=streams)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(trace))}
    step = 0
    while step <= max(a.step for a in trace) or core.has_work:
        for i, a in enumerate(trace):
            if a.step == step:
                core.add_request(
                    f"r{i}", list(a.prompt), SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
                )
            if a.abort_step == step:
                core.abort(f"r{i}")
        for out in core.step():
            tokens[out.request_id] += out.token_ids
        step += 1
    if streams is not None:
        streams.drain()
    assert core.kv.pool.num_free == core.kv.num_blocks, "GPU blocks leaked"
    assert core.kv.cpu.num_free == core.kv.cpu.num_blocks, "CPU blocks leaked"
    return tokens, core


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 12),
    prompt=st.lists(st.integers(3, 2000), min_size=8, max_size=60).map(tuple),
    max_tokens=st.integers(4, 40),
    abort_step=st.one_of(st.none(), st.integers(2, 30)),
)
traces = st.lists(arrivals, min_size=3, max_size=8)
SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def finished_tokens(trace: list[Arrival], tokens: dict) -> dict:
    """Tokens of the requests never aborted (an abort lands at a different token in another run)."""
    return {rid: t for rid, t in tokens.items() if trace[int(rid[1:])].abort_step is None}


@SLOW
@given(trace=traces, mode=st.sampled_from(["full", "half", "serial"]), seed=st.integers(0, 2**16))
def test_happens_before_every_conflicting_access_is_ordered(trace: list[Arrival], mode: str, seed: int):
    streams = RecordingStreams(seed)
    tokens, _ = serve(trace, streams, async_scheduling=True, duplex=mode)
    assert unordered_conflicts(streams.ops) == []
    if mode != "serial":
        assert copy_ins_waiting_without_cause(streams.ops) == []
    serial, _ = serve(trace, async_scheduling=False, duplex="serial")
    assert finished_tokens(trace, tokens) == finished_tokens(trace, serial)


@SLOW
@given(trace=traces, seeds=st.tuples(st.integers(0, 2**16), st.integers(0, 2**16)))
def test_happens_before_random_orders_leave_identical_kv(trace: list[Arrival], seeds: tuple[int, int]):
    runs = [serve(trace, RecordingStreams(seed), async_scheduling=True) for seed in seeds]
    (tokens_a, a), (tokens_b, b) = runs
    assert tokens_a == tokens_b
    assert torch.equal(a.runner.kv_cache, b.runner.kv_cache)
    assert torch.equal(a.runner.duplex.cpu, b.runner.duplex.cpu)


BURST = [Arrival(0, tuple(range(10 + i, 50 + i)), 40) for i in range(6)] + [
    Arrival(3 + i, tuple(range(100 + i, 120 + i)), 12) for i in range(6)
]


def test_happens_before_burst_rotates_and_pipelines_copy_in():
    """A hand-made burst: rotations happen, and some copy-ins run beside the step before them."""
    streams = RecordingStreams(7)
    _, core = serve(BURST, streams, async_scheduling=True, num_gpu_blocks=20)
    assert core.scheduler.counters.rotations > 0
    assert unordered_conflicts(streams.ops) == []
    pipelined = [copy_in for copy_in, _, waits in copy_ins_after_compute(streams.ops) if not waits]
    assert pipelined, "no copy-in overlapped the step before it"


@pytest.mark.parametrize("mode", ["full", "half", "serial"])
def test_happens_before_duplex_modes_serve_a_burst_with_the_serial_tokens(mode: str):
    tokens, core = serve(BURST, RecordingStreams(3), async_scheduling=True, duplex=mode, num_gpu_blocks=20)
    assert core.scheduler.counters.rotations > 0
    serial, _ = serve(BURST, async_scheduling=False, duplex="serial", num_gpu_blocks=20)
    assert tokens == serial


def test_happens_before_a_block_released_under_a_step_in_flight_is_not_a_copy_destination():
    """A request finishing while the step that reads its blocks is in flight: its blocks are free
    for compute at once, but a copy-in of the next step gets other blocks, or waits for that step."""
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.release([a, b], computed_in=5)  # step 5, which reads them, has not finished
    assert pool.num_free == 4
    blocks, after_compute, _ = pool.allocate_for_copy(2)
    assert set(blocks).isdisjoint({a, b}) and after_compute == 0
    more, after_compute, _ = pool.allocate_for_copy(1)  # only fenced blocks are left
    assert more[0] in {a, b} and after_compute == 5
    pool.retire(5)
    pool.release(more, computed_in=5)  # step 5 is done: no fence any more
    assert pool.allocate_for_copy(1)[1] == 0


def test_happens_before_a_block_released_under_a_copy_is_reused_from_the_next_plan_naming_the_copy():
    pool = BlockPool(3, reuse_under_copy=True)
    pool.begin_step(7)
    a, b, _ = pool.allocate(3)
    pool.copied([a], step=7)  # step 7's copy-out reads block a
    pool.release([a, b])
    assert pool.num_free == 1 and pool.num_fenced == 1  # a is quarantined while step 7 is planned
    pool.begin_step(8)  # step 7's copies are issued: an op of step 8 can wait for them
    assert pool.num_free == 2 and pool.copy_fence_taken == 0
    assert pool.allocate(1) == [b]  # the unfenced block first
    assert pool.allocate(1) == [a] and pool.copy_fence_taken == 7  # then the fenced one, and the step
    pool.release([a, b])  # released while step 8 is planned, under step 7's copy: free at once
    assert pool.num_free == 2 and pool.num_fenced == 1
    pool.retire(7)
    pool.begin_step(9)
    pool.allocate(2)
    assert pool.copy_fence_taken == 0


def test_happens_before_swap_in_into_a_fenced_block_names_the_step():
    kv = KVCacheManager(2, 4, enable_prefix_caching=False, num_cpu_blocks=8)
    req = Request("r", list(range(7)), SamplingParams(max_tokens=4), arrival_time=0.0)
    assert kv.allocate(req, 7)
    req.num_computed_tokens, req.last_step = 7, 1
    assert kv.swap_out(req, step=2) is not None
    kv.retire(2)
    other = Request("o", list(range(3)), SamplingParams(max_tokens=4), arrival_time=0.0)
    assert kv.allocate(other, 3)
    other.last_step = 3
    kv.free(other)  # step 3 still computes with its block
    moved = kv.swap_in(req, 1, step=4)
    # Two blocks come back into the only two free, one of them fenced; their CPU copies were
    # written by step 2's copy-out, which has finished.
    assert len(moved.copies) == 2 and moved.after_compute == 3 and moved.after_copy == 0
