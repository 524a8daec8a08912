"""TokenTiming: what one scheduler update timed, for the metrics."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from superinfer.engine.core.request import Request


class TokenTiming:
    """The requests whose first token one update brought, and the gap before each of its other
    tokens, by SLO class: arrays for the decode rows applied in columns, single gaps for the
    others. The metrics read this instead of each request's gap list, whose newest entries a
    running request keeps in its RunningBatch slot."""

    def __init__(self) -> None:
        self.first: list[Request] = []
        self._arrays: defaultdict[str, list[np.ndarray]] = defaultdict(list)
        self._singles: defaultdict[str, list[float]] = defaultdict(list)

    def add_gap(self, slo_class: str, gap: float) -> None:
        self._singles[slo_class].append(gap)

    def add_gaps(self, slo_class: str, gaps: np.ndarray) -> None:
        self._arrays[slo_class].append(gaps)

    def gaps(self) -> dict[str, np.ndarray]:
        """Every gap of the update, by SLO class."""
        return {
            slo_class: np.concatenate([*self._arrays[slo_class], np.asarray(self._singles[slo_class], dtype=float)])
            for slo_class in {*self._arrays, *self._singles}
        }
