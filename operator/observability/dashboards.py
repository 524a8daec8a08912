"""Grafana dashboards (JSON models) built from the PromQL in promql.py; generate.py writes them out."""

from __future__ import annotations

import itertools
from typing import Any

from superinfer.engine.contract import metric
from superinfer.operator.observability import promql as q

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
OPS_SEL = 'namespace=~"$namespace"'
TARGET = f"max by (inferenceservice) (superinfer_operator_slo_attainment_target{{{OPS_SEL}}})"


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}


def panel(
    title: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    kind: str = "timeseries",
    width: int = 12,
    height: int = 8,
) -> dict[str, Any]:
    refs = (chr(ord("A") + i) for i in itertools.count())
    return {
        "type": kind,
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"w": width, "h": height},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [_target(expr, legend, next(refs)) for expr, legend in targets],
    }


def _layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p["gridPos"].update({"x": x, "y": y})
        p["id"] = i
        x, row_h = x + w, max(row_h, h)
    return panels


def _variables(with_model: bool = True) -> dict[str, Any]:
    ds = {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}
    ns = {
        "name": "namespace",
        "type": "query",
        "datasource": DATASOURCE,
        "query": f"label_values({metric('requests_running')}, namespace)",
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "refresh": 2,
    }
    model = {
        "name": "model",
        "type": "query",
        "datasource": DATASOURCE,
        "query": f'label_values({metric("requests_running")}{{namespace=~"$namespace"}}, model_name)',
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "refresh": 2,
    }
    return {"list": [ds, ns, model] if with_model else [ds, ns]}


def dashboard(uid: str, title: str, panels: list[dict[str, Any]], with_model: bool = True) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "tags": ["superinfer"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": _variables(with_model),
        "panels": _layout(panels),
    }


def _latency(kind: str, histogram: str) -> dict[str, Any]:
    """Quantiles per SLO class against each class's target (classes have different targets)."""
    legend = "{{slo_class}} {{model_name}}"
    targets = [(q.quantile(p, histogram, q.BY_CLASS), f"p{int(p * 100)} {legend}") for p in (0.5, 0.9, 0.99)]
    targets.append((q.slo_line(kind), f"SLO {legend}"))
    return panel(f"{kind.upper()} p50 / p90 / p99 vs SLO, by SLO class", targets, unit="s")


def _stalls() -> list[dict[str, Any]]:
    """Streams that freeze: each class's worst-gap p99 against its stall budget, and how many
    finished requests stalled past it, per second and as a share (the autoscaler's signal)."""
    legend = "{{slo_class}} {{model_name}}"
    stalled = q.rate_sum(metric("stalled_requests") + "_total", q.BY_CLASS)
    budget = (q.slo_line("stall"), f"budget {legend}")
    return [
        panel(
            "Worst gap between tokens p99 vs stall budget, by SLO class",
            [(q.quantile(0.99, "worst_gap_seconds", q.BY_CLASS), f"p99 {legend}"), budget],
            "s",
            width=8,
        ),
        panel(
            "Stalled requests/s (worst gap past the stall budget), by SLO class", [(stalled, legend)], "reqps", width=8
        ),
        panel(
            "Stalled share of finished requests, by SLO class",
            [(f"{stalled} / {q.rate_sum(q.SLO, q.BY_CLASS)}", legend)],
            "percentunit",
            width=8,
        ),
    ]


def slo_overview() -> dict[str, Any]:
    finished = q.rate_sum(q.SLO)
    panels = [
        panel("SLO attainment (TTFT and TBT)", [(q.attainment(), "{{model_name}}")], "percentunit", "stat", 6, 5),
        panel("TTFT attainment", [(q.ttft_attainment(), "{{model_name}}")], "percentunit", "stat", 6, 5),
        panel("Requests/s with an SLO verdict", [(finished, "{{model_name}}")], "reqps", "stat", 6, 5),
        panel(
            "Attainment target",
            [(TARGET, "{{inferenceservice}}")],
            "percentunit",
            "stat",
            6,
            5,
        ),
        panel(
            "Attainment vs target",
            [
                (q.attainment(), "attainment {{model_name}}"),
                (q.ttft_attainment(), "TTFT only {{model_name}}"),
                (TARGET, "target {{inferenceservice}}"),
            ],
            "percentunit",
            width=24,
        ),
        panel(
            "Goodput by SLO class (requests/s meeting TTFT and TBT)",
            [(q.goodput(q.BY_CLASS), "{{slo_class}} {{model_name}}")],
            "reqps",
            width=8,
        ),
        panel(
            "Goodput share by SLO class",
            [(q.attainment(q.BY_CLASS), "{{slo_class}} {{model_name}}")],
            "percentunit",
            width=8,
        ),
        panel(
            "TTFT attainment by SLO class",
            [(q.ttft_attainment(q.BY_CLASS), "{{slo_class}} {{model_name}}")],
            "percentunit",
            width=8,
        ),
        _latency("ttft", "time_to_first_token_seconds"),
        _latency("tbt", "time_between_tokens_seconds"),
        *_stalls(),
        panel(
            "Requests missing an SLO",
            [(q.rate_sum(q.SLO, "model_name, ttft, tbt", extra='ttft="missed"'), "TTFT missed, TBT {{tbt}}"),
             (q.rate_sum(q.SLO, "model_name, ttft, tbt", extra='tbt="missed"'), "TBT missed, TTFT {{ttft}}")],
            "reqps",
            width=24,
        ),
    ]  # fmt: skip
    return dashboard("superinfer-slo", "SuperInfer / SLO overview", panels)


def _gauge_sum(name: str, by: str = "model_name") -> str:
    return f"sum by ({by}) ({metric(name)}{{{q.SEL}}})"


BY_DIRECTION = "model_name, direction"
DIRECTION_LEGEND = "{{direction}} {{model_name}}"


def rotation() -> dict[str, Any]:
    swap = metric("kv_swap_bytes") + "_total"
    hidden = metric("kv_copy_hidden_ratio")
    panels = [
        panel("Requests in the rotary (CPU) tier", [(_gauge_sum("requests_rotary"), "{{model_name}}")]),
        panel("Rotations/s", [(q.rate_sum(metric("rotations") + "_total"), "{{model_name}}")], "ops"),
        panel(
            "Rotations per completed request",
            [(q.per_request(metric("rotations") + "_total"), "{{model_name}}")],
        ),
        panel(
            "KV swap bandwidth",
            [(f"{q.rate_sum(swap, 'model_name, direction')}", "{{direction}} {{model_name}}")],
            "Bps",
        ),
        panel(
            "KV cache usage by tier",
            [(f"avg by (model_name, tier) ({metric('kv_cache_usage_ratio')}{{{q.SEL}}})", "{{tier}} {{model_name}}")],
            "percentunit",
        ),
        panel(
            "Preemptions/s by mode and reason",
            [
                (
                    q.rate_sum(metric("preemptions") + "_total", "model_name, mode, reason"),
                    "{{mode}} ({{reason}}) {{model_name}}",
                )
            ],
            "ops",
        ),
        panel(
            "KV swap time p90",
            [(q.quantile(0.9, "kv_swap_seconds", "model_name, direction"), "{{direction}} {{model_name}}")],
            "s",
        ),
        panel(
            "Rotation latency p50 / p99 (decision to blocks resident in the other tier)",
            [
                (q.quantile(p, "rotation_seconds", BY_DIRECTION), f"p{round(p * 100)} {DIRECTION_LEGEND}")
                for p in (0.5, 0.99)
            ],
            "s",
        ),
        panel(
            "KV copy bandwidth p50 (per step's copy)",
            [(q.quantile(0.5, "kv_copy_bandwidth_bytes_per_second", BY_DIRECTION), DIRECTION_LEGEND)],
            "Bps",
        ),
        panel(
            "Copy time hidden under compute (mean per step with copies)",
            [(f"{q.rate_sum(hidden + '_sum')} / {q.rate_sum(hidden + '_count')}", "{{model_name}}")],
            "percentunit",
        ),
        panel(
            "KV copy queueing delay p99 (submission to copy start)",
            [(q.quantile(0.99, "kv_copy_queue_seconds", BY_DIRECTION), DIRECTION_LEGEND)],
            "s",
        ),
    ]
    return dashboard("superinfer-rotation", "SuperInfer / Rotation (RotaSched + DuplexKV)", panels)


def throughput() -> dict[str, Any]:
    panels = [
        panel("Generated tokens/s", [(q.rate_sum(metric("generation_tokens") + "_total"), "{{model_name}}")]),
        panel("Prompt tokens/s", [(q.rate_sum(metric("prompt_tokens") + "_total"), "{{model_name}}")]),
        panel(
            "Finished requests/s by reason",
            [(q.rate_sum(metric("requests_finished") + "_total", "model_name, finished_reason"),
              "{{finished_reason}} {{model_name}}")],
            "reqps",
        ),
        panel(
            "Running and waiting requests",
            [(_gauge_sum("requests_running"), "running {{model_name}}"),
             (_gauge_sum("requests_waiting"), "waiting {{model_name}}")],
        ),
        panel(
            "Queue time and end-to-end latency p90",
            [(q.quantile(0.9, "request_queue_seconds"), "queue {{model_name}}"),
             (q.quantile(0.9, "e2e_request_latency_seconds"), "e2e {{model_name}}")],
            "s",
        ),
        panel(
            "Scheduler step time p90 by phase",
            [(q.quantile(0.9, "scheduler_step_seconds", "model_name, phase"), "{{phase}} {{model_name}}")],
            "s",
        ),
    ]  # fmt: skip
    return dashboard("superinfer-throughput", "SuperInfer / Throughput", panels)


def autoscaler() -> dict[str, Any]:
    ops = "superinfer_operator_"
    panels = [
        panel(
            "Desired vs current vs ready replicas",
            [(f"{ops}desired_replicas{{{OPS_SEL}}}", "desired {{inferenceservice}}"),
             (f"{ops}current_replicas{{{OPS_SEL}}}", "current {{inferenceservice}}"),
             (f"{ops}ready_replicas{{{OPS_SEL}}}", "ready {{inferenceservice}}")],
            width=24,
        ),
        panel(
            "Scaling decisions by reason (1h)",
            [(f"sum by (inferenceservice, direction, reason) "
              f"(increase({ops}scaling_decisions_total{{{OPS_SEL}}}[1h]))", "{{direction}} {{reason}}")],
            kind="barchart",
        ),
        panel(
            "Attainment seen by the autoscaler vs target",
            [(f"{ops}slo_attainment_ratio{{{OPS_SEL}}}", "attainment {{inferenceservice}}"),
             (f"{ops}slo_attainment_target{{{OPS_SEL}}}", "target {{inferenceservice}}")],
            "percentunit",
        ),
        panel(
            "Reconcile errors (1h)",
            [(f"sum by (inferenceservice) (increase({ops}reconcile_errors_total{{{OPS_SEL}}}[1h]))",
              "{{inferenceservice}}")],
        ),
    ]  # fmt: skip
    return dashboard("superinfer-autoscaler", "SuperInfer / Autoscaler", panels, with_model=False)


def all_dashboards() -> dict[str, dict[str, Any]]:
    """File name → dashboard."""
    return {
        "slo-overview.json": slo_overview(),
        "rotation.json": rotation(),
        "throughput.json": throughput(),
        "autoscaler.json": autoscaler(),
    }


def exprs(dash: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["query"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    return out
