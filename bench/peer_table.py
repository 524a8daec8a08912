"""The side-by-side table of the vLLM peer benchmark: the median of the runs with their spread.

`results[contender][load][figure]` is the list of that figure over the runs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from rich.table import Table

Results = dict[str, dict[str, dict[str, list[float]]]]

# (load, figure, label, format of one value)
ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("batch1", "tpot_p50_ms", "batch 1: TPOT p50 (ms)", "{:.2f}"),
    ("batch1", "ms_per_token_p50", "batch 1: latency per token p50 (ms)", "{:.2f}"),
    ("batch1", "ttft_p50_ms", "batch 1: TTFT p50 (ms)", "{:.1f}"),
    ("saturation", "output_tok_s", "saturation: output tok/s", "{:.0f}"),
    ("saturation", "tpot_p50_ms", "saturation: TPOT p50 (ms)", "{:.1f}"),
    ("saturation", "ttft_p50_ms", "saturation: TTFT p50 (ms)", "{:.0f}"),
    ("saturation", "tbt_attainment", "saturation: TBT attainment (p99 gap, 100 ms)", "{:.0%}"),
    ("saturation", "tbt_p99_ms", "saturation: gap between tokens p99 (ms)", "{:.0f}"),
    ("saturation", "engine_steps", "saturation: engine steps", "{:.0f}"),
    ("saturation", "cpu_cores", "saturation: CPU cores, server and its children", "{:.2f}"),
    ("saturation", "server_cpu_cores", "saturation: CPU cores, the server's own process", "{:.2f}"),
    ("hol", "short_ttft_attainment", "HOL burst: short TTFT attainment", "{:.0%}"),
    ("hol", "short_ttft_p99_ms", "HOL burst: short TTFT p99 (ms)", "{:.0f}"),
    ("hol", "output_tok_s", "HOL burst: output tok/s", "{:.0f}"),
    ("hol", "long_worst_gap_max_ms", "HOL burst: long streams' worst gap, max (ms)", "{:.0f}"),
    ("hol", "rotations", "HOL burst: rotations", "{:.0f}"),
    ("hol", "preemptions", "HOL burst: recompute preemptions", "{:.0f}"),
    ("poisson", "interactive_ttft_attainment", "two-class: interactive TTFT attainment", "{:.0%}"),
    ("poisson", "batch_ttft_attainment", "two-class: batch TTFT attainment", "{:.0%}"),
    ("poisson", "goodput_rps", "two-class: goodput (req/s)", "{:.2f}"),
    ("poisson", "goodput_share", "two-class: goodput share (stall-aware)", "{:.0%}"),
    ("poisson", "goodput_p99_share", "two-class: goodput share (p99 gap only)", "{:.0%}"),
    ("poisson", "tbt_attainment", "two-class: TBT attainment (p99 gap and stall budget)", "{:.0%}"),
    ("poisson", "batch_worst_gap_p50_ms", "two-class: batch streams' worst gap p50 (ms)", "{:.0f}"),
    ("poisson", "batch_worst_gap_p99_ms", "two-class: batch streams' worst gap p99 (ms)", "{:.0f}"),
    ("poisson", "batch_stalled_1s_share", "two-class: batch streams stalled > 1 s", "{:.0%}"),
    ("poisson", "interactive_worst_gap_p99_ms", "two-class: interactive streams' worst gap p99 (ms)", "{:.0f}"),
    ("poisson", "output_tok_s", "two-class: output tok/s", "{:.0f}"),
    ("poisson", "rotations_per_request", "two-class: rotations per request", "{:.1f}"),
    ("poisson", "preemptions", "two-class: recompute preemptions", "{:.0f}"),
    ("poisson", "cpu_cores", "two-class: CPU cores, server and its children", "{:.2f}"),
)


def spread(values: Sequence[float]) -> dict[str, float | list[float]]:
    """min / median / max over the runs (NaN runs left out of the statistics, kept in `runs`)."""
    real = [v for v in values if not math.isnan(v)]
    if not real:
        return {"min": math.nan, "median": math.nan, "max": math.nan, "runs": list(values)}
    return {"min": min(real), "median": statistics.median(real), "max": max(real), "runs": list(values)}


def cell(values: Sequence[float] | None, fmt: str) -> str:
    """`median` alone for one run or no spread, else `median (min–max)`; `–` when not measured."""
    if not values:
        return "–"
    s = spread(values)
    if math.isnan(s["median"]):
        return "n/a"
    median = fmt.format(s["median"])
    if len(values) == 1 or s["min"] == s["max"]:
        return median
    lo, hi = fmt.format(s["min"]), fmt.format(s["max"])
    return f"{median} ({lo.rstrip('%')}–{hi})"


def rows(results: Results, contenders: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Table rows (label, one cell per contender) for the loads that were run."""
    loads = {load for c in contenders for load in results.get(c, {})}
    return [
        (label, [cell(results.get(c, {}).get(load, {}).get(key), fmt) for c in contenders])
        for load, key, label, fmt in ROWS
        if load in loads
    ]


def rich_table(results: Results, contenders: Sequence[str], title: str) -> Table:
    table = Table(title=title)
    table.add_column("")
    for c in contenders:
        table.add_column(c, justify="right")
    for label, cells in rows(results, contenders):
        table.add_row(label, *cells)
    return table


def markdown(results: Results, contenders: Sequence[str]) -> str:
    lines = ["| | " + " | ".join(f"`{c}`" for c in contenders) + " |", "|---" * (len(contenders) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows(results, contenders)]
    return "\n".join(lines)


def spreads(results: Results) -> dict[str, dict[str, dict[str, dict[str, float | list[float]]]]]:
    """Every figure's spread, for the JSON record."""
    return {
        c: {load: {key: spread(v) for key, v in figs.items()} for load, figs in loads.items()}
        for c, loads in results.items()
    }


# Headline comparisons with vLLM: (load, figure, how): "ratio" of medians, or "points" of attainment.
HEADLINES = (
    ("batch1", "ms_per_token_p50", "ratio"),
    ("saturation", "output_tok_s", "ratio"),
    ("hol", "short_ttft_attainment", "points"),
    ("poisson", "interactive_ttft_attainment", "points"),
    ("poisson", "goodput_rps", "ratio"),
    ("poisson", "output_tok_s", "ratio"),
)


def versus_vllm(results: Results, contenders: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each of our contenders against `vllm@T` at its own thread count T (when that was run)."""
    out: dict[str, dict[str, float]] = {}
    for name in contenders:
        policy, _, threads = name.partition("@")
        peer = results.get(f"vllm@{threads.partition('+')[0]}")  # fcfs@1+proc against vllm@1
        if policy == "vllm" or peer is None or name not in results:
            continue
        for load, key, how in HEADLINES:
            ours, theirs = results[name].get(load, {}).get(key), peer.get(load, {}).get(key)
            if not ours or not theirs:
                continue
            a, b = spread(ours)["median"], spread(theirs)["median"]
            if how == "points":
                out.setdefault(name, {})[f"{load}_{key}_points"] = 100.0 * (a - b)
            elif b:
                out.setdefault(name, {})[f"{load}_{key}_ratio"] = a / b
    return out
