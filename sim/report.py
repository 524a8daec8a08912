"""One simulated point's report: `superinfer bench`'s keys (workload.goodput.summarize) plus what only
the engine side knows (swap GB/s per direction, rotations, recomputes)."""

from __future__ import annotations

from superinfer.sim.simulator import SimResult


def point_report(result: SimResult) -> dict[str, float]:
    from superinfer.workload.goodput import summarize

    duration = max(result.duration_s, 1e-9)
    report = summarize(result.timings, duration)
    counters = result.counters
    report.update(
        swap_gb_s_gpu_to_cpu=result.blocks_out * result.block_bytes / duration / 1e9,
        swap_gb_s_cpu_to_gpu=result.blocks_in * result.block_bytes / duration / 1e9,
        rotations=float(counters.rotations),
        rotations_per_request=counters.rotations / max(1.0, report["requests"]),
        recomputes=float(counters.preemptions["recompute"]),
        steps=float(result.steps),
        duration_s=result.duration_s,
        num_gpu_blocks=float(result.num_gpu_blocks),
        num_cpu_blocks=float(result.num_cpu_blocks),
        copy_seconds=result.copy_seconds,
        copy_hidden_ratio=result.copy_hidden_ratio or 0.0,
        wall_s=result.wall_s,
        **result.guard,
        **counters.by_reason(),
    )
    return report
