"""Every KV read sees exactly the right tokens.

A content model of both tiers: each KV slot holds the token prefix whose KV it is. The real
scheduler plans random workloads (shared prefixes, aborts while a step is in flight, stop-string
finishes, tiny pools and budgets); each plan is applied to the model the way DuplexKV and the
runner would apply it (copies out from the pre-step state, copies in, then the step writes and
reads, placeholders filled with the previous step's samples). On every plan: the safety rules
and the transfer budget hold, and every slot a sequence attends to holds its own prefix. At the
end nothing is stuck and nothing leaked.

With async scheduling, step t+1 is planned while step t is in flight (its tokens unknown to the
scheduler) and the device runs them in order; step t's copy-out may still be running during step
t+1, so an op of step t+1 that writes a block step t copies out must wait for that copy-out.
(tests/test_happens_before.py checks the whole dependency graph of the real executor.)
"""

from __future__ import annotations

import contextlib
import random

import pytest

from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.plan import PLACEHOLDER, StepPlan
from superinfer.engine.core.policies import FCFSPolicy, RotaryParams, RotaryPolicy, WatermarkPolicy
from superinfer.engine.core.request import FinishReason, Request, SamplingParams
from superinfer.engine.core.scheduler import Scheduler
from superinfer.engine.core.scheduler import SchedulerConfig as Config
from tests.test_core import tokens_for

Slots = dict[int, list[tuple[int, ...] | None]]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def check_rules(plan: StepPlan, block_size: int, xfer: int) -> None:
    out_src, in_dst = {g for g, _ in plan.swap_out}, {g for _, g in plan.swap_in}
    written = {q.block_ids[p // block_size] for q in plan.all_seqs() for p in range(q.start_pos, q.context_len)}
    assert not out_src & in_dst, "a GPU block is both copy source and destination"
    assert not out_src & written, "a block is copied out while this step writes it"
    assert not {c for _, c in plan.swap_out} & {c for c, _ in plan.swap_in}, "a CPU block is both dest and source"
    assert len(in_dst) == len(plan.swap_in), "two copies into one block"
    assert len(plan.swap_out) + len(plan.swap_in) <= xfer, "the transfer budget is exceeded"


def check_pipelined(plan: StepPlan, in_flight: StepPlan, block_size: int) -> None:
    """A block the step in flight copies out is written by the next step only by an op that
    waits for that copy-out."""
    copied_out = {g for g, _ in in_flight.swap_out}
    copied_in = {g for _, g in plan.swap_in}  # compute waits for the copy-in that writes these first
    written = {q.block_ids[p // block_size] for q in plan.all_seqs() for p in range(q.start_pos, q.context_len)}
    if (written - copied_in) & copied_out:
        assert plan.compute_after_copy >= in_flight.step_id, "compute writes a block under a copy-out, without waiting"
    if copied_in & copied_out:
        assert plan.swap_in_after_copy >= in_flight.step_id, "copy-in writes a block under a copy-out, without waiting"


def apply(
    plan: StepPlan,
    truth: dict[str, list[int]],
    limit: dict[str, int],
    previous: dict[str, int],
    gpu: Slots,
    cpu: Slots,
    block_size: int,
    rng,
) -> dict[str, int]:
    """Run the plan on the content model; returns its sampled tokens (also appended to `truth`).

    `truth` holds each request's prompt and samples, `limit` the most tokens it may reach."""
    before = {b: list(v) for b, v in gpu.items()}
    for g, c in plan.swap_out:
        cpu[c] = list(before[g])
    for c, g in plan.swap_in:
        gpu[g] = list(cpu[c])
    sampled = {}
    for q in plan.all_seqs():
        t = truth[q.request_id]
        fed = list(q.token_ids)
        if fed[-1] == PLACEHOLDER:
            fed[-1] = previous[q.request_id]  # KeyError: the previous step sampled no such token
        assert t[q.start_pos : q.context_len] == fed
        for p in range(q.start_pos, q.context_len):
            gpu[q.block_ids[p // block_size]][p % block_size] = tuple(t[: p + 1])
        for p in range(q.context_len):
            assert gpu[q.block_ids[p // block_size]][p % block_size] == tuple(t[: p + 1]), (
                f"{q.request_id} reads wrong KV at position {p}"
            )
        if q.sample:
            assert len(t) < limit[q.request_id], f"{q.request_id} runs past max_tokens or the context length"
            sampled[q.request_id] = rng.choice([3, 4])
            t.append(sampled[q.request_id])
    return sampled


def run_workload(seed: int, policy: str, pipelined: bool) -> None:
    rng = random.Random(seed)
    bs, num_gpu, num_cpu = rng.choice([2, 4]), rng.randint(6, 24), rng.randint(1, 40)
    xfer, budget = rng.randint(1, 10), rng.randint(2, 30)
    pol = {
        "rotary": RotaryPolicy(RotaryParams(transfer_budget_blocks=xfer)),
        "watermark": WatermarkPolicy(3),
        "fcfs": FCFSPolicy(),
    }[policy]
    clock = Clock()
    kv = KVCacheManager(num_gpu, bs, True, num_cpu)
    max_len = rng.choice([64, rng.randint(8, 24)])
    s = Scheduler(Config(6, budget, max_len, xfer), kv, pol, clock)
    gpu: Slots = {b: [None] * bs for b in range(num_gpu)}
    cpu: Slots = {b: [None] * bs for b in range(num_cpu)}
    truth: dict[str, list[int]] = {}  # every token as the device knows it
    limit: dict[str, int] = {}  # the most tokens each request may reach
    in_flight: tuple[StepPlan, dict[str, int]] | None = None  # submitted, not yet collected

    def collect(plan: StepPlan, sampled: dict[str, int]) -> None:
        for req in s.update(plan, tokens_for(plan, sampled)):
            if not req.is_finished and rng.random() < 0.05:
                s.finish(req.request_id, FinishReason.STOP)  # a stop string matched

    def step(mid_flight_abort: bool) -> None:
        nonlocal in_flight
        plan = s.schedule()
        check_rules(plan, bs, xfer)
        if in_flight is not None:
            check_pipelined(plan, in_flight[0], bs)
        if mid_flight_abort and s.requests:
            s.abort(rng.choice(list(s.requests)))
        sampled = apply(plan, truth, limit, in_flight[1] if in_flight else {}, gpu, cpu, bs, rng)
        previous, in_flight = in_flight, (plan, sampled)
        if previous is not None:
            collect(*previous)
        if not pipelined or plan.is_empty:
            in_flight = None
            collect(plan, sampled)
        clock.now += rng.random() * 0.3

    def drain() -> None:
        nonlocal in_flight
        if in_flight is not None:
            collect(*in_flight)
            in_flight = None

    for n in range(300):
        r = rng.random()
        if r < 0.25 and len(s.requests) < 10:
            shared = rng.choice([[3] * 30, [3, 4] * 15, [rng.randrange(3, 6) for _ in range(30)]])
            sampling = SamplingParams(max_tokens=rng.randint(1, 14), temperature=0, ignore_eos=True)
            prompt = shared[: rng.randint(1, 20)]
            with contextlib.suppress(ValueError):  # could never fit: rejected, as the server does
                s.add(Request(f"r{n}", prompt, sampling, clock.now))
                truth[f"r{n}"] = list(prompt)
                limit[f"r{n}"] = min(len(prompt) + sampling.max_tokens, max_len)
        elif r < 0.3 and s.requests:
            s.abort(rng.choice(list(s.requests)))  # between steps (one may be in flight)
        else:
            step(mid_flight_abort=rng.random() < 0.15)
    for _ in range(3000):
        if not s.has_work:
            break
        step(mid_flight_abort=False)
    drain()
    assert not s.has_work, "requests are stuck"
    assert kv.pool.num_free == num_gpu and kv.cpu.num_free == num_cpu, "blocks leaked"


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async-scheduling"])
@pytest.mark.parametrize("policy", ["fcfs", "rotary", "watermark"])
@pytest.mark.parametrize("seed_block", range(4))
def test_every_read_sees_its_own_tokens(policy, seed_block, pipelined):
    for seed in range(seed_block * 25, seed_block * 25 + 25):
        run_workload(seed, policy, pipelined)
