"""The fleet timeline: request rate, replicas ready and desired, and goodput per window, one line
per set-up (matplotlib, no display)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot_timeline(reports: Mapping[str, Mapping[str, Any]], path: Path, title: str, target: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_rep, ax_good) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    first = next(iter(reports.values()))
    ts = [row["t"] / 60 for row in first["timeline"]]
    ax_rate.plot(ts, [row["rate"] for row in first["timeline"]], color="black")
    ax_rate.set_ylabel("arrivals (req/s)")
    for label, report in reports.items():
        rows = report["timeline"]
        x = [row["t"] / 60 for row in rows]
        (line,) = ax_rep.plot(x, [row["ready"] for row in rows], label=f"{label} ready")
        ax_rep.plot(x, [row["desired"] for row in rows], linestyle="--", color=line.get_color(), alpha=0.6)
        ax_good.plot(x, [row["goodput_share"] for row in rows], label=label, color=line.get_color())
    ax_rep.set_ylabel("replicas (solid ready, dashed desired)")
    ax_rep.legend(fontsize=7, loc="upper left")
    ax_good.axhline(target, color="grey", linestyle=":", linewidth=1)
    ax_good.set_ylabel("goodput share (stall-aware)")
    ax_good.set_ylim(-0.02, 1.02)
    ax_good.set_xlabel("minutes")
    ax_good.legend(fontsize=7, loc="lower left")
    ax_rate.set_title("\n".join(textwrap.wrap(title, 140)), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
