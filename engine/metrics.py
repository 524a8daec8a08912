"""Prometheus metrics of the engine. Names and labels are the contract in engine/contract.py."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from superinfer.engine import contract as c
from superinfer.engine.core.kv_manager import KVCacheManager
from superinfer.engine.core.request import Request
from superinfer.engine.core.scheduler import Scheduler, SchedulerCounters
from superinfer.engine.core.token_timing import TokenTiming
from superinfer.engine.slo import (
    SLO,
    histogram_buckets,
    meets_stall,
    meets_tbt,
    meets_ttft,
    p99_gap,
    slo_lag_seconds,
)

if TYPE_CHECKING:
    from superinfer.engine.worker.duplex import CopyStats

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# KV copies: rotation latency and queueing from 0.1 ms to 10 s; bandwidth 100 MB/s .. 1 TB/s in 1-2-5
# steps (host copies, PCIe, C2C); hidden ratio in tenths (its 0 bucket counts serial and CPU copies).
COPY_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BANDWIDTH_BUCKETS = (1e8, 2e8, 5e8, 1e9, 2e9, 5e9, 1e10, 2e10, 5e10, 1e11, 2e11, 5e11, 1e12)
RATIO_BUCKETS = tuple(i / 10 for i in range(11))
FEW_VALUES = 32  # up to this many values a Python loop counts them faster than numpy's calls


class BatchHistogram:
    """A histogram observed every step, per token or per step phase: values counted into its
    buckets without a lock (a step's many by one numpy pass, a few by a loop), exported at scrape
    time as an ordinary Prometheus histogram. prometheus-client's Histogram takes a lock, checks
    its labels and walks its buckets in Python for each value: most of the engine's per-token
    output work at thousands of requests, and a few percent of a tiny model's ~2 ms step."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self.bounds = sorted(b for b in set(buckets) if b != float("inf"))
        self.les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self.series: dict[tuple[str, ...], list[float]] = {}  # label values -> bucket counts, then the sum
        registry.register(self)

    def observe_all(self, labels: tuple[str, ...], values: Sequence[float] | np.ndarray) -> None:
        """Count each value (a step's tokens) into its bucket, the first whose bound is >= it."""
        counts = self.series.get(labels)
        if counts is None:
            counts = self.series[labels] = [0] * len(self.les) + [0.0]
        if len(values) <= FEW_VALUES:
            for value in values:
                counts[bisect_left(self.bounds, value)] += 1
                counts[-1] += float(value)
            return
        hits = np.bincount(np.searchsorted(self.bounds, values), minlength=len(self.les))
        for bucket in np.flatnonzero(hits).tolist():
            counts[bucket] += int(hits[bucket])
        counts[-1] += float(np.sum(values))

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        self.observe_all(labels, (value,))

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, counts in list(self.series.items()):
            snapshot = list(counts)  # one copy: the buckets and the sum agree with each other
            family.add_metric(list(labels), list(zip(self.les, accumulate(snapshot[:-1]), strict=True)), snapshot[-1])
        yield family


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        slo: SLO,
        info: dict[str, str],
        vllm_compat: bool = False,
        classes: Mapping[str, SLO] | None = None,
    ) -> None:
        """`classes`: the SLO of each class (default: `slo` as the only class)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, label = self.registry, "model_name"

        def gauge(name: str, *labels: str) -> Gauge:
            return Gauge(c.metric(name), name.replace("_", " "), [label, *labels], registry=reg)

        def counter(name: str, *labels: str) -> Counter:
            return Counter(c.metric(name), name.replace("_", " "), [label, *labels], registry=reg)

        def histogram(name: str, buckets: tuple[float, ...] | list[float], *labels: str) -> Histogram:
            return Histogram(c.metric(name), name.replace("_", " "), [label, *labels], buckets=buckets, registry=reg)

        def batched(name: str, buckets: Sequence[float], *labels: str) -> BatchHistogram:
            return BatchHistogram(c.metric(name), name.replace("_", " "), [label, *labels], buckets, reg)

        self.gauges = {name: gauge(name, *labels) for name, labels in c.GAUGES.items()}
        self.counters = {name: counter(name, *labels) for name, labels in c.COUNTERS.items()}
        classes = dict(classes) if classes is not None else {c.DEFAULT_SLO_CLASS: slo}
        ttft_buckets, tbt_buckets, gap_buckets = list(LATENCY_BUCKETS), list(LATENCY_BUCKETS), list(LATENCY_BUCKETS)
        for target in classes.values():  # every class's thresholds are bucket bounds
            ttft_buckets = histogram_buckets(target.ttft_ms / 1000.0, ttft_buckets)
            tbt_buckets = histogram_buckets(target.tbt_ms / 1000.0, tbt_buckets)
            gap_buckets = histogram_buckets(target.stall_budget_ms / 1000.0, gap_buckets)
        self.ttft = histogram("time_to_first_token_seconds", ttft_buckets, *c.HISTOGRAMS["time_to_first_token_seconds"])
        tbt_name = "time_between_tokens_seconds"
        self.tbt = batched(tbt_name, tbt_buckets, *c.HISTOGRAMS[tbt_name])
        self.worst_gap = histogram("worst_gap_seconds", gap_buckets, *c.HISTOGRAMS["worst_gap_seconds"])
        self.queue = histogram("request_queue_seconds", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", LATENCY_BUCKETS)
        self.step = batched("scheduler_step_seconds", STEP_BUCKETS, "phase")
        self.swap_seconds = batched("kv_swap_seconds", STEP_BUCKETS, "direction")
        self.rotation = batched("rotation_seconds", COPY_LATENCY_BUCKETS, "direction")
        self.copy_queue = batched("kv_copy_queue_seconds", COPY_LATENCY_BUCKETS, "direction")
        self.copy_bandwidth = batched("kv_copy_bandwidth_bytes_per_second", BANDWIDTH_BUCKETS, "direction")
        self.copy_hidden = batched("kv_copy_hidden_ratio", RATIO_BUCKETS)
        self.slo_target = gauge(c.SLO_TARGET_GAUGE, *c.SLO_TARGET_LABELS)
        for name, target in classes.items():
            self.slo_target.labels(model_name, "ttft", name).set(target.ttft_ms / 1000.0)
            self.slo_target.labels(model_name, "tbt", name).set(target.tbt_ms / 1000.0)
            self.slo_target.labels(model_name, "stall", name).set(target.stall_budget_ms / 1000.0)
        Info(c.metric("info"), "engine build and configuration", [label], registry=reg).labels(model_name).info(info)
        self._seen = SchedulerCounters()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._gauge_values: dict[tuple[str, tuple[str, ...]], float] = {}  # what each gauge was set to
        for name in classes:  # each class's stall count is exported from the start (rate() needs two samples)
            self._c("stalled_requests", name)

        self.vllm: dict[str, Gauge | Counter | Histogram] = {}
        if vllm_compat:
            vl = ["model_name"]
            self.vllm = {
                "running": Gauge("vllm:num_requests_running", "running requests", vl, registry=reg),
                "waiting": Gauge("vllm:num_requests_waiting", "waiting requests", vl, registry=reg),
                "kv": Gauge("vllm:kv_cache_usage_perc", "GPU KV cache usage (0-1)", vl, registry=reg),
                "ttft": Histogram("vllm:time_to_first_token_seconds", "TTFT", vl, buckets=ttft_buckets, registry=reg),
                "e2e": Histogram(
                    "vllm:e2e_request_latency_seconds", "end-to-end latency", vl, buckets=LATENCY_BUCKETS, registry=reg
                ),
                "prompt": Counter("vllm:prompt_tokens", "prompt tokens", vl, registry=reg),
                "generation": Counter("vllm:generation_tokens", "generated tokens", vl, registry=reg),
            }
        itl = "vllm:inter_token_latency_seconds"
        self.itl = BatchHistogram(itl, "inter-token latency", ["model_name"], tbt_buckets, reg) if vllm_compat else None

    def _child(self, family: Gauge | Counter | Histogram, *labels: str) -> Any:
        """The family's series for this model and `labels`, looked up once (labels() is slow)."""
        key = (id(family), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(self.model_name, *labels)
        return child

    def _set(self, name: str, value: float, *labels: str) -> None:
        """Set a gauge, unless it holds `value` already (each set takes a lock; most gauges keep
        their value from one step to the next)."""
        key = (name, labels)
        if self._gauge_values.get(key) != value:
            self._gauge_values[key] = value
            self._child(self.gauges[name], *labels).set(value)

    def _c(self, name: str, *labels: str) -> Counter:
        return self._child(self.counters[name], *labels)

    def _compat(self, key: str, method: str, value: float) -> None:
        if self.vllm:
            getattr(self._child(self.vllm[key]), method)(value)

    def on_step(
        self,
        sched: Scheduler,
        kv: KVCacheManager,
        copies: CopyStats,
        block_bytes: int,
        phase_seconds: dict[str, float],
        now: float,
    ) -> None:
        self.on_state(sched, kv, now)
        for phase, seconds in phase_seconds.items():
            self.step.observe((self.model_name, phase), seconds)
        counters = sched.counters
        seen = self._seen.preemption_reasons
        for (mode, reason), n in counters.preemption_reasons.items():
            if n > seen.get((mode, reason), 0):
                self._c("preemptions", mode, reason).inc(n - seen.get((mode, reason), 0))
                seen[(mode, reason)] = n
        if counters.rotations > self._seen.rotations:
            self._c("rotations").inc(counters.rotations - self._seen.rotations)
            self._seen.rotations = counters.rotations
        self.on_copies(copies, block_bytes)

    def on_copies(self, copies: CopyStats, block_bytes: int) -> None:
        """One step's copies: each direction that moved blocks, and the hidden share once per step."""
        for swap_direction, direction in (("gpu_to_cpu", "out"), ("cpu_to_gpu", "in")):
            blocks = getattr(copies, f"blocks_{direction}")
            if not blocks:
                continue
            seconds = getattr(copies, f"seconds_{direction}")
            self._c("kv_swap_bytes", swap_direction).inc(blocks * block_bytes)
            self.swap_seconds.observe((self.model_name, swap_direction), seconds)
            self.rotation.observe((self.model_name, direction), getattr(copies, f"latency_{direction}"))
            self.copy_queue.observe((self.model_name, direction), getattr(copies, f"queue_{direction}"))
            if seconds > 0:  # a span below the clock's resolution has no measurable bandwidth
                self.copy_bandwidth.observe((self.model_name, direction), blocks * block_bytes / seconds)
        if copies.hidden_ratio is not None:
            self.copy_hidden.observe((self.model_name,), copies.hidden_ratio)

    def on_state(self, sched: Scheduler, kv: KVCacheManager, now: float) -> None:
        """Set the gauges from the scheduler and block pools as they are now (after every step,
        and after anything that changes them between steps, such as an abort with the engine idle)."""
        self._set("requests_running", sched.num_running)
        self._set("requests_waiting", sched.num_waiting)
        self._set("requests_rotary", sched.num_rotary)
        lags = (slo_lag_seconds(r.arrival_time, r.t_last_token, r.slo, now) for r in (*sched.waiting, *sched.rotary))
        self._set("slo_lag_seconds", max(lags, default=0.0))
        # GPU blocks: free (empty), dirty (no CPU copy yet), clean (written through), quarantined.
        clean = min(kv.pool.num_used, sched.batch.blocks_written())
        states = {
            "gpu": {
                "free": kv.pool.num_free,
                "dirty": kv.pool.num_used - clean,
                "clean": clean,
                "quarantined": kv.pool.num_fenced,
            }
        }
        if kv.cpu is not None:
            states["cpu"] = {"free": kv.cpu.num_free, "used": kv.cpu.num_used, "quarantined": len(kv.cpu.held)}
        for tier, pool in (("gpu", kv.pool), ("cpu", kv.cpu)):
            if pool is not None:
                self._set("kv_cache_usage_ratio", pool.num_used / pool.num_blocks, tier)
                for state, n in states[tier].items():
                    self._set("kv_blocks", n, tier, state)
        self._compat("running", "set", sched.num_running)
        self._compat("waiting", "set", sched.num_waiting)
        self._compat("kv", "set", kv.usage)

    def on_tokens(self, num_tokens: int, timing: TokenTiming) -> None:
        """One update's tokens: the first of some requests (TTFT), the gaps before the others."""
        self._c("generation_tokens").inc(num_tokens)
        self._compat("generation", "inc", num_tokens)
        for req in timing.first:
            ttft = req.t_first_token - req.arrival_time
            self._child(self.ttft, req.slo_class).observe(ttft)
            self._compat("ttft", "observe", ttft)
            self._child(self.queue).observe(req.t_scheduled - req.arrival_time)
            self._c("prompt_tokens").inc(req.num_prompt_tokens)
            self._compat("prompt", "inc", req.num_prompt_tokens)
        for slo_class, gaps in timing.gaps().items():
            self.tbt.observe_all((self.model_name, slo_class), gaps)
            if self.itl is not None:
                self.itl.observe_all((self.model_name,), gaps)

    def on_finish(self, req: Request, now: float) -> None:
        """A request ended: its latency, its worst gap between tokens and its SLO verdict (TBT: the
        p99 of its token gaps within the TBT target and its worst gap within its stall budget)."""
        reason = req.finish_reason.value if req.finish_reason else "unknown"
        self._c("requests_finished", reason).inc()
        self._child(self.e2e).observe(now - req.arrival_time)
        self._compat("e2e", "observe", now - req.arrival_time)
        if req.t_first_token is None:
            return  # aborted before its first token: no latency to judge
        stall_met = self._observe_worst_gap(req)
        ttft_met = meets_ttft(req.t_first_token - req.arrival_time, req.slo)
        tbt_met = stall_met and meets_tbt(p99_gap(req.token_gaps), req.slo)
        verdict = ("met" if ttft_met else "missed", "met" if tbt_met else "missed")
        self._c("slo_requests", *verdict, req.slo_class).inc()

    def _observe_worst_gap(self, req: Request) -> bool:
        """Export a finished stream's worst gap (two or more output tokens: one has no gap) and count
        it as stalled past its stall budget; True when the budget was met."""
        if req.num_output_tokens < 2:
            return True
        worst = req.max_gap_s
        self._child(self.worst_gap, req.slo_class).observe(worst)
        if meets_stall(worst, req.slo):
            return True
        self._c("stalled_requests", req.slo_class).inc()
        return False

    def render(self) -> bytes:
        return generate_latest(self.registry)
