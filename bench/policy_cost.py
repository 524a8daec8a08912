"""policy_cost: what a policy costs against fcfs with ample memory, in one process.

The peer benchmark's saturation load (64 requests at once, prompts 32–96 tokens, 128 out, greedy)
on the tiny model with its matched settings (1024 blocks of 32 tokens, 64 sequences, 512 batched
tokens, one torch thread, float32), run through EngineCore directly: no HTTP server and no client
take CPU beside the engine, and its copies and scheduler are timed. The two engines alternate
(the first of each pair swaps every run) on the same prompts, new ones each run (no prefix hits).
Reports per policy the median tokens/s, CPU seconds (this process, all its threads), steps, host
time per step (schedule + update) and block copies; for tokens/s and CPU seconds the geometric
mean of the paired ratios with its 95% interval (t over the log ratios). The machine's other
tenants move both by ±10% a run (the model's own kernels run that much slower or faster), so the
record also adds up the work the policy does beyond fcfs's: its extra host time over its steps
and its copies, as a share of fcfs's run.

    python -m bench.policy_cost [--policy rotary] [--runs 10] [--tag T]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from superinfer.bench.host_time import timed
from superinfer.bench.peer_loads import LoadShape, items
from superinfer.bench.peer_settings import Matched
from superinfer.engine.config import EngineConfig
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import EngineCore
from superinfer.engine.model.tiny import ensure_tiny_model
from superinfer.engine.output import RequestOutput
from superinfer.engine.worker.duplex import CopyStats
from superinfer.engine.worker.runner import StepOutput
from superinfer.workload.arrivals import prompt_tokens
from superinfer.workload.record import write_result

AMPLE_BLOCKS = 1024  # vllm_peer's --ample-blocks default
# Two-sided 95% quantiles of Student's t by degrees of freedom (beyond the table: the normal's).
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
T95 |= {11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09, 20: 2.09}


def paired_ratio(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its 95% interval."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    half = T95.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


class Contender:
    """One engine with the peer bench's matched settings, timing its scheduler."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        m = Matched(ensure_tiny_model(), num_blocks=AMPLE_BLOCKS)  # what the peer bench gives both servers
        self.core = EngineCore(
            EngineConfig(
                model=str(m.model_dir),
                device="cpu",
                dtype=m.dtype,
                torch_threads=1,
                engine_process=False,
                policy=policy,
                num_gpu_blocks=m.num_blocks,
                block_size=m.block_size,
                max_num_seqs=m.max_num_seqs,
                max_num_batched_tokens=m.max_num_batched_tokens,
                max_model_len=m.max_model_len,
            )
        )
        self.host: list[float] = []
        self.copies: list[CopyStats] = []
        sched = self.core.scheduler
        sched.schedule = timed(self.host, sched.schedule)
        sched.update = timed(self.host, sched.update)
        complete = self.core.complete

        def complete_noting_copies(plan: StepPlan, result: StepOutput, phases: dict[str, float]) -> list[RequestOutput]:
            self.copies.append(result.copies)
            return complete(plan, result, phases)

        self.core.complete = complete_noting_copies

    def run(self, prompts: list[list[int]], output_tokens: int, tag: str) -> dict[str, float]:
        params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
        self.host.clear()
        self.copies.clear()
        t0, cpu0 = time.perf_counter(), time.process_time()
        for i, prompt in enumerate(prompts):
            self.core.add_request(f"{tag}-{i}", prompt, params)
        steps = 0
        while self.core.has_work:
            self.core.step()
            steps += 1
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
        return {
            "tok_s": len(prompts) * output_tokens / seconds,
            "cpu_s": cpu_seconds,
            "steps": steps,
            "host_ms_per_step": 1000 * sum(self.host) / steps,
            "copied_blocks": sum(c.blocks_out + c.blocks_in for c in self.copies),
            "copy_ms": 1000 * sum(c.seconds_out + c.seconds_in for c in self.copies),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="rotary", help="the policy set against fcfs")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="", help="names a variant run's results file (policy_cost-TAG-cpu-DATE.json)")
    args = parser.parse_args()
    shape = LoadShape()
    contenders = [Contender("fcfs"), Contender(args.policy)]
    vocab = contenders[0].core.model_config.vocab_size
    warm = items("saturation", shape, args.seed - 1)
    for c in contenders:
        c.run(prompt_tokens(warm, vocab, args.seed - 1), 8, "warm")
    runs: dict[str, list[dict[str, float]]] = {c.policy: [] for c in contenders}
    for run in range(args.runs):
        work = items("saturation", shape, args.seed + run)
        prompts = prompt_tokens(work, vocab, args.seed + run)
        for c in contenders if run % 2 == 0 else contenders[::-1]:
            runs[c.policy].append(c.run(prompts, shape.saturation_output, f"run{run}"))
        base, other = runs["fcfs"][-1], runs[args.policy][-1]
        print(
            f"run {run}: fcfs {base['tok_s']:.0f} tok/s ({base['steps']} steps), {args.policy} "
            f"{other['tok_s']:.0f} ({other['steps']}): {other['tok_s'] / base['tok_s']:.3f}x; CPU seconds "
            f"{base['cpu_s']:.2f} / {other['cpu_s']:.2f}: {other['cpu_s'] / base['cpu_s']:.3f}x",
            flush=True,
        )
    figures: dict[str, dict] = {p: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for p, rs in runs.items()}
    for p in runs:
        f = figures[p]
        print(
            f"{p:>8}: {f['tok_s']:.0f} tok/s, {f['cpu_s']:.2f} CPU s, {f['steps']:.0f} steps, host "
            f"{f['host_ms_per_step']:.2f} ms/step, {f['copied_blocks']:.0f} blocks copied in {f['copy_ms']:.1f} ms"
        )
    for key, name in (("tok_s", "tokens/s"), ("cpu_s", "CPU seconds")):
        ratios = [o[key] / b[key] for b, o in zip(runs["fcfs"], runs[args.policy], strict=True)]
        mean, lo, hi = paired_ratio(ratios)
        figures[f"{key}_ratio"] = {"runs": ratios, "geomean": mean, "interval_95": [lo, hi]}
        print(f"{name}, {args.policy} / fcfs: {mean:.3f}x (95% interval {lo:.3f}-{hi:.3f}) over {len(ratios)} pairs")
    # The work the policy does beyond fcfs's in a run (the steps being the same): its extra host time
    # and its copies, against fcfs's run. Unlike the ratios it hardly moves with the machine's noise.
    base, other = figures["fcfs"], figures[args.policy]
    extra_ms = (other["host_ms_per_step"] - base["host_ms_per_step"]) * other["steps"] + other["copy_ms"]
    run_ms = 1000 * shape.saturation_requests * shape.saturation_output / base["tok_s"]
    figures["extra_work"] = {"ms_per_run": extra_ms, "share_of_fcfs_run": extra_ms / run_ms}
    print(f"{args.policy}'s work beyond fcfs's: {extra_ms:.0f} ms a run, {100 * extra_ms / run_ms:.1f}% of fcfs's run")
    goal = {
        "tok_s_ratio": f"{args.policy} >= 0.98x fcfs with ample memory (issue 17: costs <= 2%)",
        "extra_work": "<= 2% of fcfs's run",
    }
    print(f"wrote {write_result('policy_cost', 'cpu', figures, goal, tag=args.tag)}")


if __name__ == "__main__":
    main()
