"""The objects a serving process holds from startup, out of the garbage collector's way.

A full (generation 2) collection walks every container the process tracks: with torch, the model,
the tokenizer and the KV pools' bookkeeping loaded, ~200k objects and 85-100 ms on these CPUs for
the tiny model. Such a collection, when the survivors of serving grow the old generation enough,
stalls the engine loop (every stream's next token) or the server's event loop for that long, near
a 100 ms TBT SLO. Frozen once startup is done, those objects are never walked again; what serving
creates is collected as before, and a startup object that becomes garbage later is still freed by
its reference count (only a reference cycle among frozen objects is never collected).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> None:
    """Collect once, then move every object alive now to the permanent generation (`gc.freeze`).
    Call it where a serving process is ready, never in library code that a test runs many times."""
    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    gc.freeze()
    log.info(
        "%s: %d startup objects frozen out of the garbage collector's walks (a full collection took %.0f ms)",
        what,
        gc.get_freeze_count(),
        took * 1000,
    )
