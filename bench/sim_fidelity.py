"""sim fidelity: calibrate the simulator on the CPU engine, then predict that engine on the same trace.

1. The real engine (tiny model, CPU, wall clock) serves a Poisson load; its own step-time model
   (fixed + per token + per thousand context tokens, here fitted over every step of the run), the
   spread of the measured step times around that fit, its measured copy time per block and the
   median time between one step's end and the next one's plan (the simulator's host time) become
   the calibration.
2. The simulator runs the same requests with that calibration, the same KV sizes and limits,
   with the spread and without it (the fit alone).
3. p50/p90 TTFT and TBT, simulated against measured (goal: within 15%), and rotations and
   preemptions by reason.

    python -m bench.sim_fidelity [--rate 6 --duration 30 --policy rotary] [--async-scheduling]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.step_time import StepShape, StepTimeModel
from superinfer.engine.engine import EngineCore
from superinfer.engine.model.tiny import ensure_tiny_model
from superinfer.engine.slo import SLO
from superinfer.engine.worker.duplex import CopyStats
from superinfer.sim.config import SimConfig
from superinfer.sim.report import point_report
from superinfer.sim.simulator import simulate
from superinfer.sim.step_cost import fit_calibration
from superinfer.workload.arrivals import poisson_workload, prompt_tokens
from superinfer.workload.goodput import summarize
from superinfer.workload.record import write_result
from superinfer.workload.replay import replay

KEYS = ("ttft_p50_ms", "ttft_p90_ms", "tbt_p50_ms", "tbt_p90_ms")


class RecordedStepTimes(StepTimeModel):
    """The engine's step-time model fitted over the whole run, keeping every step it saw and
    when it ended (the engine's clock)."""

    def __init__(self) -> None:
        super().__init__(decay=1.0)
        self.seen: list[tuple[StepShape, float]] = []
        self.ends: list[float] = []

    def observe(self, shape: StepShape, seconds: float) -> None:
        super().observe(shape, seconds)
        self.seen.append((shape, seconds))
        self.ends.append(time.monotonic())

    def host_seconds(self) -> float:
        """The median wall time from one step's end to the next one's plan: the engine's work
        between steps (its outputs, new requests), which the steps' times leave out (the median:
        the run's idle waits for arrivals are the longest gaps)."""
        gaps = [
            start - end
            for end, (_, seconds), t in zip(self.ends, self.seen[1:], self.ends[1:], strict=False)
            if (start := t - seconds) >= end
        ]
        return statistics.median(gaps) if gaps else 0.0


def calibration(steps: RecordedStepTimes, copies: list[CopyStats]) -> dict:
    def per_block(d: str) -> float:
        blocks = sum(getattr(c, f"blocks_{d}") for c in copies)
        return sum(getattr(c, f"seconds_{d}") for c in copies) / blocks if blocks else 0.0

    return fit_calibration(steps.seen, per_block("out"), per_block("in"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=6.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--policy", default="rotary")
    parser.add_argument("--num-gpu-blocks", type=int, default=64)
    parser.add_argument("--num-cpu-blocks", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, help="default: off on CPU")
    args = parser.parse_args()
    slo = SLO(5000.0, 100.0)
    items = poisson_workload(
        args.rate,
        args.duration,
        slo,
        seed=args.seed,
        prompt_median=40,
        output_median=60,
        max_prompt=256,
        max_output=512,
    )
    limits = {"num_gpu_blocks": args.num_gpu_blocks, "num_cpu_blocks": args.num_cpu_blocks, "max_model_len": 1024}
    core = EngineCore(
        EngineConfig(model="tiny", device="cpu", policy=args.policy, async_scheduling=args.async_scheduling, **limits)
    )
    core.scheduler.step_time = steps = RecordedStepTimes()
    prompts = prompt_tokens(items, core.model_config.vocab_size, seed=args.seed)
    copies: list[CopyStats] = []
    timings, duration = replay(core, items, prompts, copy_stats=copies)
    measured = summarize(timings, duration)
    cal = calibration(steps, copies)
    host_s = steps.host_seconds()

    def predict(calibration: dict) -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "calibration.json"
            path.write_text(json.dumps(calibration))
            config = SimConfig(
                model=str(ensure_tiny_model() / "config.json"),
                policy=args.policy,
                calibration=path,
                duplex="serial",  # the CPU executor copies on its one lane
                async_scheduling=core.async_scheduling,
                host_s=host_s,  # between steps (the fit's fixed term holds the planning)
                **limits,
            )
            return point_report(simulate(config, items, seed=args.seed))

    predicted = predict(cal)
    fit_only = predict({k: v for k, v in cal.items() if k != "step_time_spread"})
    errors = {k: predicted[k] / measured[k] - 1.0 for k in KEYS}
    fit_errors = {k: fit_only[k] / measured[k] - 1.0 for k in KEYS}
    for k in KEYS:
        print(
            f"{k:12s} measured {measured[k]:8.1f}  simulated {predicted[k]:8.1f}  error {100 * errors[k]:+6.1f}%"
            f"  (fit alone {fit_only[k]:8.1f}, {100 * fit_errors[k]:+6.1f}%)"
        )
    counted = {"rotations": float(core.scheduler.counters.rotations), **core.scheduler.counters.by_reason()}
    for k, n in counted.items():
        simulated, alone = predicted.get(k, 0.0), fit_only.get(k, 0.0)
        print(f"{k:24s} measured {n:8.0f}  simulated {simulated:8.0f}  (fit alone {alone:8.0f})")
    shown = (*KEYS, "ttft_attainment", "tbt_attainment")
    figures = {
        "calibration": cal,
        "host_ms_between_steps": host_s * 1000.0,
        "measured": {**{k: measured[k] for k in shown}, **counted},
        "simulated": {**{k: predicted[k] for k in shown}, **{k: predicted.get(k, 0.0) for k in counted}},
        "relative_error": errors,
        "simulated_fit_alone": {k: fit_only[k] for k in shown},
        "relative_error_fit_alone": fit_errors,
        "steps_simulated": predicted["steps"],
    }
    workload = {"rate": args.rate, "duration_s": args.duration, "policy": args.policy, **limits}
    extra = {"workload": workload, "async_scheduling": core.async_scheduling}
    tag = f"fidelity-{args.policy}-{args.rate:g}rps{'-async' if core.async_scheduling else ''}"
    print(f"wrote {write_result('sim', 'cpu', figures, {'p50_p90_error': 'within 15%'}, extra, tag=tag)}")


if __name__ == "__main__":
    main()
