"""The step log's garbage-collector timer."""

from __future__ import annotations

import gc

from superinfer.workload.gc_pauses import GCPauses


def test_collections_while_entered_are_timed_and_full_ones_counted():
    with GCPauses() as pauses:
        gc.collect(0)
        assert pauses.seconds > 0 and pauses.full == 0
        gc.collect()
        gc.collect()
        assert pauses.full == 2
    seconds = pauses.seconds
    gc.collect()
    assert pauses.seconds == seconds and pauses.full == 2, "not counted once left"
