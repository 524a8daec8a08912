"""Time the garbage collector takes, for step logs: which host stalls were collections."""

from __future__ import annotations

import gc
import time
from types import TracebackType


class GCPauses:
    """While entered: seconds spent in collections so far, and how many were full (generation 2)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._start = 0.0

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2
