"""Figures of a sweep: attainment and goodput vs rate per policy, and TTFT CDFs at the top rate."""

from __future__ import annotations

from pathlib import Path

from superinfer.sim.sweep import Sweep

PANELS = (("ttft_attainment", "TTFT attainment"), ("tbt_attainment", "TBT attainment"), ("goodput_share", "goodput"))


def plot_sweep(sweep: Sweep, path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(4.2 * (len(PANELS) + 1), 3.6))
    for ax, (key, name) in zip(axes, PANELS, strict=False):
        for label, reports in sweep.points.items():
            ax.plot([r["rate"] for r in reports], [100 * r[key] for r in reports], marker="o", label=label)
        ax.set(xlabel="request rate (req/s)", ylabel=f"{name} (%)", ylim=(-2, 102), title=name)
        ax.grid(alpha=0.3)
    cdf = axes[-1]
    for label, ttfts in sweep.ttfts_ms.items():
        xs = sorted(t / 1000.0 for t in ttfts)
        cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    cdf.set(xlabel="TTFT (s), top rate", ylabel="CDF", title="TTFT at the top rate")
    cdf.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
