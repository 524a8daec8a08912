"""The contract between the engine and everything that runs or watches it.

The operator, the Helm chart's dashboards and the benchmarks depend on these names only, never
on the engine itself. This module imports nothing heavy (no torch) so anyone may import it.
"""

from __future__ import annotations

DEFAULT_PORT = 8000

# HTTP endpoints.
COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"  # the process is alive
READY_PATH = "/ready"  # the model is loaded and the server is not draining
METRICS_PATH = "/metrics"

# Per-request SLOs: a body field {"slo": {"ttft_ms": .., "tbt_ms": .., "stall_ms": ..}} or these headers.
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TBT_HEADER = "x-slo-tbt-ms"
SLO_STALL_HEADER = "x-slo-stall-ms"  # the stall budget (see DEFAULT_STALL_FACTOR)

# Named SLO classes: a request picks one with {"slo_class": "interactive"} or this header; its
# targets and priority are the class's unless the request overrides them. Requests that pick none
# belong to DEFAULT_SLO_CLASS (the server's --ttft-slo-ms/--tbt-slo-ms, priority 0).
SLO_CLASS_HEADER = "x-slo-class"
SLO_CLASS_LABEL = "slo_class"
DEFAULT_SLO_CLASS = "default"
SLO_CLASS_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,62}$"  # lowercase identifiers; `default` is reserved
# The classes a server has without --slo-classes (given classes replace them).
BUILTIN_SLO_CLASSES = {
    "interactive": {"ttft_ms": 500.0, "tbt_ms": 100.0, "priority": 1},
    "batch": {"ttft_ms": 30000.0, "tbt_ms": 1000.0, "priority": 0},
}

# Server-wide SLO defaults (the paper's: 5 s time to first token, 100 ms between tokens).
DEFAULT_TTFT_SLO_MS = 5000.0
DEFAULT_TBT_SLO_MS = 100.0
# A started stream's stall budget: the longest gap between two of its tokens that still meets its
# TBT SLO (with its p99 gap within the TBT target), unless its SLO or class sets one: this many
# times its TBT target. A stream that stops for longer is what a user sees as a hung server.
DEFAULT_STALL_FACTOR = 5.0
MAX_SLO_MS = 1e12  # ~30 years, "no SLO" in practice: targets must be finite (the TBT guard divides by them)
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # a request's priority: 32 bits (the ranking's columns)

POLICIES = ("fcfs", "rotary", "watermark")

# Every flag of `superinfer serve` (a test keeps this equal to the parser): the operator checks
# engine.args against it without importing the engine.
SERVE_FLAGS = (
    "--model",
    "--revision",
    "--download-dir",
    "--offline",
    "--no-offline",
    "--served-model-name",
    "--dtype",
    "--device",
    "--dummy-weights",
    "--no-dummy-weights",
    "--seed",
    "--torch-threads",
    "--engine-process",
    "--no-engine-process",
    "--tensor-parallel-size",
    "-tp",
    "--block-size",
    "--gpu-memory-utilization",
    "--num-gpu-blocks",
    "--cpu-kv-gib",
    "--num-cpu-blocks",
    "--kv-cache-gib-cpu-device",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--duplex",
    "--kv-copy-method",
    "--write-through",
    "--no-write-through",
    "--cpu-linear",
    "--attention-backend",
    "--enforce-eager",
    "--no-enforce-eager",
    "--piecewise-graphs",
    "--no-piecewise-graphs",
    "--policy",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--ttft-slo-ms",
    "--tbt-slo-ms",
    "--stall-slo-ms",
    "--slo-classes",
    "--rotary-alpha",
    "--rotary-beta-f",
    "--rotary-beta-b",
    "--transfer-budget-blocks",
    "--rotary-min-residency-ms",
    "--slo-admission",
    "--no-slo-admission",
    "--async-scheduling",
    "--no-async-scheduling",
    "--max-waiting-requests",
    "--host",
    "--port",
    "--api-key",
    "--tool-call-parser",
    "--metrics-compat",
    "--max-request-bytes",
    "--shutdown-timeout-s",
)

# Environment variable read by `superinfer serve` when --api-key is not given.
API_KEY_ENV = "SUPERINFER_API_KEY"

# Prometheus metric families exported by the engine (prefix + name; every one carries the
# label `model_name`, then the labels listed). Counters are exposed with a `_total` suffix, histograms with
# `_bucket`/`_sum`/`_count`.
METRIC_PREFIX = "superinfer_engine_"

GAUGES = {
    "requests_running": (),
    "requests_waiting": (),
    "requests_rotary": (),
    # The largest lag behind an SLO among requests that are not running (waiting or rotated out):
    # a routing signal (an endpoint picker can avoid the replica that is furthest behind).
    "slo_lag_seconds": (),
    "kv_cache_usage_ratio": ("tier",),
    "kv_blocks": ("tier", "state"),
}
COUNTERS = {
    "kv_swap_bytes": ("direction",),
    "rotations": (),
    # mode="swap" (rotated to the CPU tier), reason="policy" | "gpu_full" (out of GPU blocks);
    # mode="recompute", reason="gpu_full" | "cpu_full" (the CPU tier had no room) | "transfer_budget".
    "preemptions": ("mode", "reason"),
    "prompt_tokens": (),
    "generation_tokens": (),
    "requests_finished": ("finished_reason",),
    "slo_requests": ("ttft", "tbt", SLO_CLASS_LABEL),
    # Finished requests with two or more output tokens whose worst gap exceeded their stall budget.
    "stalled_requests": (SLO_CLASS_LABEL,),
}
HISTOGRAMS = {
    "kv_swap_seconds": ("direction",),
    # Per step's copy in a direction, direction="out" (GPU -> CPU) | "in" (CPU -> GPU); observed only
    # when blocks moved that way. rotation_seconds: from the step's submission (just after the decision
    # to rotate) to the blocks resident in the other tier; queue: submission to the copy's start on its
    # stream; bandwidth: bytes over the copy's own span.
    "rotation_seconds": ("direction",),
    "kv_copy_queue_seconds": ("direction",),
    "kv_copy_bandwidth_bytes_per_second": ("direction",),
    # Per step with copies: the share of the copies' time that ran under compute (0 when serial, on CPU).
    "kv_copy_hidden_ratio": (),
    "time_to_first_token_seconds": (SLO_CLASS_LABEL,),
    "time_between_tokens_seconds": (SLO_CLASS_LABEL,),
    # Each finished request's longest gap between two of its tokens (two or more output tokens);
    # every class's stall budget is a bucket bound.
    "worst_gap_seconds": (SLO_CLASS_LABEL,),
    "request_queue_seconds": (),
    "e2e_request_latency_seconds": (),
    "scheduler_step_seconds": ("phase",),
}
INFOS = {"info": ()}
SLO_TARGET_GAUGE = "slo_target_seconds"  # one series per SLO class and kind (ttft | tbt | stall)
SLO_TARGET_LABELS = ("kind", SLO_CLASS_LABEL)

# With --metrics-compat vllm the engine also exports these vLLM names.
VLLM_COMPAT_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


def metric(name: str) -> str:
    """Full exported name of an engine metric family, e.g. metric('rotations') + '_total'."""
    return METRIC_PREFIX + name


def exported_series_names() -> set[str]:
    """Every series name a scrape of the engine's /metrics can contain (without labels)."""
    names: set[str] = set()
    for base in (*GAUGES, SLO_TARGET_GAUGE):
        names.add(metric(base))
    for base in COUNTERS:
        names |= {metric(base) + "_total", metric(base) + "_created"}
    for base in HISTOGRAMS:
        names |= {metric(base) + suffix for suffix in ("_bucket", "_sum", "_count", "_created")}
    names.add(metric("info") + "_info")
    for compat in VLLM_COMPAT_METRICS:
        names.add(compat)
        if compat.endswith("_total"):
            names.add(compat.removesuffix("_total") + "_created")
        if compat.endswith("_seconds"):
            names |= {compat + suffix for suffix in ("_bucket", "_sum", "_count", "_created")}
    return names
