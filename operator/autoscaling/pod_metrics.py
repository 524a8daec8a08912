"""Engine /metrics → snapshots → windowed SLO statistics (pure, apart from `fetch`).

A Snapshot is one scrape of one pod reduced to what the autoscaler needs; a Window keeps each
pod's snapshots and turns counter and histogram deltas over `window_seconds` into WindowStats.
SLO verdicts, latency histograms and stalled streams are kept per SLO class (series without the
label belong to the default class), so each class can be held against its own targets.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from superinfer.engine.contract import DEFAULT_SLO_CLASS, SLO_CLASS_LABEL, SLO_TARGET_GAUGE, metric

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
SLO_TARGET = metric(SLO_TARGET_GAUGE)
STALLED = metric("stalled_requests") + "_total"
USED_SERIES = (
    SLO_SERIES,
    TTFT_BUCKET,
    TBT_BUCKET,
    TBT_SUM,
    TBT_COUNT,
    RUNNING,
    WAITING,
    ROTARY,
    KV_USAGE,
    SWAP_BYTES,
    SLO_TARGET,
    STALLED,
)


def slo_class(labels: Mapping[str, str]) -> str:
    """The SLO class a series belongs to (series without the label: the default class)."""
    return labels.get(SLO_CLASS_LABEL) or DEFAULT_SLO_CLASS


@dataclass(frozen=True)
class Snapshot:
    time: float
    slo: Mapping[tuple[str, str, str], float]  # (slo_class, ttft, tbt) -> requests (met|missed)
    ttft_buckets: Mapping[tuple[str, float], float]  # (slo_class, le) -> cumulative count
    tbt_buckets: Mapping[tuple[str, float], float]
    tbt_sum: float = 0.0
    tbt_count: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    rotary: float = 0.0
    kv_usage: Mapping[str, float] = field(default_factory=dict)  # tier -> ratio
    swap_bytes: Mapping[str, float] = field(default_factory=dict)  # direction -> bytes
    targets: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (slo_class, ttft|tbt) -> seconds
    stalled: Mapping[str, float] = field(default_factory=dict)  # slo_class -> streams past their stall budget


def parse(text: str, now: float, model_name: str | None = None) -> Snapshot:
    """Reduce one /metrics page (summed over model names unless one is given)."""
    slo: dict[tuple[str, str, str], float] = {}
    ttft: dict[tuple[str, float], float] = {}
    tbt: dict[tuple[str, float], float] = {}
    kv: dict[str, float] = {}
    swap: dict[str, float] = {}
    targets: dict[tuple[str, str], float] = {}
    stalled: dict[str, float] = {}
    scalars = {TBT_SUM: 0.0, TBT_COUNT: 0.0, RUNNING: 0.0, WAITING: 0.0, ROTARY: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if model_name is not None and labels.get("model_name", model_name) != model_name:
                continue
            name, value = sample.name, float(sample.value)
            if name == SLO_SERIES:
                key = (slo_class(labels), labels.get("ttft", ""), labels.get("tbt", ""))
                slo[key] = slo.get(key, 0.0) + value
            elif name in (TTFT_BUCKET, TBT_BUCKET):
                into = ttft if name == TTFT_BUCKET else tbt
                bucket = (slo_class(labels), float(labels["le"]))
                into[bucket] = into.get(bucket, 0.0) + value
            elif name == SLO_TARGET:
                target = (slo_class(labels), labels.get("kind", ""))
                targets[target] = min(value, targets.get(target, math.inf))  # strictest over model names
            elif name == STALLED:
                stalled[slo_class(labels)] = stalled.get(slo_class(labels), 0.0) + value
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
        targets=targets,
        stalled=stalled,
    )


async def fetch(session: aiohttp.ClientSession, url: str, timeout: float = 5.0) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        resp.raise_for_status()
        return await resp.text()


# ---- windows --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassStats:
    """One SLO class over the window: its verdicts, its latency p90s and its own targets."""

    requests: float  # finished requests of the class with an SLO verdict
    attainment: float | None
    ttft_p90_ms: float | None
    tbt_p90_ms: float | None
    ttft_target_ms: float | None = None  # as the engine exports it; None when the source has none
    tbt_target_ms: float | None = None
    stalled: float = 0.0  # finished streams whose worst gap exceeded their stall budget


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
    classes: Mapping[str, ClassStats] = field(default_factory=dict)  # classes with data in the window
    pods_with_room: int = 0  # ready pods with nothing queued and nothing rotated out, now


def slo_shares(slo: Mapping[tuple[str, str], float]) -> tuple[float, float | None, float | None]:
    """From (ttft, tbt) verdict counts: finished requests, the share meeting both SLOs and the share
    meeting TTFT (None without requests)."""
    total = sum(slo.values())
    if not total:
        return total, None, None
    both = slo.get(("met", "met"), 0.0)
    return total, both / total, (both + slo.get(("met", "missed"), 0.0)) / total


def class_stats(
    slo: Mapping[tuple[str, str, str], float],
    p90: Mapping[tuple[str, str], float | None],
    targets: Mapping[tuple[str, str], float | None],
    stalled: Mapping[str, float] | None = None,
) -> dict[str, ClassStats]:
    """Per-class statistics of the classes with traffic in the window, from verdict counts keyed
    (class, ttft, tbt), p90s and targets in seconds keyed (class, ttft|tbt) and stalled streams
    keyed by class."""
    stalled = stalled or {}
    out: dict[str, ClassStats] = {}
    for name in sorted({c for c, _, _ in slo} | {c for c, _ in p90}):
        total, both, _ = slo_shares(of_class(slo, name))
        ttft, tbt = p90.get((name, "ttft")), p90.get((name, "tbt"))
        if not total and ttft is None and tbt is None:
            continue
        out[name] = ClassStats(
            requests=total,
            attainment=both,
            ttft_p90_ms=ms(ttft),
            tbt_p90_ms=ms(tbt),
            ttft_target_ms=ms(targets.get((name, "ttft"))),
            tbt_target_ms=ms(targets.get((name, "tbt"))),
            stalled=stalled.get(name, 0.0),
        )
    return out


def class_p90s(ttft: Mapping[tuple[str, float], float], tbt: Mapping[tuple[str, float], float]) -> dict:
    """Each class's p90 TTFT and TBT (seconds, keyed (class, ttft|tbt)) from (class, le) buckets."""
    out: dict[tuple[str, str], float | None] = {}
    for kind, buckets in (("ttft", ttft), ("tbt", tbt)):
        for name in {c for c, _ in buckets}:
            out[name, kind] = histogram_quantile(0.9, of_class(buckets, name))
    return out


def _unclassed(key: tuple) -> Any:
    """A class-keyed count's key without its class: (class, le) -> le, (class, ttft, tbt) -> (ttft, tbt)."""
    return key[1] if len(key) == 2 else key[1:]


def of_class(counts: Mapping[tuple, float], name: str) -> dict:
    """One class's counts, keyed without the class."""
    return {_unclassed(key): value for key, value in counts.items() if key[0] == name}


def pooled(counts: Mapping[tuple, float]) -> dict:
    """Counts summed over every class, keyed without the class."""
    out: dict = {}
    for key, value in counts.items():
        rest = _unclassed(key)
        out[rest] = out.get(rest, 0.0) + value
    return out


def ms(seconds: float | None) -> float | None:
    return seconds * 1000 if seconds is not None else None


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
        targets: dict[tuple[str, str], float] = {}
        stalled: dict[str, float] = {}
        pods = with_room = 0
        for queue in self.series.values():
            if not queue or now - queue[-1].time > fresh_seconds:
                continue
            pods += 1
            last = queue[-1]
            base = self._base(queue)
            _add(slo, _delta(last.slo, base.slo) if base else {})
            _add(ttft, _delta(last.ttft_buckets, base.ttft_buckets) if base else {})
            _add(tbt, _delta(last.tbt_buckets, base.tbt_buckets) if base else {})
            _add(stalled, _delta(last.stalled, base.stalled) if base else {})
            if base:
                d = _delta(
                    {"s": last.tbt_sum, "c": last.tbt_count, "w": sum(last.swap_bytes.values())},
                    {"s": base.tbt_sum, "c": base.tbt_count, "w": sum(base.swap_bytes.values())},
                )
                tbt_sum, tbt_count = tbt_sum + d["s"], tbt_count + d["c"]
                swap += d["w"] / max(last.time - base.time, 1e-9)
                span = max(span, last.time - base.time)
            running, waiting, rotary = running + last.running, waiting + last.waiting, rotary + last.rotary
            with_room += last.waiting == 0 and last.rotary == 0
            if "gpu" in last.kv_usage:
                kv_gpu.append(last.kv_usage["gpu"])
            if "cpu" in last.kv_usage:
                kv_cpu.append(last.kv_usage["cpu"])
            for key, seconds in last.targets.items():  # pods mid-rollout may differ: the strictest
                targets[key] = min(seconds, targets.get(key, math.inf))
        if pods == 0:
            return None
        total, both, ttft_only = slo_shares(pooled(slo))
        return WindowStats(
            pods=pods,
            span_seconds=span,
            requests=total,
            attainment=both,
            ttft_attainment=ttft_only,
            ttft_p90_ms=ms(histogram_quantile(0.9, pooled(ttft))),
            tbt_p90_ms=ms(histogram_quantile(0.9, pooled(tbt))),
            tbt_mean_ms=tbt_sum / tbt_count * 1000 if tbt_count else None,
            running=running,
            waiting=waiting,
            rotary=rotary,
            kv_gpu=sum(kv_gpu) / len(kv_gpu) if kv_gpu else None,
            kv_cpu=sum(kv_cpu) / len(kv_cpu) if kv_cpu else None,
            swap_gbps=swap / 1e9,
            classes=class_stats(slo, class_p90s(ttft, tbt), targets, stalled),
            pods_with_room=with_room,
        )
