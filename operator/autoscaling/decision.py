"""The SLO autoscaler's decision: a pure function of what was observed and what was done before.

Order of the rules (first match wins):
0. replicas changed by another writer (kubectl scale, an HPA, KEDA) in Active mode → hold and say so
   (ScalingReady=False) until no such write has been seen for stabilizationSeconds;
1. bounds changed → clamp to [min, max];
2. initial delay, missing/stale metrics → hold (MetricsAvailable=False);
3. unschedulable pods → hold, InsufficientCapacity;
4. distress (attainment < target, a class's p90 TTFT/TBT over that class's SLO, more than
   STALLED_SHARE_LIMIT of a class's requests stalled past its stall budget, or saturation) →
   proportional scale-up, sized from the ready pods that measured it and capped at
   +maxStepPercent (≤ 2×) of spec.replicas and maxReplicas, after the cooldown. Pods still
   starting count as capacity on the way: with pods pending, scale further only when the ready
   pods' distress asks for more than spec.replicas already holds. When at least half the ready
   pods have nothing queued and nothing rotated out, and streams flow (every class within its TBT
   target and stall limit), the distress belongs to requests placed earlier: a backlog on the
   other pods (placed before these had room) or a window still counting a burst that has passed
   (nothing waits anywhere). New replicas would get only new requests, which start at once: hold;
5. pods pending (no distress) → hold; too few finished requests → hold (SLOMet=Unknown);
6. healthy for stabilizationSeconds → remove replicas, down to the fewest (at most half of them in
   one step) whose survivors, taking the whole load, are predicted to keep every class under
   sensitivity × its SLO (consolidation check), and the capacity profile, when given, lets them
   take the request rate.
With a capacity profile, a scale-up is also at least as large as the profile says the rate needs.

Latency and stalls are judged per SLO class (class_pressure.py), for the classes with minRequests
finished requests in the window; attainment already judges each request against its own class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from superinfer.operator.api.conditions import FALSE, TRUE, UNKNOWN, Cond
from superinfer.operator.api.inference_service import InferenceServiceSpec
from superinfer.operator.autoscaling.class_pressure import (
    ClassLatency,
    Targets,
    class_latencies,
    over_stall_limit,
    over_targets,
    spec_targets,
)
from superinfer.operator.autoscaling.latency_model import LatencyModel, predict_ttft
from superinfer.operator.autoscaling.pod_metrics import WindowStats

Action = Literal["ScaleUp", "ScaleDown", "Hold"]
WAITING_PER_REPLICA = 4.0  # queued requests per replica that count as saturation
KV_SATURATED = 0.95  # both tiers this full (GPU alone is normal under rotation)


@dataclass(frozen=True)
class Params:
    min_replicas: int
    max_replicas: int
    ttft_slo_ms: float
    tbt_slo_ms: float
    target: float
    window_seconds: float
    interval_seconds: float
    initial_delay_seconds: float
    min_requests: int
    max_step_percent: int
    cooldown_seconds: float
    stabilization_seconds: float
    sensitivity: float
    max_num_seqs: int
    advisory: bool = False
    swap_limit_gbps: float | None = None
    classes: Mapping[str, Targets] = field(default_factory=dict)  # the spec's, where the engine exports none
    max_rate_per_replica: float | None = None  # the capacity profile, when the spec gives one

    @classmethod
    def from_spec(cls, spec: InferenceServiceSpec) -> Params:
        a = spec.autoscaling
        return cls(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            ttft_slo_ms=spec.slo.ttft_ms,
            tbt_slo_ms=spec.slo.tbt_ms,
            target=spec.slo.attainment_target,
            window_seconds=spec.slo.window_seconds,
            interval_seconds=a.interval_seconds,
            initial_delay_seconds=a.initial_delay_seconds,
            min_requests=a.min_requests,
            max_step_percent=a.scale_up.max_step_percent,
            cooldown_seconds=a.scale_up.cooldown_seconds,
            stabilization_seconds=a.scale_down.stabilization_seconds,
            sensitivity=a.scale_down.sensitivity,
            max_num_seqs=spec.engine.max_num_seqs,
            advisory=a.mode == "Advisory",
            classes=spec_targets(spec.slo),
            max_rate_per_replica=a.capacity.max_rate_per_replica if a.capacity else None,
        )


@dataclass(frozen=True)
class Observation:
    now: float
    replicas: int  # what the workload is asked to run now
    ready: int
    pending: int  # pods that exist but are not ready yet
    unschedulable: int  # of those, how many cannot be placed
    stats: WindowStats | None  # None when no pod could be scraped
    fresh: bool = True  # every ready pod was scraped recently
    metrics_error: str = ""  # why there are no metrics, when it is known


@dataclass(frozen=True)
class Memory:
    """What the autoscaler remembers between ticks (kept by the caller, persisted in status)."""

    started_at: float
    last_scale_at: float | None = None
    healthy_since: float | None = None
    applied_replicas: int | None = None  # what the autoscaler last wrote (or adopted) as spec.replicas
    external_write_at: float | None = None  # when another writer last changed spec.replicas


@dataclass(frozen=True)
class Decision:
    action: Action
    target: int
    reason: str
    message: str
    metrics: Cond
    scaling: Cond
    slo: Cond
    memory: Memory
    apply: bool  # False in Advisory mode or for holds


def _clamp(n: int, p: Params) -> int:
    return max(p.min_replicas, min(p.max_replicas, n))


def window_classes(s: WindowStats, p: Params) -> list[ClassLatency]:
    """Every class with traffic in the window, with the targets its p90s are held to."""
    return class_latencies(s, p.classes, Targets(p.ttft_slo_ms, p.tbt_slo_ms))


def judged_classes(s: WindowStats, p: Params) -> list[ClassLatency]:
    """The classes whose p90s count: those with minRequests finished requests in the window."""
    return [c for c in window_classes(s, p) if c.requests >= p.min_requests]


def distress_ratio(s: WindowStats, p: Params, replicas: int) -> tuple[float, str]:
    """How far over the SLO the `replicas` serving pods are (>1 means they need about that factor
    more) and why, the worst reason first."""
    reasons: list[tuple[float, str]] = []
    if s.attainment is not None and s.requests >= p.min_requests and s.attainment < p.target:
        reasons.append((p.target / max(s.attainment, 0.05), f"attainment {s.attainment:.2f} < {p.target:.2f}"))
    for c in judged_classes(s, p):
        reasons += over_targets(c)
    per_replica_waiting = s.waiting / max(replicas, 1)
    if per_replica_waiting > WAITING_PER_REPLICA:
        ratio = (s.running + s.waiting) / max(s.running, 1.0)
        reasons.append((max(ratio, 1.01), f"{s.waiting:.0f} requests queued ({per_replica_waiting:.1f}/replica)"))
    if (s.kv_gpu or 0) >= KV_SATURATED and (s.kv_cpu or 0) >= KV_SATURATED and s.waiting > 0:
        reasons.append((1.01, "GPU and CPU KV tiers both full with requests waiting"))
    if p.swap_limit_gbps and s.swap_gbps >= 0.9 * p.swap_limit_gbps:
        reasons.append((1.01, f"KV swap at {s.swap_gbps:.1f} GB/s, near the {p.swap_limit_gbps:g} GB/s link"))
    if not reasons:
        return 0.0, ""
    reasons.sort(key=lambda r: -r[0])  # stable: equal ratios keep their order
    return reasons[0][0], "; ".join(text for _, text in reasons)


def streams_flow(s: WindowStats, p: Params) -> bool:
    """No judged class's p90 gap between tokens is over its TBT target and none stalls past its
    limit: the pods are not too slow or too full, whatever waits is waiting for a place."""
    return all(
        (c.tbt_p90_ms is None or c.tbt_p90_ms <= c.targets.tbt_ms) and not over_stall_limit(c)
        for c in judged_classes(s, p)
    )


def replicas_wanted(serving: int, ratio: float, profile_wants: int = 0) -> int:
    """The replicas that take the distress of `serving` pods off (proportional), or what the
    capacity profile wants, if more."""
    return max(math.ceil(serving * ratio - 1e-9), profile_wants)


def scale_up_target(current: int, ratio: float, p: Params, profile_wants: int = 0, serving: int | None = None) -> int:
    """What `replicas_wanted` says for the `serving` pods that measured the distress (all
    `current` by default): at least +1, at most +maxStepPercent (≤ 2×) of `current` and
    maxReplicas."""
    wanted = replicas_wanted(current if serving is None else serving, ratio, profile_wants)
    cap = current + max(1, math.floor(current * p.max_step_percent / 100))
    return _clamp(max(current + 1, min(wanted, cap)), p)


def request_rate(s: WindowStats) -> float:
    """Finished requests per second over the window, all replicas together."""
    return s.requests / s.span_seconds if s.span_seconds > 0 else 0.0


def profile_replicas(s: WindowStats, p: Params) -> int:
    """Replicas the capacity profile says the window's request rate needs (0 without a profile)."""
    if not p.max_rate_per_replica:
        return 0
    return math.ceil(request_rate(s) / p.max_rate_per_replica - 1e-9)


def profile_check(s: WindowStats, p: Params, n: int, m: int) -> tuple[bool, str]:
    """Whether the capacity profile lets m of today's n replicas take today's rate. Advisory: when
    n replicas already meet the SLO above the profile's rate per replica, the profile
    underestimates and only a note is returned."""
    if not p.max_rate_per_replica:
        return True, ""
    rate, cap = request_rate(s), p.max_rate_per_replica
    if rate / n > cap:
        return True, f"capacity profile ignored: {rate / n:.2f} req/s per replica already meets the SLO (> {cap:g})"
    if rate > m * cap:
        return False, f"capacity profile: {rate:.2f} req/s needs {math.ceil(rate / cap)} replica(s) at {cap:g} each"
    return True, f"capacity profile: {rate:.2f} req/s fits {m} replica(s) at {cap:g} each"


@dataclass(frozen=True)
class Prediction:
    """One class's p90s predicted for fewer replicas, and the limits they must stay under."""

    name: str
    tbt_ms: float
    tbt_limit_ms: float
    ttft_ms: float
    ttft_limit_ms: float

    @property
    def ok(self) -> bool:
        return self.tbt_ms <= self.tbt_limit_ms and self.ttft_ms <= self.ttft_limit_ms

    @property
    def pressure(self) -> float:
        return max(self.tbt_ms / self.tbt_limit_ms, self.ttft_ms / self.ttft_limit_ms)


def predict_classes(s: WindowStats, p: Params, n: int, model: LatencyModel, m: int) -> list[Prediction]:
    """Each judged class's p90s once m of n replicas take n/m of the load each. The replica's TBT
    growth (fitted line, on the mean of all tokens) scales every class's p90 alike; TTFT grows
    with queueing."""
    grow = n / m
    batch_now = s.running / n
    batch_after = batch_now * grow
    tbt_now = (s.tbt_mean_ms or s.tbt_p90_ms or 0.0) / 1000 or None
    tbt_mean_after = model.predict_tbt(batch_now, batch_after, tbt_now) * 1000
    occupancy = batch_now / p.max_num_seqs
    out = []
    for c in judged_classes(s, p):
        tbt_after = tbt_mean_after
        if c.tbt_p90_ms is not None and tbt_now:
            tbt_after = tbt_mean_after * c.tbt_p90_ms / (tbt_now * 1000)  # predict the p90, not the mean
        ttft_after = predict_ttft(c.ttft_p90_ms or 0.0, occupancy, occupancy * grow)
        limits = (p.sensitivity * c.targets.tbt_ms, p.sensitivity * c.targets.ttft_ms)
        out.append(Prediction(c.name, tbt_after, limits[0], ttft_after, limits[1]))
    return out


def consolidation(s: WindowStats, p: Params, n: int, model: LatencyModel, m: int) -> tuple[bool, str]:
    """Would m of n replicas, taking n/m of the load each, keep every class under sensitivity × its SLO?"""
    predictions = predict_classes(s, p, n, model, m)
    queued_after = s.waiting / m
    ok = all(c.ok for c in predictions) and queued_after <= WAITING_PER_REPLICA
    parts = [
        f"class {c.name} p90 TBT {c.tbt_ms:.0f}ms (limit {c.tbt_limit_ms:.0f}), "
        f"p90 TTFT {c.ttft_ms:.0f}ms (limit {c.ttft_limit_ms:.0f})"
        for c in sorted(predictions, key=lambda c: -c.pressure)  # the class closest to its limits first
    ]
    if queued_after > WAITING_PER_REPLICA:
        parts.insert(0, f"{queued_after:.1f} queued per replica (limit {WAITING_PER_REPLICA:g})")
    return ok, f"with {m} replica(s), predicted: " + ("; ".join(parts) or "no class with enough requests")


def fewest_replicas(s: WindowStats, p: Params, n: int, model: LatencyModel) -> tuple[int, bool, bool, str]:
    """The fewest replicas m, from n-1 down to half of n (not below minReplicas), that the
    consolidation check and the capacity profile accept: (m, safe, fits, why). When n-1 is not
    accepted, n-1's verdicts. The caller guarantees n-1 >= minReplicas."""
    best = None
    for m in range(n - 1, max(p.min_replicas, math.ceil(n / 2)) - 1, -1):
        ok, text = consolidation(s, p, n, model, m)
        fits, note = profile_check(s, p, n, m)
        verdict = (m, ok, fits, f"{text}; {note}" if note else text)
        if not (ok and fits):
            return best or verdict
        best = verdict
    assert best is not None
    return best


def _slo_cond(s: WindowStats | None, p: Params) -> Cond:
    if s is None or s.attainment is None or s.requests < p.min_requests:
        n = 0 if s is None else int(s.requests)
        return Cond("SLOMet", UNKNOWN, "TooFewRequests", f"{n} finished requests in the window (< {p.min_requests})")
    if s.attainment >= p.target:
        return Cond("SLOMet", TRUE, "Met", f"attainment {s.attainment:.3f} >= target {p.target}")
    return Cond("SLOMet", FALSE, "Missed", f"attainment {s.attainment:.3f} < target {p.target}")


EXTERNAL_WRITER_HINT = (
    "with autoscaling.mode Active the SLO autoscaler owns spec.replicas: remove the other autoscaler "
    "(HPA, KEDA) or set autoscaling.mode to Advisory"
)


def note_external_writes(n: int, p: Params, mem: Memory, now: float) -> tuple[Memory, str]:
    """Memory with what the autoscaler wrote last and when another writer changed replicas since;
    with a message while that other writer counts as active (Active mode only)."""
    if p.advisory:
        return mem, ""
    if mem.applied_replicas is not None and n != mem.applied_replicas:
        changed = replace(mem, applied_replicas=n, external_write_at=now)
        return changed, f"spec.replicas changed from {mem.applied_replicas} to {n} by another writer"
    mem = replace(mem, applied_replicas=n)
    if mem.external_write_at is not None and now - mem.external_write_at < p.stabilization_seconds:
        return mem, f"spec.replicas was changed by another writer {now - mem.external_write_at:.0f}s ago"
    return mem, ""


def decide(obs: Observation, p: Params, mem: Memory, model: LatencyModel | None = None) -> Decision:
    model = model or LatencyModel()
    n = obs.replicas
    s = obs.stats
    mem, external = note_external_writes(n, p, mem, obs.now)
    metrics_ok = s is not None and obs.fresh
    metrics = (
        Cond("MetricsAvailable", TRUE, "Scraped", f"metrics from {s.pods} pod(s)")
        if metrics_ok and s is not None
        else Cond(
            "MetricsAvailable",
            FALSE,
            "MetricsStale",
            obs.metrics_error or "no fresh engine metrics from the ready pods",
        )
    )
    slo = _slo_cond(s, p)
    mode = "Advisory" if p.advisory else "Active"

    def out(
        action: Action, target: int, reason: str, message: str, memory: Memory = mem, scaling: Cond | None = None
    ) -> Decision:
        scaling = scaling or Cond("ScalingReady", TRUE, mode, f"{mode}: {message}")
        applies = action != "Hold" and not p.advisory
        if applies:
            memory = replace(memory, last_scale_at=obs.now, applied_replicas=target)
        return Decision(action, target, reason, message, metrics, scaling, slo, memory, applies)

    # 0. Another writer.
    if external:
        msg = f"{external}; {EXTERNAL_WRITER_HINT}"
        return out("Hold", n, "ExternalWriter", msg, scaling=Cond("ScalingReady", FALSE, "ExternalWriter", msg))
    # 1. Bounds.
    if n != _clamp(n, p):
        target = _clamp(n, p)
        action: Action = "ScaleUp" if target > n else "ScaleDown"
        return out(action, target, "Bounds", f"{n} replicas is outside [{p.min_replicas}, {p.max_replicas}]")
    # 2. Warm-up and metrics.
    if obs.now - mem.started_at < p.initial_delay_seconds:
        return out("Hold", n, "InitialDelay", f"waiting {p.initial_delay_seconds:g}s before the first decision")
    if not metrics_ok or s is None:
        return out("Hold", n, "MetricsStale", "holding: engine metrics are missing or stale")
    # 3. Capacity the cluster cannot place.
    if obs.unschedulable:
        msg = f"{obs.unschedulable} pod(s) cannot be scheduled; no further scale-up until capacity appears"
        return out(
            "Hold", n, "InsufficientCapacity", msg, scaling=Cond("ScalingReady", FALSE, "InsufficientCapacity", msg)
        )
    # 4. Distress, judged on the pods that serve; pods still starting count as capacity on the way.
    serving = max(obs.ready, 1)
    ratio, why = distress_ratio(s, p, serving)
    if ratio > 1.0:
        unhealthy = replace(mem, healthy_since=None)
        if n >= p.max_replicas:
            return out("Hold", n, "AtMaxReplicas", f"{why}; already at maxReplicas {p.max_replicas}", unhealthy)
        if 2 * s.pods_with_room >= serving and streams_flow(s, p):
            msg = f"{why}; but {s.pods_with_room} of {serving} ready pod(s) have nothing queued or rotated out"
            return out("Hold", n, "BacklogNotCapacity", msg, unhealthy)
        wants = profile_replicas(s, p)
        if obs.pending and replicas_wanted(serving, ratio, wants) <= n:
            msg = f"{why}; {obs.pending} pod(s) still starting cover it ({n} replicas)"
            return out("Hold", n, "PodsPending", msg, unhealthy)
        if mem.last_scale_at is not None and obs.now - mem.last_scale_at < p.cooldown_seconds:
            return out("Hold", n, "Cooldown", f"{why}; in scale-up cooldown", unhealthy)
        target = scale_up_target(n, ratio, p, wants, serving)
        sized = f" (capacity profile: {request_rate(s):.2f} req/s needs {wants})" if wants > n else ""
        pending = f" ({obs.pending} still starting)" if obs.pending else ""
        return out("ScaleUp", target, "SLODistress", f"{why}: {n}{pending} → {target} replicas{sized}", unhealthy)
    # 5. Pods on the way, evidence.
    if obs.pending:
        return out("Hold", n, "PodsPending", f"{obs.pending} pod(s) still starting")
    if s.requests < p.min_requests:
        return out("Hold", n, "TooFewRequests", f"{int(s.requests)} finished requests in the window")
    # 6. Consolidation.
    healthy = mem if mem.healthy_since is not None else replace(mem, healthy_since=obs.now)
    if n <= p.min_replicas:
        return out("Hold", n, "Stable", "SLO met at minReplicas", healthy)
    assert healthy.healthy_since is not None
    waited = obs.now - healthy.healthy_since
    if waited < p.stabilization_seconds:
        return out("Hold", n, "Stabilizing", f"SLO met for {waited:.0f}s of {p.stabilization_seconds:g}s", healthy)
    if mem.last_scale_at is not None and obs.now - mem.last_scale_at < p.stabilization_seconds:
        return out("Hold", n, "Stabilizing", "recently scaled", healthy)
    m, ok, fits, text = fewest_replicas(s, p, n, model)
    if not ok:
        return out("Hold", n, "ConsolidationUnsafe", text, healthy)
    if not fits:
        return out("Hold", n, "OverCapacityProfile", text, healthy)
    return out("ScaleDown", m, "Consolidate", text, replace(healthy, healthy_since=None))
