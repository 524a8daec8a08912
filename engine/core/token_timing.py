"""TokenTiming: what one scheduler update timed, for the metrics."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
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

    def gaps(self) -> dict[str, Sequence[float] | np.ndarray]:
        """Every gap of the update, by SLO class: a list where all came one by one (small
        batches, where numpy's fixed cost per call is more than the work), else an array."""
        out: dict[str, Sequence[float] | np.ndarray] = dict(self._singles)
        for slo_class, arrays in self._arrays.items():
            singles = self._singles.get(slo_class)
            out[slo_class] = np.concatenate([*arrays, singles]) if singles or len(arrays) > 1 else arrays[0]
        return out
