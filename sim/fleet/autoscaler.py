"""Who sets the replica count: the operator's SLO autoscaler, the HPA recipe on vLLM's queue
metric, or nobody (a fixed fleet).

Each ticks every `interval_s` on what it would read at that moment: the pages of the ready pods
(`pages`, pod name -> /metrics text) and the pod counts. The SLO autoscaler is the operator's own
code: pod_metrics.parse and Window (what tick() does with real scrapes), LatencyModel and decide().
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from superinfer.operator.api.inference_service import InferenceServiceSpec
from superinfer.operator.autoscaling import pod_metrics
from superinfer.operator.autoscaling.decision import Memory, Observation, Params, decide
from superinfer.operator.autoscaling.latency_model import LatencyModel
from superinfer.sim.fleet.scrape import VLLM_WAITING, samples


@dataclass(frozen=True)
class PodCounts:
    desired: int  # spec.replicas as last written
    ready: int
    pending: int  # created, not ready yet (loading the model)


@dataclass(frozen=True)
class Verdict:
    """One tick's outcome: the replica count to write and why."""

    replicas: int
    action: str  # ScaleUp, ScaleDown, Hold
    reason: str
    message: str = ""


class Autoscaler:
    name = "autoscaler"
    interval_s = 15.0

    def tick(self, now: float, counts: PodCounts, pages: Mapping[str, str]) -> Verdict:
        raise NotImplementedError


class Fixed(Autoscaler):
    """A fleet of `replicas`, never changed."""

    def __init__(self, replicas: int, name: str = "fixed") -> None:
        self.replicas = replicas
        self.name = name

    def tick(self, now: float, counts: PodCounts, pages: Mapping[str, str]) -> Verdict:
        return Verdict(self.replicas, "Hold", "Fixed")


def slo_spec(
    min_replicas: int,
    max_replicas: int,
    ttft_ms: float,
    tbt_ms: float,
    max_num_seqs: int = 256,
    overrides: Mapping | None = None,
    window_seconds: int = 120,
) -> InferenceServiceSpec:
    """An InferenceService spec with the SLO autoscaler on; everything else at the CRD's defaults
    (`overrides`: more autoscaling fields, in the CRD's camelCase)."""
    autoscaling = {"enabled": True, "minReplicas": min_replicas, "maxReplicas": max_replicas, **(overrides or {})}
    return InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "preset://llama-3-8b"},
            "engine": {"maxNumSeqs": max_num_seqs},
            "slo": {"ttftMs": ttft_ms, "tbtMs": tbt_ms, "windowSeconds": window_seconds},
            "autoscaling": autoscaling,
        }
    )


class SLOAutoscaler(Autoscaler):
    """The operator's autoscaler: scrape the ready pods into a pod_metrics.Window, decide()."""

    name = "slo"

    def __init__(self, spec: InferenceServiceSpec, started_at: float = 0.0, scrape_timeout_s: float = 5.0) -> None:
        self.params = Params.from_spec(spec)
        self.interval_s = float(self.params.interval_seconds)
        self.window = pod_metrics.Window(self.params.window_seconds)
        self.memory = Memory(started_at=started_at)
        self.model = LatencyModel()
        self.scrape_timeout_s = scrape_timeout_s

    def tick(self, now: float, counts: PodCounts, pages: Mapping[str, str]) -> Verdict:
        for pod, text in pages.items():
            self.window.add(pod, pod_metrics.parse(text, now))
        self.window.forget_missing(pages)
        fresh = self.interval_s * 2 + self.scrape_timeout_s  # as tick() judges freshness
        stats = self.window.stats(now, fresh_seconds=fresh)
        if stats is not None and stats.running > 0 and stats.tbt_mean_ms:
            self.model.observe(stats.running / max(counts.ready, 1), stats.tbt_mean_ms / 1000)
        obs = Observation(
            now=now,
            replicas=counts.desired,
            ready=counts.ready,
            pending=counts.pending,
            unschedulable=0,
            stats=stats,
            fresh=bool(pages),
        )
        decision = decide(obs, self.params, self.memory, self.model)
        self.memory = decision.memory
        target = decision.target if decision.apply else counts.desired
        return Verdict(target, decision.action if decision.apply else "Hold", decision.reason, decision.message)


@dataclass
class HPABehavior:
    """The HorizontalPodAutoscaler's default behaviour (autoscaling/v2): scale up with no
    stabilization by at most max(100%, 4 pods) per 15 s; scale down to the highest recommendation
    of the last 300 s, by at most 100% per 15 s; a 10% tolerance around the target."""

    tolerance: float = 0.1
    up_stabilization_s: float = 0.0
    down_stabilization_s: float = 300.0
    up_percent: float = 100.0
    up_pods: int = 4
    period_s: float = 15.0


@dataclass
class HPAQueue(Autoscaler):
    """The HPA/KEDA recipe users run on vLLM: average vllm:num_requests_waiting per pod to a target.

    Pods without metrics (still loading) count as 0 when scaling up and as at target when scaling
    down, as the HPA treats pods with missing metrics."""

    target_waiting: float = 5.0
    min_replicas: int = 1
    max_replicas: int = 16
    behavior: HPABehavior = field(default_factory=HPABehavior)
    name: str = "hpa"
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.interval_s = self.behavior.period_s

    def raw_recommendation(self, counts: PodCounts, pages: Mapping[str, str]) -> tuple[int, str]:
        waiting = [sum(v for name, _, v in samples(text) if name == VLLM_WAITING) for text in pages.values()]
        current = counts.desired
        if not waiting:
            return current, "no metrics"
        total, ready, missing = sum(waiting), len(waiting), counts.pending
        ratio = total / ready / self.target_waiting
        if abs(ratio - 1) <= self.behavior.tolerance:
            return current, f"waiting {total / ready:.1f}/pod within tolerance of {self.target_waiting:g}"
        if missing:  # recompute with the pods that have no metrics yet, as the HPA does
            assumed = 0.0 if ratio > 1 else self.target_waiting * missing
            adjusted = (total + assumed) / (ready + missing) / self.target_waiting
            if abs(adjusted - 1) <= self.behavior.tolerance or (adjusted > 1) != (ratio > 1):
                return current, "within tolerance counting pods without metrics"
            ratio = adjusted
        wanted = math.ceil(ratio * (ready + missing) - 1e-9)
        return wanted, f"waiting {total / ready:.1f}/pod vs target {self.target_waiting:g}"

    def tick(self, now: float, counts: PodCounts, pages: Mapping[str, str]) -> Verdict:
        b, current = self.behavior, counts.desired
        if not self.recommendations:  # as the HPA controller: the current count is the first recommendation
            self.recommendations.append((now, current))
        wanted, why = self.raw_recommendation(counts, pages)
        wanted = max(self.min_replicas, min(self.max_replicas, wanted))
        while self.recommendations and now - self.recommendations[0][0] >= b.down_stabilization_s:
            self.recommendations.popleft()  # older than the window (kept: strictly newer than its start)
        if wanted > current:
            up_window = [r for t, r in self.recommendations if now - t < b.up_stabilization_s]
            target = min([*up_window, wanted])
            limit = max(math.ceil(current * (1 + b.up_percent / 100)), current + b.up_pods)
            target = min(target, limit)
        else:
            target = min(current, max(r for _, r in [*self.recommendations, (now, wanted)]))  # highest of 300 s
        target = max(self.min_replicas, min(self.max_replicas, target))
        self.recommendations.append((now, wanted))
        if target == current:
            return Verdict(current, "Hold", "HPA", why)
        return Verdict(target, "ScaleUp" if target > current else "ScaleDown", "HPA", why)
