"""What a router sees of a pod: the gauges of its /metrics page at the last scrape.

Routers scrape often (the endpoint picker's default refresh is 50 ms), so a replica renders only
the gauges they read (the same gauge families its /metrics page renders) and this module parses
the text format back, as a scraper would. The autoscaler reads whole pages through
operator/autoscaling/pod_metrics.parse instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from superinfer.engine.contract import metric
from superinfer.engine.metrics import EngineMetrics

VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV = "vllm:kv_cache_usage_perc"
WAITING = metric("requests_waiting")
RUNNING = metric("requests_running")
ROTARY = metric("requests_rotary")
SLO_LAG = metric("slo_lag_seconds")
KV_RATIO = metric("kv_cache_usage_ratio")
KV_BLOCKS = metric("kv_blocks")


@dataclass(frozen=True)
class PodView:
    """One pod's routing signals as last scraped."""

    name: str
    time: float
    vllm_waiting: float = 0.0  # vllm:num_requests_waiting
    vllm_running: float = 0.0
    vllm_kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (0-1): the GPU pool's used share
    waiting: float = 0.0  # superinfer_engine_requests_waiting
    running: float = 0.0
    rotary: float = 0.0  # rotated out to the CPU tier, not yet back
    slo_lag_s: float = 0.0  # the largest lag behind an SLO of a request not running
    kv_gpu: float = 0.0  # superinfer_engine_kv_cache_usage_ratio{tier="gpu"}
    kv_cpu: float = 0.0
    gpu_blocks: float = 0.0  # the GPU pool's size (sum of kv_blocks{tier="gpu"} over states)
    cpu_used_blocks: float = 0.0  # kv_blocks{tier="cpu",state="used"}


def render_gauges(metrics: EngineMetrics) -> str:
    """The text-format lines of the routing gauges, as they stand (the page restricted to them)."""
    families = [metrics.vllm[key] for key in ("waiting", "running", "kv")]
    families += [metrics.gauges[name] for name in ("requests_waiting", "requests_running", "requests_rotary")]
    families += [metrics.gauges[name] for name in ("slo_lag_seconds", "kv_cache_usage_ratio", "kv_blocks")]
    lines = []
    for family in families:
        for collected in family.collect():
            for s in collected.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
                lines.append(f"{s.name}{{{labels}}} {floatToGoString(s.value)}")
    return "\n".join(lines)


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split('",'):
        key, _, value = part.partition('="')
        if key:
            out[key.strip()] = value.rstrip('"')
    return out


def samples(text: str) -> list[tuple[str, Mapping[str, str], float]]:
    """(name, labels, value) of each sample line of a text-format page (label values without
    escaped quotes or commas, as the engine's are)."""
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name, brace, rest = head.partition("{")
        out.append((name, _labels(rest[:-1]) if brace else {}, float(value)))
    return out


def parse_view(name: str, text: str, now: float) -> PodView:
    """A PodView from the gauges of a /metrics page."""
    fields: dict[str, float] = {}
    gpu_blocks = cpu_used = 0.0
    simple = {
        VLLM_WAITING: "vllm_waiting",
        VLLM_RUNNING: "vllm_running",
        VLLM_KV: "vllm_kv_usage",
        WAITING: "waiting",
        RUNNING: "running",
        ROTARY: "rotary",
        SLO_LAG: "slo_lag_s",
    }
    for sample, labels, value in samples(text):
        if sample in simple:
            fields[simple[sample]] = fields.get(simple[sample], 0.0) + value
        elif sample == KV_RATIO:
            fields["kv_" + labels.get("tier", "gpu")] = value
        elif sample == KV_BLOCKS:
            if labels.get("tier") == "gpu":
                gpu_blocks += value
            elif labels.get("state") == "used":
                cpu_used += value
    return PodView(name, now, gpu_blocks=gpu_blocks, cpu_used_blocks=cpu_used, **fields)
