"""Transfer figures of a run for the bench JSON, from each step's `CopyStats` (`StepOutput.copies`).

The same quantities as the engine's /metrics families rotation_seconds, kv_copy_queue_seconds,
kv_copy_bandwidth_bytes_per_second and kv_copy_hidden_ratio, but exact (no histogram buckets).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from superinfer.engine.slo import percentile

if TYPE_CHECKING:
    from superinfer.engine.worker.duplex import CopyStats

DIRECTIONS = ("out", "in")  # out: GPU -> CPU, in: CPU -> GPU


def summarize_copies(stats: Sequence[CopyStats], block_bytes: int) -> dict[str, float]:
    """Per direction, over the steps that moved blocks that way (NaN where none did):
    `rotation_{d}_p50_ms`/`_p99_ms` (submission to blocks resident), `copy_bandwidth_{d}_p50_gb_s`
    (bytes over the copy's own span), `copy_queue_{d}_p99_ms` (submission to copy start),
    `copy_bytes_{d}` and `copy_steps_{d}`. Overall: `copy_hidden_ratio`, the share of all copy
    time that ran under compute (NaN without copy time; 0 for serial copies and on CPU)."""
    out: dict[str, float] = {}
    for d in DIRECTIONS:
        moved = [s for s in stats if getattr(s, f"blocks_{d}")]
        latency_ms = [getattr(s, f"latency_{d}") * 1000.0 for s in moved]
        queue_ms = [getattr(s, f"queue_{d}") * 1000.0 for s in moved]
        gb_s = [
            getattr(s, f"blocks_{d}") * block_bytes / getattr(s, f"seconds_{d}") / 1e9
            for s in moved
            if getattr(s, f"seconds_{d}") > 0  # a span below the clock's resolution has no bandwidth
        ]
        out[f"rotation_{d}_p50_ms"] = percentile(latency_ms, 50)
        out[f"rotation_{d}_p99_ms"] = percentile(latency_ms, 99)
        out[f"copy_bandwidth_{d}_p50_gb_s"] = percentile(gb_s, 50)
        out[f"copy_queue_{d}_p99_ms"] = percentile(queue_ms, 99)
        out[f"copy_bytes_{d}"] = float(sum(getattr(s, f"blocks_{d}") for s in moved) * block_bytes)
        out[f"copy_steps_{d}"] = float(len(moved))
    copy_seconds = sum(s.copy_seconds for s in stats)
    out["copy_hidden_ratio"] = sum(s.hidden_seconds for s in stats) / copy_seconds if copy_seconds > 0 else math.nan
    return out
