"""One simulated replica in a fleet: the real scheduler on the fleet's virtual clock, its lifecycle
(starting, ready, draining, gone) and the engine's own /metrics.

The step loop is sim/simulator.py's, made incremental: the fleet hands a replica requests as the
router sends them and asks it to run up to a time; a step planned before that time may end after
it (as a real step in flight when a scrape arrives). The replica keeps a real `EngineMetrics`
(vLLM-compatible names too) fed as the engine feeds it, so what routers and the autoscaler read
is what a pod's /metrics page would say.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.request import Request, SamplingParams
from superinfer.engine.metrics import EngineMetrics
from superinfer.engine.slo import SLO
from superinfer.engine.slo_classes import SLOClass
from superinfer.sim.config import SimConfig
from superinfer.sim.fleet.scrape import PodView, parse_view, render_gauges
from superinfer.sim.simulator import SAMPLED_TOKEN, VirtualClock, build_scheduler, run_step
from superinfer.workload.device_timeline import DeviceTimeline, StepCost
from superinfer.workload.goodput import RequestTiming

MODEL_NAME = "sim"
DRAIN_KILLED = "killed: still running when the drain's shutdown timeout ran out"


class Phase(Enum):
    STARTING = "starting"  # scheduled, loading the model: not routed to, not scraped
    READY = "ready"
    DRAINING = "draining"  # removed from the endpoints: finishes what it has, takes nothing new
    GONE = "gone"


@dataclass(frozen=True)
class Lifecycle:
    """When a replica became what it is (virtual seconds)."""

    created: float
    ready_at: float  # when it passes its readiness probe
    drain_at: float | None = None
    kill_at: float | None = None  # drain deadline: preStop + the engine's shutdown timeout
    gone_at: float | None = None


@dataclass(frozen=True)
class Job:
    """A request as the fleet hands it to a replica."""

    request_id: str
    arrival_s: float
    prompt: list[int]
    output_len: int
    slo: SLO
    slo_class: str
    priority: int


class Replica:
    """A replica's scheduler, device timeline and metrics, advanced on the fleet's clock."""

    def __init__(
        self,
        name: str,
        config: SimConfig,
        cost: StepCost,
        classes: Mapping[str, SLOClass],
        default_slo: SLO,
        created: float,
        ready_delay_s: float,
    ) -> None:
        self.name = name
        self.clock = VirtualClock(created)
        self.sched = build_scheduler(config, self.clock)
        self.timeline = DeviceTimeline(cost, config.duplex, config.async_scheduling)
        self.async_scheduling = config.async_scheduling
        self.host_s = config.host_seconds()
        self.max_num_seqs = config.max_num_seqs
        self.metrics = EngineMetrics(
            MODEL_NAME,
            default_slo,
            info={"policy": config.policy, "num_gpu_blocks": str(self.sched.kv.num_blocks)},
            vllm_compat=True,
            classes={name: cls.slo for name, cls in classes.items()},
        )
        self.life = Lifecycle(created=created, ready_at=created + ready_delay_s)
        self.pending: deque[Job] = deque()  # sent, not yet arrived at the replica's clock
        self.in_flight: list[tuple[StepPlan, float]] = []
        self.jobs: dict[str, Job] = {}  # every request sent here, by id
        self.token_times: dict[str, list[float]] = {}
        self.finished: dict[str, float] = {}  # request id -> when its last token came
        self.killed: set[str] = set()
        self.refused: dict[str, str] = {}  # request id -> why the engine refused it

    # ---- lifecycle ---------------------------------------------------------------------------
    def phase(self, now: float) -> Phase:
        life = self.life
        if life.gone_at is not None and now >= life.gone_at:
            return Phase.GONE
        if life.drain_at is not None and now >= life.drain_at:
            return Phase.DRAINING
        return Phase.READY if now >= life.ready_at else Phase.STARTING

    def drain(self, now: float, grace_s: float) -> None:
        """Taken out of the endpoints at `now`: it serves what it has for at most `grace_s`."""
        if self.life.drain_at is None:
            if now < self.life.ready_at:  # never became ready: it has nothing to finish
                self.life = dataclasses.replace(self.life, drain_at=now, kill_at=now, gone_at=now)
            else:
                self.life = dataclasses.replace(self.life, drain_at=now, kill_at=now + grace_s)

    @property
    def outstanding(self) -> int:
        """Requests sent here that have not finished (nor been killed)."""
        return len(self.jobs) - len(self.finished) - len(self.killed)

    # ---- requests ----------------------------------------------------------------------------
    def send(self, job: Job) -> None:
        """The router chose this replica for `job` (jobs come in arrival order)."""
        self.jobs[job.request_id] = job
        self.token_times[job.request_id] = []
        self.pending.append(job)

    def _admit(self) -> None:
        now = self.clock.now
        while self.pending and self.pending[0].arrival_s <= now:
            job = self.pending.popleft()
            sampling = SamplingParams(max_tokens=job.output_len, temperature=0, ignore_eos=True)
            request = Request(
                job.request_id,
                job.prompt,
                sampling,
                job.arrival_s,
                slo=job.slo,
                priority=job.priority,
                slo_class=job.slo_class,
            )
            try:
                self.sched.add(request)
            except ValueError as exc:  # the engine answers 400 (e.g. more KV than the replica has)
                self.refused[job.request_id] = str(exc)
                self.finished[job.request_id] = now
                continue
            self.jobs[job.request_id] = dataclasses.replace(job, prompt=[])  # the scheduler holds it now

    def _collect(self, plan: StepPlan, done: float) -> None:
        self.clock.now = max(self.clock.now, done)
        now = self.clock.now
        touched = self.sched.update(plan, [SAMPLED_TOKEN] * plan.num_sampled)
        self.metrics.on_tokens(len(touched), self.sched.token_timing)
        for req in touched:
            self.token_times[req.request_id].append(now)
            if req.is_finished:
                self.finished[req.request_id] = now
                self.metrics.on_finish(req, now)

    def run_until(self, t: float) -> None:
        """Plan and complete steps until the next one would be planned at or after `t`."""
        if self.life.gone_at is not None and self.clock.now >= self.life.gone_at:
            return
        clock = self.clock
        while True:
            self._admit()
            idle = not self.sched.has_work and not self.in_flight
            if idle:
                if self.pending and self.pending[0].arrival_s < t:
                    clock.now = max(clock.now, self.pending[0].arrival_s)
                    continue
                clock.now = max(clock.now, t)
                return
            if clock.now >= t:
                return
            run_step(
                self.sched, self.timeline, clock, self.host_s, self.async_scheduling, self.in_flight, self._collect
            )

    def kill(self, now: float) -> None:
        """The drain deadline: whatever is still running is cut off; the replica is gone."""
        for request_id in list(self.sched.requests):
            req = self.sched.abort(request_id)
            if req is not None:
                self.metrics.on_finish(req, now)
        for job in self.pending:
            self.token_times[job.request_id] = []
        self.killed |= {rid for rid in self.jobs if rid not in self.finished}
        self.pending.clear()
        self.in_flight.clear()
        self.life = dataclasses.replace(self.life, gone_at=now)

    def retire_if_idle(self, now: float) -> bool:
        """A draining replica with nothing left exits (the engine stops once drained)."""
        if self.phase(now) is Phase.DRAINING and self.outstanding == 0:
            self.life = dataclasses.replace(self.life, gone_at=max(now, self.clock.now))
            return True
        return False

    # ---- what it exposes ---------------------------------------------------------------------
    def render_metrics(self, now: float) -> str:
        """The pod's /metrics page at `now` (gauges set from the scheduler as the engine sets them)."""
        self.metrics.on_state(self.sched, self.sched.kv, now)
        return self.metrics.render().decode()

    def view(self, now: float) -> PodView:
        """What a router's scrape of the pod returns at `now`."""
        self.metrics.on_state(self.sched, self.sched.kv, now)
        return parse_view(self.name, render_gauges(self.metrics), now)

    def timings(self) -> list[RequestTiming]:
        """Each request sent here, as its client saw it."""
        out = []
        for rid, job in self.jobs.items():
            error = DRAIN_KILLED if rid in self.killed else self.refused.get(rid)
            out.append(RequestTiming(job.arrival_s, tuple(self.token_times[rid]), job.slo, error, job.slo_class))
        return out

    def seconds_held(self, end: float) -> float:
        """Replica-seconds: from creation (a GPU is held while the model loads) until it is gone."""
        gone = self.life.gone_at if self.life.gone_at is not None else end
        return max(0.0, min(gone, end) - self.life.created)
