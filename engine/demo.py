"""`superinfer demo`: serve the built-in tiny model and measure a burst of streaming requests."""

from __future__ import annotations

import random

from rich.console import Console
from rich.table import Table

from superinfer.engine.config import EngineConfig
from superinfer.engine.loadgen import LoadRequest, run_load
from superinfer.engine.server import start_server
from superinfer.engine.slo import SLO, summarize

TOPICS = ("the ocean", "a mountain village", "trains at night", "a small robot", "winter markets",
          "the history of tea", "a lighthouse keeper", "bees in spring")


def demo_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Write a short story about {rng.choice(TOPICS)}. " * rng.randint(1, 6) for _ in range(n)]


async def run_demo(config: EngineConfig, num_requests: int, output_tokens: int) -> dict[str, float]:
    console = Console()
    console.print(f"[bold]SuperInfer demo[/bold]: model {config.model!r}, policy {config.policy}, "
                  f"{num_requests} concurrent streaming requests of {output_tokens} tokens")
    running = await start_server(config)
    try:
        slo = SLO(config.ttft_slo_ms, config.tbt_slo_ms)
        core = running.server.core
        console.print(f"engine on {core.device} ({str(core.dtype).split('.')[-1]}), "
                      f"{core.kv.num_blocks} KV blocks of {core.kv.block_size} tokens, serving at {running.url}")
        await run_load(running.url, config.model_name, [LoadRequest("warm up", 4, slo)])
        load = [LoadRequest(p, output_tokens, slo) for p in demo_prompts(num_requests)]
        timings, duration = await run_load(running.url, config.model_name, load)
    finally:
        await running.close()
    report = summarize(timings, duration)
    table = Table(title=f"{num_requests} requests, SLO: TTFT ≤ {slo.ttft_ms:.0f} ms, TBT ≤ {slo.tbt_ms:.0f} ms")
    table.add_column("metric")
    table.add_column("p50", justify="right")
    table.add_column("p90", justify="right")
    table.add_column("p99", justify="right")
    for name, key in (("TTFT (ms)", "ttft"), ("TBT per token (ms)", "tbt"), ("TPOT per request (ms)", "tpot")):
        table.add_row(name, *(f"{report[f'{key}_p{q}_ms']:.1f}" for q in (50, 90, 99)))
    console.print(table)
    console.print(f"throughput {report['throughput_tok_s']:.0f} output tokens/s over {duration:.2f} s; "
                  f"SLO attainment: TTFT {report['ttft_attainment']:.0%}, TBT {report['tbt_attainment']:.0%}")
    return report
