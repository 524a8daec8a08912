"""Host memory for the CPU KV tier: exactly the bytes asked for, pinned for CUDA copies.

`torch.zeros(..., pin_memory=True)` goes through torch's caching host allocator, which rounds
every allocation up to a power of two: a 200 GiB tier would pin 256 GiB, and one just above a
power of two may not fit at all. Here the tier is an anonymous mmap of the requested size
(page-rounded), registered with `cudaHostRegister` when CUDA copies read it, and unregistered
when the last tensor viewing it is freed.

The default size of the tier (`default_tier_bytes`) comes from the memory this process may still
take (`available_host_bytes`: MemAvailable, capped by the container's cgroup limit).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import torch

# Registrations are at most this large (in whole blocks): a single huge cudaHostRegister can be
# refused where slabs succeed. One copy must stay within one registration (one that straddles two
# fails with cudaErrorInvalidValue, seen on an H100 with CUDA 13): DuplexKV splits its runs of
# blocks at slab boundaries (`slab_bytes`).
SLAB_BYTES = 32 << 30
# cudaHostRegisterPortable (pinned for every CUDA context, not only the current one) and
# cudaHostRegisterMapped (kernels may read and write it in place: the `kernel` KV copy method).
_REGISTER_FLAGS = 1 | 2


def host_tensor(nbytes: int, pin: bool = False, align: int = 1, populate: bool = False) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of exactly `nbytes` bytes in its own anonymous mapping.

    With `pin` the mapping is registered with CUDA (in slabs of whole `align`-byte units), so
    `non_blocking` copies to and from the GPU are asynchronous DMA. The registration ends when
    the tensor and every view of it are gone. With `populate` every page is mapped now rather than
    at its first write (which costs a page fault, and zeroing a huge page, in the middle of a step).
    """
    if nbytes < 1:
        raise ValueError(f"a host buffer needs at least one byte, got {nbytes}")
    length = _pages(nbytes)
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to pin and to map for DMA
    # A ctypes array over the mapping owns the registration: the tensor keeps it alive (and it
    # keeps the mapping alive), and its __del__ unregisters before the mapping can be unmapped.
    slabs: list[int] = []
    region_type = type("HostRegion", (ctypes.c_ubyte * length,), {"__del__": _unregisters(slabs)})
    region = region_type.from_buffer(mapping)
    if pin:
        _register(ctypes.addressof(region), length, align, slabs)
    tensor = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)
    if populate:
        tensor.zero_()  # (its pages read as zeros already: this writes them into the mapping)
    return tensor


def _pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def slab_bytes(align: int) -> int:
    """Bytes per registration of a tensor pinned with `align`: whole pages and whole `align` units
    (slabs never share a page, and end between blocks), at most SLAB_BYTES where that allows."""
    unit = math.lcm(align, mmap.PAGESIZE)
    return max(unit, SLAB_BYTES // unit * unit)


def _register(base: int, length: int, align: int, slabs: list[int]) -> None:
    """Page-lock [base, base + length) for CUDA in slabs, appending each slab's address."""
    slab = slab_bytes(align)
    cudart = torch.cuda.cudart()
    for start in range(0, length, slab):
        code = int(cudart.cudaHostRegister(base + start, min(slab, length - start), _REGISTER_FLAGS))
        if code != 0:
            _unregister(slabs)
            raise RuntimeError(
                f"cudaHostRegister could not pin {length / 2**30:.2f} GiB of host memory (cudaError {code}) at "
                f"{start / 2**30:.2f} GiB; a smaller CPU KV tier (--cpu-kv-gib) may fit"
            )
        slabs.append(base + start)


def _unregister(slabs: list[int]) -> None:
    while slabs:
        torch.cuda.cudart().cudaHostUnregister(slabs.pop())


def _unregisters(slabs: list[int]) -> Callable[[ctypes.Array], None]:
    def __del__(self: ctypes.Array) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone; the OS unpins then
            _unregister(slabs)

    return __del__


# --- sizing -------------------------------------------------------------------------------------

HOST_FRACTION = 0.5  # of the available host memory (per GPU of the host) the tier takes by default
MAX_HOST_FRACTION = 0.8  # at most, when the tier grows to the GPU pool's size


def default_tier_bytes(
    available: int,
    gpu_pool_bytes: int,
    gpus: int = 1,
    fraction: float = HOST_FRACTION,
    max_fraction: float = MAX_HOST_FRACTION,
) -> int:
    """Default size of the CPU KV tier: `fraction` of this GPU's share of the available host
    memory, raised to the GPU pool's size when that stays within `max_fraction` of the share.

    `gpus`: GPUs on the host; each may run an engine that wants its share.
    """
    share = available // max(1, gpus)
    return max(0, int(fraction * share), min(gpu_pool_bytes, int(max_fraction * share)))


def available_host_bytes(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process may still take: the kernel's MemAvailable, capped by the room left
    under the cgroup's memory limit (a container's limit; page cache that can be dropped counts
    as room, as for the kubelet's working set)."""
    available = _meminfo_available(proc / "meminfo")
    for limit_file, usage_file, stat_file, inactive_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"),
    ):
        try:
            limit_text = (cgroup / limit_file).read_text().strip()
            if limit_text == "max":
                continue
            usage = int((cgroup / usage_file).read_text())
            stat = dict(line.split() for line in (cgroup / stat_file).read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            continue
        working_set = max(0, usage - int(stat.get(inactive_key, 0)))
        available = min(available, max(0, int(limit_text) - working_set))
    return available


def require_host_bytes(what: str, size: int) -> None:
    """A ValueError naming `what` when `size` bytes cannot fit in the host's available memory (an
    allocation that could never be served, rather than an out-of-memory error or kill later)."""
    available = available_host_bytes()
    if size > available:
        raise ValueError(
            f"{what}: {size / 2**30:.2f} GiB exceeds the host's available memory ({available / 2**30:.2f} GiB)"
        )


def _meminfo_available(path: Path) -> int:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
