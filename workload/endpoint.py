"""`superinfer bench`: the paper's open-loop protocol against any OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import json

import aiohttp
from rich.console import Console
from rich.table import Table

from superinfer.engine.contract import MODELS_PATH
from superinfer.engine.slo import SLO
from superinfer.workload.arrivals import poisson_workload
from superinfer.workload.loadgen import bench_endpoint


async def served_model(base_url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(base_url + MODELS_PATH) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run_bench(args: argparse.Namespace) -> dict[str, float]:
    base_url = args.url.rstrip("/")
    model = args.served_model or await served_model(base_url)
    slo = SLO(args.ttft_slo_ms, args.tbt_slo_ms, args.stall_slo_ms)
    items = poisson_workload(
        args.rate,
        args.duration,
        slo,
        seed=args.seed,
        prompt_median=args.prompt_median,
        output_median=args.output_median,
    )
    console = Console()
    console.print(f"{len(items)} requests to {base_url} ({model}) at {args.rate} req/s over {args.duration:.0f} s")
    report = await bench_endpoint(base_url, model, items)
    table = Table(
        title=f"SLO: TTFT ≤ {slo.ttft_ms:.0f} ms, TBT ≤ {slo.tbt_ms:.0f} ms (p99 gap), worst gap ≤ "
        f"{slo.stall_budget_ms:.0f} ms"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        table.add_row(key, f"{value:.3f}" if "attainment" in key or "share" in key else f"{value:.2f}")
    console.print(table)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"url": base_url, "model": model, "rate": args.rate, "duration_s": args.duration, "report": report},
                indent=2,
            )
        )
    return report
