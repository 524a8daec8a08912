"""The four loads of the vLLM peer benchmark, as seeded request lists, and the figures each reports.

- batch1: one request at a time (closed loop): TPOT and TTFT of an unloaded server.
- saturation: every request at once with ample KV (the server's default SLO, TBT 100 ms): output
  tokens/s, and TBT attainment (what SLO-aware admission spends throughput on).
- hol: long decodes fill the KV budget, then a burst of short requests arrives (TTFT SLO 1 s,
  TBT 100 ms): the short requests' TTFT attainment, output tokens/s, rotations.
- poisson: two classes on Poisson arrivals at a rate that exhausts the KV budget: 70%
  interactive (TTFT 500 ms, TBT 100 ms), 30% batch (TTFT 10 s, TBT 500 ms: a background job that
  only has to keep streaming): per-class TTFT attainment, goodput, tokens/s, rotations per request.
- trace (only with a trace given): an Azure LLM inference trace's window replayed with its own
  arrivals (compressed by a speed-up, lengths scaled and capped), one SLO (TTFT 1 s, TBT 100 ms):
  TTFT and TBT attainment, stalls, goodput, tokens/s, rotations per request.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from superinfer.engine.slo import SLO, percentile
from superinfer.workload.arrivals import RequestClass, WorkItem, azure_trace, burst_workload, mixed_workload
from superinfer.workload.goodput import RequestTiming, summarize

HOL_SLO = SLO(ttft_ms=1000.0, tbt_ms=100.0)
INTERACTIVE = RequestClass("interactive", 0.7, SLO(ttft_ms=500.0, tbt_ms=100.0), prompt_median=48, output_median=64)
BATCH = RequestClass("batch", 0.3, SLO(ttft_ms=10_000.0, tbt_ms=500.0), prompt_median=192, output_median=256)
CLASSES = (INTERACTIVE, BATCH)
TRACE_SLO = SLO(ttft_ms=1000.0, tbt_ms=100.0)


@dataclass(frozen=True)
class TraceLoad:
    """A window of an Azure LLM inference trace, as the trace load replays it."""

    path: Path
    speedup: float = 1.0
    length_scale: float = 0.25  # the traces' prompts (median ~1000 tokens) at the tiny model's scale
    start_s: float = 0.0
    duration_s: float | None = 60.0  # trace seconds; None: to the trace's end
    max_len: int = 512  # per prompt and per output, as the Poisson load
    slo: SLO = TRACE_SLO

    def items(self) -> list[WorkItem]:
        return azure_trace(
            self.path,
            speedup=self.speedup,
            length_scale=self.length_scale,
            start_s=self.start_s,
            duration_s=self.duration_s,
            max_prompt=self.max_len,
            max_output=self.max_len,
            slo=self.slo,
            label="trace",
        )


@dataclass(frozen=True)
class LoadShape:
    """Sizes of the loads; `quick()` shrinks them for a check run."""

    batch1_requests: int = 8
    batch1_prompt: int = 64
    batch1_output: int = 128
    saturation_requests: int = 64
    saturation_prompt: tuple[int, int] = (32, 96)
    saturation_output: int = 128
    hol_long_prompt: tuple[int, int] = (160, 224)
    hol_long_output: int = 384
    hol_short: int = 40
    hol_short_output: int = 32
    poisson_rate: float = 4.0
    poisson_duration_s: float = 40.0
    poisson_max_len: int = 512  # per prompt and per output, so any request fits max_model_len
    trace: TraceLoad | None = None  # the trace load's window (it runs only with one)

    def quick(self) -> LoadShape:
        return LoadShape(
            batch1_requests=4,
            saturation_output=64,
            hol_long_output=192,
            poisson_rate=self.poisson_rate,
            poisson_duration_s=10.0,
            trace=self.trace,
        )


def fixed_items(n: int, prompt_len: tuple[int, int], output_len: int, seed: int) -> list[WorkItem]:
    """`n` requests all arriving at once, prompt lengths spread evenly over `prompt_len` (seeded order)."""
    lo, hi = prompt_len
    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    random.Random(seed).shuffle(lengths)
    return [WorkItem(0.0, p, output_len) for p in lengths]


def items(load: str, shape: LoadShape, seed: int) -> list[WorkItem]:
    if load == "batch1":
        return fixed_items(shape.batch1_requests, (shape.batch1_prompt,) * 2, shape.batch1_output, seed)
    if load == "saturation":
        return fixed_items(shape.saturation_requests, shape.saturation_prompt, shape.saturation_output, seed)
    if load == "hol":
        return burst_workload(
            HOL_SLO,
            seed=seed,
            long_requests=6,
            long_prompt_len=shape.hol_long_prompt,
            long_output=shape.hol_long_output,
            burst=shape.hol_short,
            burst_start_s=0.5,
            burst_rate=40.0,
            prompt_len=(16, 64),
            burst_output=shape.hol_short_output,
        )
    if load == "poisson":
        return mixed_workload(
            CLASSES,
            shape.poisson_rate,
            shape.poisson_duration_s,
            seed=seed,
            max_prompt=shape.poisson_max_len,
            max_output=shape.poisson_max_len,
        )
    if load == "trace":
        if shape.trace is None:
            raise ValueError("the trace load replays a trace: give one (--trace PATH)")
        return shape.trace.items()  # the trace's own arrivals and lengths: the seed only picks prompt tokens
    raise ValueError(f"unknown load {load!r}")


LOADS = ("batch1", "saturation", "hol", "poisson", "trace")
SEQUENTIAL = ("batch1",)  # sent one at a time, each after the previous one finished


# Each stream's worst gap, per class (workload.goodput.summarize): the stall a user sees.
STALL_KEYS = ("worst_gap_p50_ms", "worst_gap_p99_ms", "worst_gap_max_ms", "stalled_1s_share", "stalled_budget_share")


def ms_per_token(t: RequestTiming) -> float:
    """Milliseconds from sending the request to its last token, per output token: unlike TPOT, it
    does not fall to zero when a server sends its tokens in a few merged chunks."""
    return 1000.0 * (t.token_times[-1] - t.arrival) / len(t.token_times)


def of_label(items: Sequence[WorkItem], timings: Sequence[RequestTiming], label: str) -> list[RequestTiming]:
    return [t for it, t in zip(items, timings, strict=True) if it.label == label]


def figures(
    load: str,
    items: Sequence[WorkItem],
    timings: Sequence[RequestTiming],
    duration_s: float,
    rotations: float | None,
    preemptions: float,
) -> dict[str, float]:
    """The figures a load reports, from its timings and the server's counter deltas over the run.

    `rotations` is None for a server that has no rotary scheduler (vLLM).
    """
    every = summarize(timings, duration_s)
    out = {"output_tok_s": every["throughput_tok_s"], "preemptions": preemptions, "failed": every["failed"]}
    if load in ("batch1", "saturation"):
        out |= {
            "tpot_p50_ms": every["tpot_p50_ms"],
            "ttft_p50_ms": every["ttft_p50_ms"],
            "ms_per_token_p50": percentile([ms_per_token(t) for t in timings if t.token_times], 50),
        }
        if load == "saturation":  # what SLO-aware admission trades its throughput for
            out |= {"tbt_attainment": every["tbt_attainment"], "tbt_p99_ms": every["tbt_p99_ms"]}
    elif load == "hol":
        short = summarize(of_label(items, timings, "short"))
        out |= {
            "short_ttft_attainment": short["ttft_attainment"],
            "short_ttft_p99_ms": short["ttft_p99_ms"],
            "tbt_attainment": every["tbt_attainment"],
        }
        long = summarize(of_label(items, timings, "long"))
        out |= {f"long_{key}": long[key] for key in STALL_KEYS}
        if rotations is not None:
            out["rotations"] = rotations
    elif load == "poisson":
        for c in CLASSES:
            part = summarize(of_label(items, timings, c.label))
            out[f"{c.label}_ttft_attainment"] = part["ttft_attainment"]
            out[f"{c.label}_goodput_share"] = part["goodput_share"]
            for key in STALL_KEYS:
                out[f"{c.label}_{key}"] = part[key]
        out |= {
            "requests": every["requests"],
            "goodput_rps": every["goodput_rps"],
            "goodput_share": every["goodput_share"],
            "tbt_attainment": every["tbt_attainment"],
            "tbt_p99_attainment": every["tbt_p99_attainment"],
            "goodput_p99_share": every["goodput_p99_share"],
            "tbt_mean_attainment": every["tbt_mean_attainment"],
        }
        if rotations is not None:
            out["rotations_per_request"] = rotations / len(timings) if timings else 0.0
    elif load == "trace":
        keys = (
            "requests",
            "ttft_attainment",
            "ttft_p99_ms",
            "tbt_attainment",
            "tbt_p99_attainment",
            "worst_gap_p99_ms",
            "stalled_1s_share",
            "goodput_share",
            "goodput_rps",
        )
        out |= {k: every[k] for k in keys}
        if rotations is not None:
            out["rotations_per_request"] = rotations / len(timings) if timings else 0.0
    else:
        raise ValueError(f"unknown load {load!r}")
    return out
