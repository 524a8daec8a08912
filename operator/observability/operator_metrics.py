"""The operator's own Prometheus metrics (prefix superinfer_operator_)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

PREFIX = "superinfer_operator_"
LABELS = ("namespace", "inferenceservice")


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.desired_replicas = Gauge(
            PREFIX + "desired_replicas", "Replicas the SLO autoscaler wants", LABELS, registry=r
        )
        self.current_replicas = Gauge(
            PREFIX + "current_replicas", "Replicas of the engine Deployment", LABELS, registry=r
        )
        self.ready_replicas = Gauge(PREFIX + "ready_replicas", "Ready engine pods", LABELS, registry=r)
        self.slo_attainment = Gauge(PREFIX + "slo_attainment_ratio", "Windowed SLO attainment", LABELS, registry=r)
        self.slo_target = Gauge(PREFIX + "slo_attainment_target", "Attainment target of the spec", LABELS, registry=r)
        self.decisions = Counter(
            PREFIX + "scaling_decisions", "Autoscaler decisions", (*LABELS, "direction", "reason"), registry=r
        )
        self.reconcile_errors = Counter(PREFIX + "reconcile_errors", "Failed reconciliations", LABELS, registry=r)

    def forget(self, namespace: str, name: str) -> None:
        self._remove(namespace, name, self.current_replicas, self.ready_replicas, self.slo_target)
        self.forget_autoscaler(namespace, name)

    def forget_autoscaler(self, namespace: str, name: str) -> None:
        """The gauges only the autoscaler sets."""
        self._remove(namespace, name, self.desired_replicas, self.slo_attainment)

    @staticmethod
    def _remove(namespace: str, name: str, *gauges: Gauge) -> None:
        for gauge in gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)


def exported_names() -> set[str]:
    """Every series name this module exports (for the dashboard/rules PromQL check)."""
    gauges = ("desired_replicas", "current_replicas", "ready_replicas", "slo_attainment_ratio", "slo_attainment_target")
    counters = ("scaling_decisions", "reconcile_errors")
    names = {PREFIX + g for g in gauges}
    for c in counters:
        names |= {PREFIX + c + "_total", PREFIX + c + "_created"}
    return names
