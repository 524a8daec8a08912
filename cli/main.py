"""`superinfer serve | download | bench | simulate | demo`: the one command line over the engine,
the simulator and the benchmarks (which is why it lives apart from all three)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from superinfer.engine.config import EngineConfig
from superinfer.engine.download import ModelDownloadError
from superinfer.engine.flags import add_engine_flags, engine_config
from superinfer.sim.cli import add_simulate_flags

# The demo's scenario: a KV budget small enough that long decodes exhaust it (any flag overrides).
DEMO_DEFAULTS = {
    "port": 0,
    "max_model_len": 1024,
    "block_size": 32,
    "num_gpu_blocks": 48,
    "num_cpu_blocks": 2000,
    "ttft_slo_ms": 1000.0,
    "tbt_slo_ms": 100.0,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="superinfer", description="SLO-aware LLM serving")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    add_engine_flags(serve)
    download = sub.add_parser(
        "download",
        help="download a Hugging Face model (config, tokenizer, safetensors) into the HF cache; print its folder",
    )
    download.add_argument("--model", required=True, help="org/name or hf://org/name[@revision]")
    for flag in ("revision", "download_dir"):  # as `serve` reads them
        download.add_argument("--" + flag.replace("_", "-"), help=EngineConfig.model_fields[flag].description)
    bench = sub.add_parser("bench", help="open-loop SLO benchmark of any OpenAI-compatible endpoint")
    bench.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    bench.add_argument("--served-model", default=None, help="model name to send (default: the first of /v1/models)")
    bench.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    bench.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    bench.add_argument("--ttft-slo-ms", type=float, default=5000.0)
    bench.add_argument("--tbt-slo-ms", type=float, default=100.0)
    bench.add_argument(
        "--stall-slo-ms", type=float, default=None, help="stall budget per stream (default 5x --tbt-slo-ms)"
    )
    bench.add_argument("--prompt-median", type=float, default=150.0, help="median prompt length (tokens)")
    bench.add_argument("--output-median", type=float, default=200.0, help="median output length (tokens)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", type=Path, default=None, help="also write the report here")
    simulate = sub.add_parser(
        "simulate",
        help="the SLO benchmark on a simulated replica (real scheduler, cost-modelled device): sweeps, capacity",
    )
    add_simulate_flags(simulate)
    demo = sub.add_parser("demo", help="fcfs vs rotary on the tiny model under a burst that exhausts KV memory")
    add_engine_flags(demo)
    demo.add_argument("--policies", default="fcfs,rotary", help="comma-separated policies to compare")
    demo.add_argument("--plot", type=Path, default=Path("superinfer-demo.png"), help="where to save the plot")
    demo.add_argument("--no-plot", dest="plot", action="store_const", const=None, help="do not plot")
    for command in (parser, *sub.choices.values()):  # a prefix of a flag added later would change meaning
        command.allow_abbrev = False
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "DEBUG":  # the Hugging Face Hub's HTTP client logs every request at INFO
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        if args.command == "serve":
            from superinfer.engine.engine import EngineDeadError
            from superinfer.engine.serving.server import serve

            try:
                asyncio.run(serve(engine_config(args)))
            except EngineDeadError as exc:
                print(f"superinfer: {exc}", file=sys.stderr)
                return 1
        elif args.command == "download":
            from superinfer.engine.download import hub_ref, model_snapshot

            print(model_snapshot(hub_ref(args.model, args.revision), cache_dir=args.download_dir))
        elif args.command == "bench":
            from superinfer.workload.endpoint import run_bench

            asyncio.run(run_bench(args))
        elif args.command == "simulate":
            from superinfer.sim.cli import run_simulate

            run_simulate(args)
        elif args.command == "demo":
            from superinfer.bench.demo import run_demo

            config = engine_config(args, **DEMO_DEFAULTS)
            asyncio.run(run_demo(config, args.policies.split(","), args.plot))
    except ValidationError as exc:
        print(f"superinfer: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"superinfer: {exc}", file=sys.stderr)
        return 2
    except ModelDownloadError as exc:
        print(f"superinfer: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
