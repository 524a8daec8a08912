"""host_time: the engine's host work per decode step with many live requests, the model step apart.

The real engine (tiny model, CPU, async scheduling) decoding B requests at once; each step's wall
time split into `schedule` (Scheduler.schedule), `update` (Scheduler.update: tokens applied) and
`outputs` (the rest of EngineCore.complete: metrics and the per-request outputs; text decoding
happens in the server's process by default, `--detokenize` puts it here). The model step itself
(`submit` on the CPU) is reported for scale, and inside it the runner's host work: `inputs` (the
step's inputs gathered from the plan) and `attention` (the attention backend's per-step metadata,
built once for all layers). Medians over `--steps` steps per batch.

    python -m bench.host_time [--batches 256,1024] [--steps 20] [--detokenize] [--tag T]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.worker import runner as runner_module
from superinfer.workload.record import write_result

PROMPT_TOKENS = 32


def timed(seconds: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    return wrapper


def measure(batch: int, steps: int, detokenize: bool, sampling: SamplingParams | None = None) -> dict[str, float]:
    """Median milliseconds per decode step of `batch` requests (greedy unless `sampling` says
    otherwise), per part of the step."""
    params = replace(sampling or SamplingParams(temperature=0), max_tokens=steps + 8, ignore_eos=True)
    core = EngineCore(
        EngineConfig(
            model="tiny",
            device="cpu",
            torch_threads=1,
            engine_process=False,
            num_gpu_blocks=batch * 8,
            max_num_seqs=batch,
            max_num_batched_tokens=max(8192, batch),
        )
    )
    core.detokenize = detokenize
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(1000) for _ in range(PROMPT_TOKENS)]
        core.add_request(f"r{i}", prompt, params)
    core.async_scheduling = False
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()  # prefill, not timed
    core.async_scheduling = True
    parts: dict[str, list[float]] = defaultdict(list)
    core.scheduler.schedule = timed(parts["schedule"], core.scheduler.schedule)
    core.scheduler.update = timed(parts["update"], core.scheduler.update)
    core.complete = timed(parts["complete"], core.complete)
    core.runner.submit = timed(parts["model"], core.runner.submit)
    core.runner.attention = timed(parts["attention"], core.runner.attention)
    gather_inputs = runner_module._gather_inputs
    runner_module._gather_inputs = timed(parts["inputs"], gather_inputs)
    try:
        for _ in range(3):  # warm up the async pipeline
            core.step()
        for seconds in parts.values():
            seconds.clear()
        for _ in range(steps):
            core.step()
    finally:
        runner_module._gather_inputs = gather_inputs
    median = {name: 1000 * statistics.median(seconds) for name, seconds in parts.items()}
    median["outputs"] = median.pop("complete") - median["update"]
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="256,1024")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--detokenize", action="store_true", help="decode text in the engine (thread mode)")
    parser.add_argument("--tag", default="", help="names a variant run's results file (host_time-TAG-cpu-DATE.json)")
    args = parser.parse_args()
    figures = {}
    for batch in (int(b) for b in args.batches.split(",")):
        f = figures[f"b{batch}_ms"] = measure(batch, args.steps, args.detokenize)
        print(
            f"B={batch:5d}  schedule {f['schedule']:6.2f}  update {f['update']:6.2f}  outputs {f['outputs']:6.2f}"
            f"  (model step {f['model']:7.1f}, of which inputs {f['inputs']:5.2f}, attention {f['attention']:5.2f}) ms",
            flush=True,
        )
    goal = {"schedule_plus_update_ms_at_1024": "<= 0.5 (issue 17's scheduler goal, bench.sched)"}
    print(f"wrote {write_result('host_time', 'cpu', figures, goal, tag=args.tag)}")


if __name__ == "__main__":
    main()
