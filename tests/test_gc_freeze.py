"""A serving process freezes what it holds at startup out of the garbage collector's walks."""

from __future__ import annotations

import gc
import weakref

from superinfer.engine.gc_freeze import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_startup_objects_leave_the_collectors_walks_and_later_garbage_is_still_collected():
    held_since_startup = {"blocks": list(range(100))}
    startup_garbage = weakref.ref(_Node())
    try:
        freeze_startup_heap("test")
        assert startup_garbage() is None, "collected before freezing, not kept forever"
        assert gc.get_freeze_count() > 0
        assert not _tracked(held_since_startup)  # frozen: a full collection no longer walks it
        created_while_serving = {"request": [1, 2, 3]}
        assert _tracked(created_while_serving)
        serving_garbage = weakref.ref(_Node())
        gc.collect()
        assert serving_garbage() is None
    finally:
        gc.unfreeze()
    assert _tracked(held_since_startup)
