"""Engine /metrics → snapshots → windowed SLO statistics (pure, apart from `fetch`).

A Snapshot is one scrape of one pod reduced to what the autoscaler needs; a Window keeps each
pod's snapshots and turns counter and histogram deltas over `window_seconds` into WindowStats.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from superinfer.engine.contract import metric

SLO_SERIES = metric("slo_requests") + "_total"
TTFT_BUCKET = metric("time_to_first_token_seconds") + "_bucket"
TBT_BUCKET = metric("time_between_tokens_seconds") + "_bucket"
TBT_SUM = metric("time_between_tokens_seconds") + "_sum"
TBT_COUNT = metric("time_between_tokens_seconds") + "_count"
RUNNING = metric("requests_running")
WAITING = metric("requests_waiting")
ROTARY = metric("requests_rotary")
KV_USAGE = metric("kv_cache_usage_ratio")
SWAP_BYTES = metric("kv_swap_bytes") + "_total"
USED_SERIES = (SLO_SERIES, TTFT_BUCKET, TBT_BUCKET, TBT_SUM, TBT_COUNT, RUNNING, WAITING, ROTARY, KV_USAGE, SWAP_BYTES)


@dataclass(frozen=True)
class Snapshot:
    time: float
    slo: Mapping[tuple[str, str], float]  # (ttft, tbt) -> requests (met|missed)
    ttft_buckets: Mapping[float, float]  # le -> cumulative count
    tbt_buckets: Mapping[float, float]
    tbt_sum: float = 0.0
    tbt_count: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    rotary: float = 0.0
    kv_usage: Mapping[str, float] = field(default_factory=dict)  # tier -> ratio
    swap_bytes: Mapping[str, float] = field(default_factory=dict)  # direction -> bytes


def parse(text: str, now: float, model_name: str | None = None) -> Snapshot:
    """Reduce one /metrics page (summed over model names unless one is given)."""
    slo: dict[tuple[str, str], float] = {}
    ttft: dict[float, float] = {}
    tbt: dict[float, float] = {}
    kv: dict[str, float] = {}
    swap: dict[str, float] = {}
    scalars = {TBT_SUM: 0.0, TBT_COUNT: 0.0, RUNNING: 0.0, WAITING: 0.0, ROTARY: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if model_name is not None and labels.get("model_name", model_name) != model_name:
                continue
            name, value = sample.name, float(sample.value)
            if name == SLO_SERIES:
                key = (labels.get("ttft", ""), labels.get("tbt", ""))
                slo[key] = slo.get(key, 0.0) + value
            elif name == TTFT_BUCKET:
                le = float(labels["le"])
                ttft[le] = ttft.get(le, 0.0) + value
            elif name == TBT_BUCKET:
                le = float(labels["le"])
                tbt[le] = tbt.get(le, 0.0) + value
            elif name == KV_USAGE:
                kv[labels.get("tier", "gpu")] = value
            elif name == SWAP_BYTES:
                direction = labels.get("direction", "")
                swap[direction] = swap.get(direction, 0.0) + value
            elif name in scalars:
                scalars[name] += value
    return Snapshot(
        time=now,
        slo=slo,
        ttft_buckets=ttft,
        tbt_buckets=tbt,
        tbt_sum=scalars[TBT_SUM],
        tbt_count=scalars[TBT_COUNT],
        running=scalars[RUNNING],
        waiting=scalars[WAITING],
        rotary=scalars[ROTARY],
        kv_usage=kv,
        swap_bytes=swap,
    )


async def fetch(session: aiohttp.ClientSession, url: str, timeout: float = 5.0) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        resp.raise_for_status()
        return await resp.text()


# ---- windows --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowStats:
    pods: int
    span_seconds: float  # how much time the deltas cover
    requests: float  # finished requests with an SLO verdict in the window
    attainment: float | None  # share meeting both TTFT and TBT
    ttft_attainment: float | None
    ttft_p90_ms: float | None
    tbt_p90_ms: float | None
    tbt_mean_ms: float | None
    running: float  # now, all pods together
    waiting: float
    rotary: float
    kv_gpu: float | None  # mean over pods, now
    kv_cpu: float | None
    swap_gbps: float  # both directions, bytes/s / 1e9 over the window


def slo_shares(slo: Mapping[tuple[str, str], float]) -> tuple[float, float | None, float | None]:
    """From (ttft, tbt) verdict counts: finished requests, the share meeting both SLOs and the share
    meeting TTFT (None without requests)."""
    total = sum(slo.values())
    if not total:
        return total, None, None
    both = slo.get(("met", "met"), 0.0)
    return total, both / total, (both + slo.get(("met", "missed"), 0.0)) / total


def _delta(new: Mapping, old: Mapping) -> dict:
    """Counter deltas; a counter that went down was reset (pod restart): its new value is the delta."""
    out = {}
    for key, value in new.items():
        before = old.get(key, 0.0)
        out[key] = value - before if value >= before else value
    return out


def _add(into: dict, more: Mapping) -> None:
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus histogram_quantile over cumulative buckets; None when empty."""
    if not buckets:
        return None
    ordered = sorted(buckets.items())
    total = ordered[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # the highest finite bound, as Prometheus does
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


@dataclass
class Window:
    """Snapshots of each pod over time; stats over the last `seconds`."""

    seconds: float
    keep: float = 2.0  # keep this many windows of history
    series: dict[str, deque[Snapshot]] = field(default_factory=dict)

    def add(self, pod: str, snap: Snapshot) -> None:
        queue = self.series.setdefault(pod, deque())
        queue.append(snap)
        while queue and snap.time - queue[0].time > self.seconds * self.keep:
            queue.popleft()

    def forget_missing(self, pods: Iterable[str]) -> None:
        alive = set(pods)
        for pod in [p for p in self.series if p not in alive]:
            del self.series[pod]

    def latest_time(self) -> float | None:
        times = [q[-1].time for q in self.series.values() if q]
        return max(times) if times else None

    def _base(self, queue: deque[Snapshot]) -> Snapshot | None:
        """The oldest earlier snapshot inside the window (else the newest earlier one)."""
        last = queue[-1]
        earlier = list(queue)[:-1]
        inside = [s for s in earlier if last.time - s.time <= self.seconds]
        if inside:
            return inside[0]
        return earlier[-1] if earlier else None

    def stats(self, now: float, fresh_seconds: float) -> WindowStats | None:
        """Deltas over the window from pods scraped within `fresh_seconds`; None without any."""
        slo: dict = {}
        ttft: dict = {}
        tbt: dict = {}
        tbt_sum = tbt_count = swap = 0.0
        span = 0.0
        running = waiting = rotary = 0.0
        kv_gpu: list[float] = []
        kv_cpu: list[float] = []
        pods = 0
        for queue in self.series.values():
            if not queue or now - queue[-1].time > fresh_seconds:
                continue
            pods += 1
            last = queue[-1]
            base = self._base(queue)
            _add(slo, _delta(last.slo, base.slo) if base else {})
            _add(ttft, _delta(last.ttft_buckets, base.ttft_buckets) if base else {})
            _add(tbt, _delta(last.tbt_buckets, base.tbt_buckets) if base else {})
            if base:
                d = _delta(
                    {"s": last.tbt_sum, "c": last.tbt_count, "w": sum(last.swap_bytes.values())},
                    {"s": base.tbt_sum, "c": base.tbt_count, "w": sum(base.swap_bytes.values())},
                )
                tbt_sum, tbt_count = tbt_sum + d["s"], tbt_count + d["c"]
                swap += d["w"] / max(last.time - base.time, 1e-9)
                span = max(span, last.time - base.time)
            running, waiting, rotary = running + last.running, waiting + last.waiting, rotary + last.rotary
            if "gpu" in last.kv_usage:
                kv_gpu.append(last.kv_usage["gpu"])
            if "cpu" in last.kv_usage:
                kv_cpu.append(last.kv_usage["cpu"])
        if pods == 0:
            return None
        total, both, ttft_only = slo_shares(slo)
        p90_ttft = histogram_quantile(0.9, ttft)
        p90_tbt = histogram_quantile(0.9, tbt)
        return WindowStats(
            pods=pods,
            span_seconds=span,
            requests=total,
            attainment=both,
            ttft_attainment=ttft_only,
            ttft_p90_ms=p90_ttft * 1000 if p90_ttft is not None else None,
            tbt_p90_ms=p90_tbt * 1000 if p90_tbt is not None else None,
            tbt_mean_ms=tbt_sum / tbt_count * 1000 if tbt_count else None,
            running=running,
            waiting=waiting,
            rotary=rotary,
            kv_gpu=sum(kv_gpu) / len(kv_gpu) if kv_gpu else None,
            kv_cpu=sum(kv_cpu) / len(kv_cpu) if kv_cpu else None,
            swap_gbps=swap / 1e9,
        )
