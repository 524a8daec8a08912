"""`superinfer demo`: the built-in tiny model, a small KV budget and a bursty open-loop load,
served twice over HTTP (fcfs, then rotary), with SLO attainment side by side and a plot."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from superinfer.bench.vllm_peer import counters
from superinfer.engine.config import EngineConfig
from superinfer.engine.serving.server import start_server
from superinfer.engine.slo import SLO
from superinfer.workload.arrivals import WorkItem, burst_workload, prompt_tokens
from superinfer.workload.goodput import RequestTiming, summarize
from superinfer.workload.loadgen import LoadRequest, run_load

ROWS = (
    ("TTFT attainment", "ttft_attainment", "{:.0%}"),
    ("TBT attainment (p99 gap, stalls)", "tbt_attainment", "{:.0%}"),
    ("goodput (both SLOs)", "goodput_share", "{:.0%}"),
    ("goodput (req/s)", "goodput_rps", "{:.2f}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
    ("TBT p50 (ms)", "tbt_p50_ms", "{:.1f}"),
    ("TBT p99 (ms)", "tbt_p99_ms", "{:.1f}"),
    ("TPOT p99 (ms)", "tpot_p99_ms", "{:.1f}"),
    ("worst gap p50 (ms)", "worst_gap_p50_ms", "{:.0f}"),
    ("worst gap max (ms)", "worst_gap_max_ms", "{:.0f}"),
    ("streams stalled > 1 s", "stalled_1s_share", "{:.0%}"),
    ("throughput (tok/s)", "throughput_tok_s", "{:.0f}"),
    ("rotations", "rotations", "{:.0f}"),
    ("rotations per request", "rotations_per_request", "{:.1f}"),
    ("recompute preemptions", "recomputes", "{:.0f}"),
)


async def run_policy(config: EngineConfig, items: list[WorkItem]) -> tuple[dict[str, float], list[RequestTiming]]:
    running = await start_server(config)
    try:
        core = running.server.core
        prompts = prompt_tokens(items, core.model_config.vocab_size)
        await run_load(running.url, config.model_name, [LoadRequest([5, 6, 7], 2)])  # warm up
        load = [LoadRequest(p, it.output_len, it.slo, it.arrival_s) for p, it in zip(prompts, items, strict=True)]
        timings, duration = await run_load(running.url, config.model_name, load)
        report = summarize(timings, duration)
        async with aiohttp.ClientSession() as http:  # the engine may run in another process: ask /metrics
            served = await counters(http, running.url, vllm=False)
        report["recomputes"], report["rotations"] = served.preemptions, served.rotations or 0.0
        report["rotations_per_request"] = report["rotations"] / max(1.0, report["requests"])
        return report, timings
    finally:
        await running.close()


def plot(results: dict[str, tuple[dict[str, float], list[RequestTiming]]], slo: SLO, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tbt) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, (_, timings) in results.items():
        start = min(t.arrival for t in timings)
        ax_ttft.scatter([t.arrival - start for t in timings], [t.ttft * 1000 for t in timings], label=policy, s=14)
        tpots = sorted(t.tpot * 1000 for t in timings if t.tpot is not None)
        ax_tbt.plot(tpots, [(i + 1) / len(tpots) for i in range(len(tpots))], label=policy)
    ax_ttft.axhline(slo.ttft_ms, color="red", linestyle="--", label="TTFT SLO")
    ax_ttft.set(xlabel="arrival (s)", ylabel="TTFT (ms)", title="time to first token per request")
    ax_tbt.axvline(slo.tbt_ms, color="red", linestyle="--", label="TBT SLO")
    ax_tbt.set(xlabel="mean time between tokens (ms)", ylabel="share of requests", title="TPOT distribution")
    for ax in (ax_ttft, ax_tbt):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run_demo(config: EngineConfig, policies: list[str], plot_path: Path | None) -> dict[str, dict[str, float]]:
    console = Console()
    slo = config.default_slo
    # Long prompts fill KV memory at once and their decodes hold it for seconds on any machine.
    items = burst_workload(slo, long_output=768, long_prompt_len=(160, 224))
    console.print(
        f"[bold]SuperInfer demo[/bold]: model {config.model!r} with {config.num_gpu_blocks} KV blocks of "
        f"{config.block_size} tokens; long decodes fill them, then a burst arrives ({len(items)} requests); "
        f"SLO: TTFT ≤ {slo.ttft_ms:.0f} ms, TBT ≤ {slo.tbt_ms:.0f} ms"
    )
    results = {}
    for policy in policies:
        console.print(f"serving with --policy {policy} ...")
        results[policy] = await run_policy(config.model_copy(update={"policy": policy}), items)
    table = Table(title="the same load, served by each policy")
    table.add_column("")
    for policy in policies:
        table.add_column(policy, justify="right")
    for label, key, fmt in ROWS:
        table.add_row(label, *(fmt.format(results[p][0][key]) for p in policies))
    console.print(table)
    if plot_path is not None:
        plot(results, slo, plot_path)
        console.print(f"plot saved to {plot_path}")
    return {p: r for p, (r, _) in results.items()}
