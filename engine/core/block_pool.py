"""The block pool of one KV tier: a fixed set of block ids with reference counts, an LRU free
list that keeps freed blocks findable by their prefix hash until handed out again, and the fences
that keep an unfinished step's copies and compute from racing a block's next owner.
(core/kv_manager.py runs a pool per tier and explains the fences.)
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, islice, repeat


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def newest_fence(blocks: Iterable[int], fences: dict[int, int]) -> int:
    return max(map(fences.get, blocks, repeat(0)), default=0)


@functools.cache
def _packer(num_tokens: int) -> Callable[..., bytes]:
    return struct.Struct(f"<{num_tokens}q").pack


def block_hashes(parent: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The hash of each full block of `tokens` in turn, chained: a block's hash covers its
    tokens and the hash of the block before it (`parent` for the first)."""
    width, hashes = 8 * block_size, []
    full = len(tokens) - len(tokens) % block_size
    data = _packer(full)(*tokens[:full])  # (one call for all the blocks)
    for start in range(0, len(data), width):
        parent = hashlib.blake2b(parent + data[start : start + width], digest_size=16).digest()
        hashes.append(parent)
    return hashes


UNHASHED = b"unhashed"  # hash_of a block in an UnhashedRun (a real hash has 16 bytes)


@dataclass(slots=True, eq=False)
class UnhashedRun:
    """Full blocks a finished request released without hashing them (its output), and what their
    hashes come from: the hash of the block before them and their tokens. A block handed out
    meanwhile leaves the run (-1 in its place)."""

    parent: bytes
    blocks: list[int]
    tokens: list[int]
    live: int = field(init=False)  # blocks not handed out

    def __post_init__(self) -> None:
        self.live = len(self.blocks)


class BlockPool:
    """Fixed set of block ids with reference counts, an LRU free list, a prefix-hash index, and
    fences on released blocks that an unfinished step may still touch.

    A released block that an unfinished copy touches is quarantined until that step retires, or,
    with `reuse_under_copy`, only while the plan whose copy touches it is being made: then it is
    free but handed out last, and whoever takes it learns the copy's step (so its op can wait for
    that copy)."""

    def __init__(self, num_blocks: int, reuse_under_copy: bool = False, tracks_use: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.reuse_under_copy = reuse_under_copy
        # Keep `in_use` and the watched counts (admission reads them off the GPU pool; nobody
        # reads the CPU tier's, so it skips a set update for each block it takes and releases).
        self.tracks_use = tracks_use
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.in_use: set[bytes] = set()  # hashes whose cached block is referenced (ref_cnt > 0)
        self.watched: dict[bytes, int] = {}  # hash -> how many swapped-out requests have a block of it
        self.watched_in_use = 0  # watched hashes in `in_use`
        self.watched_twice = 0  # watched hashes more than one swapped-out request has
        self.unhashed: dict[int, UnhashedRun] = {}  # free block not hashed yet -> its run
        self.unhashed_after: dict[bytes, list[UnhashedRun]] = {}  # runs by the hash before them
        self.held: dict[int, int] = {}  # quarantined block -> fence (step id)
        self.copying: dict[int, int] = {}  # block -> the newest unfinished step with a copy from or to it
        self.computing: dict[int, int] = {}  # released block -> the newest unfinished step computing with it
        self.newest_fence = 0  # the newest step in `copying` or `computing`
        self.completed = 0  # every step up to this one is done
        self.copy_fence_taken = 0  # the newest unfinished copy touching a block `allocate` handed out
        self.planning = 0  # the step being planned

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free) - len(self.held)

    @property
    def num_fenced(self) -> int:
        """Released blocks an unfinished copy still touches (quarantined, or free but fenced)."""
        return len(self.held) + sum(1 for b in self.copying if self.ref_cnt[b] == 0 and b not in self.held)

    def begin_step(self, step: int) -> None:
        """Plan `step`. With `reuse_under_copy`, blocks under the copies of earlier steps are free
        (fenced): those copies are issued, so this plan's ops can wait for them; blocks under
        this plan's own copies stay quarantined until the next plan."""
        self.planning = step
        self.copy_fence_taken = 0
        if self.reuse_under_copy and self.held:
            self.free.update(dict.fromkeys(self.held))
            self.held.clear()

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks for compute to write, evicting the least recently freed cached ones
        first and those an unfinished copy touches last (`copy_fence_taken` tells which copy)."""
        blocks = self._pop(n, (self.copying,))
        if self.copying:
            self.copy_fence_taken = max(self.copy_fence_taken, newest_fence(blocks, self.copying))
        return blocks

    def allocate_for_copy(self, n: int) -> tuple[list[int], int, int]:
        """Take n free blocks for a copy to write, those no unfinished step touches first. Returns
        the blocks, and the newest unfinished steps whose compute and whose copies touch one."""
        blocks = self._pop(n, (self.computing, self.copying))
        return blocks, newest_fence(blocks, self.computing), newest_fence(blocks, self.copying)

    def _pop(self, n: int, avoid: tuple[dict[int, int], ...]) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self.free)} free")
        head = list(islice(self.free, n))
        if not any(avoid) or all(fences.keys().isdisjoint(head) for fences in avoid):  # the common case
            for block in head:
                del self.free[block]
            return self._take(head)
        clean: list[int] = []
        if any(avoid):  # from the head; past n + (fenced blocks) blocks, no unfenced one is left
            head = islice(self.free, n + sum(map(len, avoid)))
            for fences in avoid:
                head = filterfalse(fences.__contains__, head)
            clean = list(islice(head, n))  # the scan runs in C: the head may hold many fenced blocks
            for block in clean:
                del self.free[block]
        rest = [self.free.popitem(last=False)[0] for _ in range(n - len(clean))]
        return self._take(clean + rest)

    def _take(self, blocks: list[int]) -> list[int]:
        """Hand out blocks just taken off the free list: their old content is no longer findable."""
        ref_cnt, hash_of, cached = self.ref_cnt, self.hash_of, self.cached
        for block in blocks:  # (locals only, `_drop_hash` inlined: a step takes hundreds)
            h = hash_of[block]
            if h is not None:
                if h is UNHASHED:
                    self._leave_run(block)
                elif cached.get(h) == block:
                    del cached[h]
                hash_of[block] = None
            ref_cnt[block] = 1
        return blocks

    def defer_hashes(self, run: UnhashedRun) -> None:
        """Keep the run's blocks unhashed until `take_runs` for the hash before them."""
        for block in run.blocks:
            self.hash_of[block] = UNHASHED
            self.unhashed[block] = run
        self.unhashed_after.setdefault(run.parent, []).append(run)

    def take_runs(self, parent: bytes) -> list[UnhashedRun]:
        """The runs after the block with hash `parent`, out of the pool's keeping (their blocks
        are to be registered), with the blocks handed out meanwhile as -1."""
        runs = self.unhashed_after.pop(parent, [])
        for run in runs:
            for block in run.blocks:
                if block >= 0:
                    del self.unhashed[block]
                    self.hash_of[block] = None
        return runs

    def _leave_run(self, block: int) -> None:
        run = self.unhashed.pop(block)
        run.blocks[run.blocks.index(block)] = -1
        run.live -= 1
        if not run.live:
            runs = self.unhashed_after[run.parent]
            runs.remove(run)
            if not runs:
                del self.unhashed_after[run.parent]

    def touch(self, block: int) -> None:
        """Take one more reference to a block found in the prefix cache."""
        if self.ref_cnt[block] == 0:
            del self.free[block]
            h = self.hash_of[block]
            if h is not None and self.cached.get(h) == block:
                self._use(h)
        self.ref_cnt[block] += 1

    def copied(self, blocks: Iterable[int], step: int) -> None:
        """A copy in `step` reads or writes these blocks: releasing them waits for the step."""
        self.copying.update(dict.fromkeys(blocks, step))
        self.newest_fence = max(self.newest_fence, step)

    def release(self, blocks: Iterable[int], computed_in: int = 0) -> None:
        """Drop one reference to each block, held by a request last computed in step
        `computed_in`. A block reaching zero goes to the free list's tail, or, while a copy of an
        unfinished step touches it, into quarantine until that step retires."""
        fence = computed_in if computed_in > self.completed else 0
        ref_cnt, hash_of, cached = self.ref_cnt, self.hash_of, self.cached
        copying, computing, in_use, watched = self.copying, self.computing, self.in_use, self.watched
        reuse_before = self.planning if self.reuse_under_copy else 0  # a copy of an earlier step: free
        tracks_use = self.tracks_use
        if fence > self.newest_fence:
            self.newest_fence = fence
        for block in blocks:  # (a finished request's dozens of blocks: locals only)
            if fence and computing.get(block, 0) < fence:
                computing[block] = fence
            n = ref_cnt[block] = ref_cnt[block] - 1
            if n:
                if n < 0:
                    raise RuntimeError(f"block {block} released more often than it was taken")
                continue
            h = hash_of[block]
            if tracks_use and h is not None and cached.get(h) == block:
                in_use.discard(h)
                if h in watched:
                    self.watched_in_use -= 1
            copy_fence = copying.get(block)
            if copy_fence is None or copy_fence < reuse_before:
                self.free[block] = None
            else:
                self.held[block] = copy_fence

    def retire(self, completed_step: int) -> None:
        """Steps up to `completed_step` are done: their copies are over, their quarantine is free."""
        self.completed = max(self.completed, completed_step)
        if completed_step >= self.newest_fence:  # no step in flight: every fence is past
            self.copying, self.computing = {}, {}
            self.free.update(dict.fromkeys(self.held))
            self.held.clear()
            return
        if self.copying:
            self.copying = {b: step for b, step in self.copying.items() if step > completed_step}
        if self.computing:
            self.computing = {b: step for b, step in self.computing.items() if step > completed_step}
        done = [b for b, fence in self.held.items() if fence <= completed_step]
        for block in done:
            del self.held[block]
            self.free[block] = None

    def register(self, block: int, h: bytes) -> None:
        """Make a full block findable by its prefix hash (the first block with a hash keeps it)."""
        if self.hash_of[block] is None:
            self.hash_of[block] = h
            if self.cached.setdefault(h, block) == block and self.ref_cnt[block] > 0:
                self._use(h)

    def register_all(self, blocks: Iterable[int], hashes: Iterable[bytes]) -> None:
        """`register` each block with the hash beside it, in order (inlined: a rotation brings
        back a request's every block)."""
        hash_of, cached, ref_cnt, in_use, watched = self.hash_of, self.cached, self.ref_cnt, self.in_use, self.watched
        tracks_use = self.tracks_use
        for block, h in zip(blocks, hashes, strict=True):
            if hash_of[block] is None:
                hash_of[block] = h
                if cached.setdefault(h, block) == block and tracks_use and ref_cnt[block] > 0:
                    in_use.add(h)  # (`_use`)
                    if h in watched:
                        self.watched_in_use += 1

    def _use(self, h: bytes) -> None:
        if not self.tracks_use:
            return
        self.in_use.add(h)
        if h in self.watched:
            self.watched_in_use += 1

    def watch(self, hashes: Sequence[bytes]) -> None:
        """Count in `watched_in_use` whether these (distinct) hashes are in use (a request swapped
        out). Most are watched by no other request: those at once."""
        watched = self.watched
        if watched.keys().isdisjoint(hashes):
            watched.update(dict.fromkeys(hashes, 1))
            self.watched_in_use += len(self.in_use.intersection(hashes))
            return
        for h in hashes:
            n = watched.get(h, 0)
            watched[h] = n + 1
            if n == 1:
                self.watched_twice += 1
            elif not n and h in self.in_use:
                self.watched_in_use += 1

    def unwatch(self, hashes: Sequence[bytes]) -> None:
        watched = self.watched
        if not self.watched_twice:  # each watched once: gone at once
            for h in hashes:
                del watched[h]
            self.watched_in_use -= len(self.in_use.intersection(hashes))
            return
        for h in hashes:
            n = watched.pop(h) - 1
            if n:
                watched[h] = n
                if n == 1:
                    self.watched_twice -= 1
            elif h in self.in_use:
                self.watched_in_use -= 1

    def lookup(self, h: bytes) -> int | None:
        block = self.cached.get(h)
        return None if block is None or block in self.held else block

    def lookup_all(self, hashes: Iterable[bytes]) -> list[int | None]:
        """`lookup` of each hash (a rotary request's blocks, on the swap-in path)."""
        held = self.held
        return [None if b is None or b in held else b for b in map(self.cached.get, hashes)]

    def _drop_hash(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.hash_of[block] = None
