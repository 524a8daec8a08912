"""Per-replica latency model fitted online, used to predict what consolidation would do.

TBT ≈ a + b·batch (decode step time grows with the running batch), fitted by ridge-regularised
least squares towards a prior (seeded from the simulator or defaults). TTFT ≈ queue wait +
prefill, where queue wait grows as batch occupancy approaches capacity.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Line:
    a: float  # seconds per token at an empty batch
    b: float  # extra seconds per token per running sequence

    def at(self, batch: float) -> float:
        return self.a + self.b * batch


# A prior for an 8B model on one GPU: ~12 ms per decode step plus ~0.15 ms per sequence.
DEFAULT_PRIOR = Line(a=0.012, b=0.00015)


def fit_line(points: Iterable[tuple[float, float]], prior: Line, prior_weight: int = 1) -> Line:
    """Least squares of y = a + b·x, with `prior_weight` pseudo-observations on the prior line at
    each end of the observed batch range (at 0 and 1 without data): with few or collinear points the
    prior dominates; with many, the data does.
    """
    data = list(points)
    ends = (min(x for x, _ in data), max(x for x, _ in data)) if data else (0.0, 1.0)
    pts = data + [(x, prior.at(x)) for x in ends for _ in range(prior_weight)]
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx <= 0:
        return prior
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    b = max(b, 0.0)  # more sequences never make a step faster
    a = max(my - b * mx, 0.0)
    return Line(a, b)


@dataclass
class LatencyModel:
    prior: Line = DEFAULT_PRIOR
    points: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def observe(self, batch_per_replica: float, tbt_seconds: float) -> None:
        if batch_per_replica > 0 and tbt_seconds > 0:
            self.points.append((batch_per_replica, tbt_seconds))

    def tbt(self) -> Line:
        return fit_line(self.points, self.prior)

    def predict_tbt(self, batch_now: float, batch_after: float, observed_tbt: float | None) -> float:
        """TBT at a new batch size: the fitted line's ratio applied to what is observed now."""
        line = self.tbt()
        if observed_tbt is None or line.at(batch_now) <= 0:
            return line.at(batch_after)
        return observed_tbt * line.at(batch_after) / line.at(batch_now)


def predict_ttft(observed_ttft: float, occupancy: float, occupancy_after: float) -> float:
    """TTFT after the load per replica grows: queue wait inflates like 1/(1 - occupancy).

    `occupancy` is the share of the batch capacity in use (running / maxNumSeqs). At or past
    saturation the prediction is infinite (a queue would build without bound).
    """
    if occupancy_after >= 0.95:
        return float("inf")
    return observed_ttft * (1.0 - min(occupancy, 0.95)) / (1.0 - occupancy_after)
