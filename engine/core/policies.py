"""Scheduling policies: each step, a policy decides which running requests to rotate out to the
CPU tier and in what order non-running requests are admitted. The scheduler executes that.

- `fcfs`: the vLLM v1 baseline. Waiting requests in arrival order; when blocks run out the newest
  running request is preempted by recompute. Never rotates.
- `rotary`: RotaSched (SuperInfer, arXiv 2601.20309). Requests are ranked by Virtual Lag Time
  against their SLOs, Largest-VLT-First; under contention, long-running decodes are rotated to
  CPU memory so requests close to violating an SLO get GPU memory first.
- `watermark`: the reference code's behaviour, as an ablation: oldest-waiting-first admission,
  and the oldest running decodes rotated out whenever free blocks fall under a watermark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from superinfer.engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from superinfer.engine.core.scheduler import Scheduler


@dataclass
class Decision:
    rotate_out: list[Request] = field(default_factory=list)  # running decodes to move to the CPU tier
    admit: list[Request] = field(default_factory=list)  # waiting/rotary requests, in admission order
    strict_order: bool = True  # stop at the first that does not fit (FCFS), or skip it


class Policy(Protocol):
    name: str
    uses_cpu_tier: bool

    def decide(self, sched: Scheduler, now: float) -> Decision: ...

    def victim(self, candidates: Sequence[Request], now: float) -> Request: ...


def by_arrival(requests: Sequence[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival_time)


class FCFSPolicy:
    name = "fcfs"
    uses_cpu_tier = False

    def decide(self, sched: Scheduler, now: float) -> Decision:
        return Decision(admit=[*sched.waiting, *by_arrival(sched.rotary)])

    def victim(self, candidates: Sequence[Request], now: float) -> Request:
        """The running request to preempt when blocks run out: the most recently admitted."""
        return candidates[-1]


@dataclass(frozen=True)
class RotaryParams:
    alpha: float = 3.0  # weight of TBT lag against TTFT lag: larger favours TBT
    beta_f: float = 0.5  # a waiting request starts lagging after beta_f * its TTFT SLO
    beta_b: float = 0.0  # a rotary request starts lagging after beta_b * its TBT SLO
    transfer_budget_blocks: int = 2400  # B_xfer: blocks moved between tiers per step


def virtual_lag_time(req: Request, now: float, p: RotaryParams) -> float:
    """How far a request lags behind its SLO, in seconds (larger = more urgent).

    waiting, no token yet:     max(0, now - t_arr - beta_f * S_F)
    rotary, or waiting after a recompute with tokens out:  alpha * max(0, now - t_last - beta_b * S_B)
    running:                   -(now - t_run): the longer it has run, the sooner it yields
    """
    if req.status is RequestStatus.RUNNING:
        return -(now - (req.t_run if req.t_run is not None else now))
    if req.t_last_token is None:
        return max(0.0, now - req.arrival_time - p.beta_f * req.slo.ttft_ms / 1000.0)
    return p.alpha * max(0.0, now - req.t_last_token - p.beta_b * req.slo.tbt_ms / 1000.0)


class RotaryPolicy:
    name = "rotary"
    uses_cpu_tier = True

    def __init__(self, params: RotaryParams | None = None) -> None:
        self.params = params or RotaryParams()

    def decide(self, sched: Scheduler, now: float) -> Decision:
        kv, p = sched.kv, self.params
        others = [*sched.waiting, *by_arrival(sched.rotary)]
        free = kv.num_free_blocks - sum(kv.growth_blocks(r, sched.next_tokens(r)) for r in sched.running)
        costs: dict[str, tuple[int, int]] = {}

        def cost(r: Request) -> tuple[int, int]:
            if r.request_id not in costs:
                costs[r.request_id] = sched.admission_cost(r)
            return costs[r.request_id]

        total = 0
        for r in others:  # contention check; stops at the first sign of contention
            total += cost(r)[0]
            if total > free:
                break
        else:
            return Decision(admit=by_arrival(others))  # no contention: plain FCFS, rotate nothing

        vlt = {r.request_id: virtual_lag_time(r, now, p) for r in [*sched.running, *others]}
        ranked = sorted([*sched.running, *others], key=lambda r: -vlt[r.request_id])  # stable: arrival order on ties
        left = free + p.transfer_budget_blocks
        xfer_left = p.transfer_budget_blocks  # rule 6 at selection: what cannot move this step is not chosen
        admit = []
        for r in ranked:
            if left <= 0 or xfer_left <= 0:
                break  # Prioritize is done: nothing more fits under free + B_xfer
            if r.status is RequestStatus.RUNNING or vlt[r.request_id] < 0:
                continue
            n, copies = cost(r)
            # A request that could never come back within one step's budget still goes to the
            # scheduler, which prefills it again instead.
            if n <= left and (copies <= xfer_left or copies > p.transfer_budget_blocks):
                admit.append(r)
                left -= n
                xfer_left -= copies
        to_free = p.transfer_budget_blocks - left
        rotate_out = []
        for r in reversed(ranked):
            if to_free <= 0:
                break
            if r.status is RequestStatus.RUNNING and r.in_decode and not sched.ends_after_pending(r):
                rotate_out.append(r)
                to_free -= kv.owned_blocks(r)
        return Decision(rotate_out, admit, strict_order=False)

    def victim(self, candidates: Sequence[Request], now: float) -> Request:
        """Out of blocks mid-step: the candidate with the smallest VLT (the longest running)."""
        return min(candidates, key=lambda r: virtual_lag_time(r, now, self.params))


class WatermarkPolicy:
    name = "watermark"
    uses_cpu_tier = True

    def __init__(self, watermark_blocks: int) -> None:
        self.watermark_blocks = watermark_blocks

    def decide(self, sched: Scheduler, now: float) -> Decision:
        rotate_out = []
        free = sched.kv.num_free_blocks
        for r in sorted(sched.running, key=lambda r: r.t_run or 0.0):
            if free >= self.watermark_blocks:
                break
            if r.in_decode and not sched.ends_after_pending(r):
                rotate_out.append(r)
                free += sched.kv.owned_blocks(r)
        return Decision(rotate_out, by_arrival([*sched.waiting, *sched.rotary]))

    def victim(self, candidates: Sequence[Request], now: float) -> Request:
        return candidates[-1]


def make_policy(name: str, rotary: RotaryParams | None = None, num_gpu_blocks: int = 0) -> Policy:
    rotary = rotary or RotaryParams()
    if name == "fcfs":
        return FCFSPolicy()
    if name == "rotary":
        return RotaryPolicy(rotary)
    if name == "watermark":
        return WatermarkPolicy(min(rotary.transfer_budget_blocks, max(1, num_gpu_blocks // 10)))
    raise ValueError(f"unknown policy {name!r}; choose one of fcfs, rotary, watermark")
