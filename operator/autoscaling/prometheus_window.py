"""The autoscaler's window from a Prometheus server instead of scraping the pods.

The same WindowStats as pod_metrics.Window produces, from instant PromQL queries over the window
(verdicts, p90s and targets per SLO class as well as pooled; stalled streams per class). The
server is the one the cluster admin configured for the operator, never a URL from a tenant's
resource; series are selected by namespace and the `inferenceservice` label (added by the
PodMonitors from the pod label), so two services serving the same model name never mix.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from superinfer.engine.contract import SLO_CLASS_LABEL, SLO_TARGET_GAUGE, metric
from superinfer.operator.api.names import PROMETHEUS_SERVICE_LABEL as SERVICE_LABEL
from superinfer.operator.autoscaling.pod_metrics import WindowStats, class_stats, ms, pooled, slo_class, slo_shares


@dataclass(frozen=True)
class PrometheusSource:
    url: str
    bearer_token: str = ""
    ca_file: str = ""  # verify the server against this CA bundle (default: the system's)
    insecure_skip_verify: bool = False

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.bearer_token}"} if self.bearer_token else {}

    def ssl(self) -> ssl_module.SSLContext | bool:
        if self.insecure_skip_verify:
            return False
        return ssl_module.create_default_context(cafile=self.ca_file or None)


def queries(namespace: str, service: str, window_seconds: float) -> dict[str, str]:
    sel = f'namespace="{namespace}", {SERVICE_LABEL}="{service}"'
    w = f"{int(window_seconds)}s"

    def quantile(hist: str, by: str = "le") -> str:
        return f"histogram_quantile(0.9, sum by ({by}) (rate({metric(hist)}_bucket{{{sel}}}[{w}])))"

    tbt = metric("time_between_tokens_seconds")
    per_class = f"{SLO_CLASS_LABEL}, le"
    return {
        "slo": f"sum by ({SLO_CLASS_LABEL}, ttft, tbt) (increase({metric('slo_requests')}_total{{{sel}}}[{w}]))",
        "ttft_p90": quantile("time_to_first_token_seconds"),
        "tbt_p90": quantile("time_between_tokens_seconds"),
        "ttft_p90_class": quantile("time_to_first_token_seconds", per_class),
        "tbt_p90_class": quantile("time_between_tokens_seconds", per_class),
        "targets": f"min by ({SLO_CLASS_LABEL}, kind) ({metric(SLO_TARGET_GAUGE)}{{{sel}}})",
        "stalled": f"sum by ({SLO_CLASS_LABEL}) (increase({metric('stalled_requests')}_total{{{sel}}}[{w}]))",
        "tbt_mean": f"sum(rate({tbt}_sum{{{sel}}}[{w}])) / sum(rate({tbt}_count{{{sel}}}[{w}]))",
        "pods": f"count({metric('requests_running')}{{{sel}}})",
        "running": f"sum({metric('requests_running')}{{{sel}}})",
        "waiting": f"sum({metric('requests_waiting')}{{{sel}}})",
        "rotary": f"sum({metric('requests_rotary')}{{{sel}}})",
        "kv": f"avg by (tier) ({metric('kv_cache_usage_ratio')}{{{sel}}})",
        "swap": f"sum(rate({metric('kv_swap_bytes')}_total{{{sel}}}[{w}]))",
    }


def _value(sample: Mapping[str, Any]) -> float | None:
    value = float(sample["value"][1])
    return None if value != value else value  # NaN (e.g. 0/0) means no data


def _scalar(result: list[Mapping[str, Any]]) -> float | None:
    return _value(result[0]) if result else None


def class_keyed(results: Mapping[str, list[Mapping[str, Any]]]) -> tuple[dict, dict, dict, dict]:
    """Verdict counts (class, ttft, tbt), p90s and targets (class, ttft|tbt) and stalled streams
    (class) from the vectors."""
    slo = {(slo_class(r["metric"]), r["metric"].get("ttft", ""), r["metric"].get("tbt", "")): float(r["value"][1])
           for r in results.get("slo", [])}  # fmt: skip
    p90 = {
        (slo_class(r["metric"]), kind): _value(r)
        for kind in ("ttft", "tbt")
        for r in results.get(f"{kind}_p90_class", [])
    }
    targets = {(slo_class(r["metric"]), r["metric"].get("kind", "")): _value(r) for r in results.get("targets", [])}
    stalled = {slo_class(r["metric"]): _value(r) or 0.0 for r in results.get("stalled", [])}
    return slo, p90, targets, stalled


def build_stats(results: Mapping[str, list[Mapping[str, Any]]], window_seconds: float) -> WindowStats | None:
    """WindowStats from the vectors the queries returned; None when no pod reports."""
    pods = _scalar(results.get("pods", []))
    if not pods:
        return None
    slo, p90, targets, stalled = class_keyed(results)
    total, both, ttft_only = slo_shares(pooled(slo))
    kv = {r["metric"].get("tier", ""): float(r["value"][1]) for r in results.get("kv", [])}
    ttft, tbt, tbt_mean = (_scalar(results.get(k, [])) for k in ("ttft_p90", "tbt_p90", "tbt_mean"))
    return WindowStats(
        pods=int(pods),
        span_seconds=window_seconds,
        requests=total,
        attainment=both,
        ttft_attainment=ttft_only,
        ttft_p90_ms=ms(ttft),
        tbt_p90_ms=ms(tbt),
        tbt_mean_ms=ms(tbt_mean),
        running=_scalar(results.get("running", [])) or 0.0,
        waiting=_scalar(results.get("waiting", [])) or 0.0,
        rotary=_scalar(results.get("rotary", [])) or 0.0,
        kv_gpu=kv.get("gpu"),
        kv_cpu=kv.get("cpu"),
        swap_gbps=(_scalar(results.get("swap", [])) or 0.0) / 1e9,
        classes=class_stats(slo, p90, targets, stalled),
    )


async def window(
    session: aiohttp.ClientSession,
    source: PrometheusSource,
    namespace: str,
    service: str,
    window_seconds: float,
    timeout: float,
) -> WindowStats | None:
    """Query Prometheus; None when it cannot be reached or has nothing for this service."""

    async def one(expr: str) -> list[Mapping[str, Any]]:
        async with session.get(
            source.url.rstrip("/") + "/api/v1/query",
            params={"query": expr},
            headers=source.headers(),
            ssl=source.ssl(),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            resp.raise_for_status()
            body = await resp.json()
        if body.get("status") != "success":
            raise aiohttp.ClientError(body.get("error", "query failed"))
        return body["data"]["result"]

    exprs = queries(namespace, service, window_seconds)
    try:
        values = await asyncio.gather(*(one(e) for e in exprs.values()))
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    return build_stats(dict(zip(exprs, values, strict=True)), window_seconds)
