"""Keep freed memory in this process's heap (glibc), so CPU steps stop mapping fresh pages.

torch's CPU allocator hands each tensor to malloc. glibc serves a large one from a fresh mmap
(above its mmap threshold) and gives heap memory back to the kernel once more than its trim
threshold is free, so a decode step that allocates its activations, logits and sampling buffers
anew maps, and the kernel zeroes, megabytes of pages every step: 1,000 to 10,000 page faults
for one sampling call at 1024 × 3072 here, 0 to 150 with the thresholds raised. With them
raised, freed chunks are reused, as tcmalloc or jemalloc (which PyTorch's and vLLM's CPU guides
preload) do.
The heap then keeps its peak size while the process lives.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest on 64-bit: bigger allocations are always mapped
TRIM_THRESHOLD_BYTES = 1 << 30


def retain_freed_heap() -> bool:
    """Raise glibc's mmap and trim thresholds for this process. False where malloc is not
    glibc's (or ignores them): nothing changes there."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(mapped) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
