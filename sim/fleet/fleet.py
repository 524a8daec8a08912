"""The fleet on one virtual clock: replicas behind a router, an autoscaler setting their number.

Time moves in ticks of the router's scrape period. At each tick every live replica runs up to it;
replicas past their drain deadline are killed and drained ones that are empty exit; on an
autoscaler tick the ready pods' /metrics pages go to the autoscaler and its replica count is
reconciled (new replicas load for `ready_delay_s`; removed ones drain); then the router scrapes
the ready pods and routes the requests arriving before the next tick (a replica admits each at
its arrival time). A request with no ready replica to go to fails, as a gateway's 503.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from superinfer.engine.contract import DEFAULT_SLO_CLASS
from superinfer.engine.slo import SLO
from superinfer.engine.slo_classes import class_table
from superinfer.sim.config import SimConfig
from superinfer.sim.fleet.autoscaler import Autoscaler, PodCounts, Verdict
from superinfer.sim.fleet.replica import Job, Phase, Replica
from superinfer.sim.fleet.router import Endpoint, Router
from superinfer.workload.arrivals import WorkItem
from superinfer.workload.goodput import RequestTiming

# A replica's time from creation to ready: scheduling and image start, ~16 GB of Llama-3-8B
# weights from a model cache, CUDA graph capture and KV allocation. An estimate, not a
# measurement (no GPU start-up of `superinfer serve` is recorded yet): override it with
# --ready-delay once measured.
DEFAULT_READY_DELAY_S = 120.0
# The operator's drain: preStop (spec.drain.preStopSeconds, 15) + the engine's shutdown timeout
# (spec.drain.shutdownTimeoutSeconds, 45); in-flight requests still running after it are cut off.
DEFAULT_DRAIN_GRACE_S = 60.0
DEFAULT_SCRAPE_S = 0.05  # the endpoint picker's default --refresh-metrics-interval
NO_ENDPOINT = "no ready replica (503)"
SAMPLE_S = 1.0  # the replica-count timeline's resolution


@dataclass(frozen=True)
class FleetConfig:
    replica: SimConfig = field(default_factory=SimConfig)
    initial_replicas: int = 1
    ready_delay_s: float = DEFAULT_READY_DELAY_S
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S
    scrape_s: float = DEFAULT_SCRAPE_S
    default_slo: SLO = field(default_factory=lambda: SLO(5000.0, 100.0))
    seed: int = 0
    max_end_s: float | None = None  # stop here even with requests in flight (they count unfinished)


@dataclass(frozen=True)
class ScaleEvent:
    time: float
    from_replicas: int
    to_replicas: int
    action: str
    reason: str
    message: str


@dataclass(frozen=True)
class Sample:
    """The fleet at one moment of the timeline."""

    time: float
    desired: int
    ready: int
    starting: int
    draining: int


@dataclass
class FleetResult:
    timings: list[RequestTiming]
    end_s: float
    replica_seconds: float
    events: list[ScaleEvent]
    samples: list[Sample]
    routed: dict[str, int]  # replica -> requests sent there
    replicas_created: int
    killed: int  # requests cut off at a drain deadline
    rejected: int  # requests that found no ready replica
    wall_s: float = 0.0


def job_prompt(seed: int, index: int, length: int, vocab_size: int) -> list[int]:
    """A request's prompt: random ids (no shared prefixes), the same whichever replica takes it."""
    return random.Random(seed * 1_000_003 + index).choices(range(16, vocab_size), k=length)


class Fleet:
    def __init__(self, config: FleetConfig, router: Router, autoscaler: Autoscaler) -> None:
        self.config = config
        self.router = router
        self.autoscaler = autoscaler
        self.cost = config.replica.step_cost()
        self.vocab_size = config.replica.model_spec().vocab_size
        self.classes = class_table(None, config.default_slo)
        self.replicas: list[Replica] = []
        self.desired = config.initial_replicas
        self.events: list[ScaleEvent] = []
        self.samples: list[Sample] = []
        self.rejected: list[RequestTiming] = []
        self.routed: dict[str, int] = {}
        for _ in range(config.initial_replicas):
            self._spawn(0.0, ready_delay_s=0.0)

    # ---- replicas ----------------------------------------------------------------------------
    def _spawn(self, now: float, ready_delay_s: float) -> Replica:
        c = self.config
        name = f"r{len(self.replicas)}"
        replica = Replica(name, c.replica, self.cost, self.classes, c.default_slo, now, ready_delay_s)
        self.replicas.append(replica)
        self.routed[name] = 0
        return replica

    def in_phase(self, now: float, *phases: Phase) -> list[Replica]:
        return [r for r in self.replicas if r.phase(now) in phases]

    def counts(self, now: float) -> PodCounts:
        return PodCounts(self.desired, len(self.in_phase(now, Phase.READY)), len(self.in_phase(now, Phase.STARTING)))

    def reconcile(self, now: float) -> None:
        """Create or drain replicas until the live ones (starting or ready) number `desired`:
        starting ones are removed first, then the most recently ready (a ReplicaSet's order)."""
        live = self.in_phase(now, Phase.STARTING, Phase.READY)
        for _ in range(self.desired - len(live)):
            self._spawn(now, self.config.ready_delay_s)
        excess = len(live) - self.desired
        if excess > 0:
            newest_first = sorted(live, key=lambda r: (r.phase(now) is Phase.READY, -r.life.ready_at))
            for replica in newest_first[:excess]:
                replica.drain(now, self.config.drain_grace_s)
                self.router.forget(replica.name)

    def _lifecycle(self, now: float) -> None:
        for replica in self.in_phase(now, Phase.DRAINING):
            if replica.life.kill_at is not None and now >= replica.life.kill_at:
                replica.kill(now)
            else:
                replica.retire_if_idle(now)

    def _autoscale(self, now: float) -> None:
        ready = self.in_phase(now, Phase.READY)
        pages = {r.name: r.render_metrics(now) for r in ready}
        before = self.desired
        verdict: Verdict = self.autoscaler.tick(now, self.counts(now), pages)
        self.desired = verdict.replicas
        if verdict.replicas != before:
            self.events.append(
                ScaleEvent(now, before, verdict.replicas, verdict.action, verdict.reason, verdict.message)
            )
        self.reconcile(now)

    def _sample(self, now: float) -> None:
        self.samples.append(
            Sample(
                now,
                self.desired,
                len(self.in_phase(now, Phase.READY)),
                len(self.in_phase(now, Phase.STARTING)),
                len(self.in_phase(now, Phase.DRAINING)),
            )
        )

    # ---- requests ----------------------------------------------------------------------------
    def job(self, index: int, item: WorkItem) -> Job:
        slo_class = item.label if item.label in self.classes else DEFAULT_SLO_CLASS
        prompt = job_prompt(self.config.seed, index, item.prompt_len, self.vocab_size)
        return Job(f"w{index}", item.arrival_s, prompt, item.output_len, item.slo, slo_class,
                   self.classes[slo_class].priority)  # fmt: skip

    def route(self, job: Job, endpoints: Sequence[Endpoint], by_name: dict[str, Replica]) -> None:
        if not endpoints:
            self.rejected.append(RequestTiming(job.arrival_s, (), job.slo, NO_ENDPOINT, job.slo_class))
            return
        name = self.router.pick(job.prompt, endpoints)
        by_name[name].send(job)
        self.routed[name] += 1

    # ---- the clock ---------------------------------------------------------------------------
    def run(self, items: Sequence[WorkItem]) -> FleetResult:
        t0 = time.perf_counter()
        c = self.config
        order = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
        tick, now, nxt = c.scrape_s, 0.0, 0
        next_scale = self.autoscaler.interval_s
        next_sample = 0.0
        while True:
            for replica in self.replicas:
                if replica.phase(now) is not Phase.GONE:
                    replica.run_until(now)
            self._lifecycle(now)
            if now >= next_scale - 1e-9:
                self._autoscale(now)
                next_scale += self.autoscaler.interval_s
            if now >= next_sample - 1e-9:
                self._sample(now)
                next_sample += SAMPLE_S
            busy = any(r.outstanding for r in self.replicas if r.phase(now) is not Phase.GONE)
            if nxt >= len(order) and not busy:
                break
            if c.max_end_s is not None and now >= c.max_end_s:
                break
            end = now + tick
            if nxt < len(order) and items[order[nxt]].arrival_s < end:
                ready = self.in_phase(now, Phase.READY)
                by_name = {r.name: r for r in ready}
                endpoints = [Endpoint(r.name, r.view(now), r.outstanding) for r in ready]
                while nxt < len(order) and items[order[nxt]].arrival_s < end:
                    i = order[nxt]
                    job = self.job(i, items[i])
                    self.route(job, endpoints, by_name)
                    if endpoints:  # the proxy's own count moves with each request it sends
                        endpoints = [Endpoint(e.name, e.view, by_name[e.name].outstanding) for e in endpoints]
                    nxt += 1
            now = end
        timings = [t for r in self.replicas for t in r.timings()] + self.rejected
        return FleetResult(
            timings=timings,
            end_s=now,
            replica_seconds=sum(r.seconds_held(now) for r in self.replicas),
            events=self.events,
            samples=self.samples,
            routed=self.routed,
            replicas_created=len(self.replicas),
            killed=sum(len(r.killed) for r in self.replicas),
            rejected=len(self.rejected),
            wall_s=time.perf_counter() - t0,
        )


def run_fleet(config: FleetConfig, router: Router, autoscaler: Autoscaler, items: Sequence[WorkItem]) -> FleetResult:
    return Fleet(config, router, autoscaler).run(items)
