"""KV block accounting across the tiers: prefix caching, write-through and rotation over a block
pool per tier (core/block_pool.py).

Pure bookkeeping over block ids; the tensors live in the runner. A block's content is the KV of
`block_size` consecutive tokens of a sequence across all layers (block-first layout), so a full
block is identified by the hash of its tokens chained with the hash of the block before it.
Freed blocks keep their hash and stay findable until they are handed out again (LRU eviction).
A finished request's output blocks are hashed only when a lookup could find them: when a new
request's prefix has hit the block before them (a chat's next turn continues the last one's
output); until then they sit in the free list unhashed, with the tokens to hash them.

Two tiers: the GPU pool holds the KV the model reads; the optional CPU pool holds copies. A full
block never changes again, so it is copied to the CPU tier as soon as it fills (eager
write-through); rotating a request out then only copies its partial tail, and rotating it back in
reuses its blocks still cached on the GPU and copies in only the rest.

Safety, with async scheduling (the host plans step t+1 while step t runs on the device). A
released block that an unfinished step still touches carries that step as a fence:
- touched by a copy: a GPU block is quarantined while that copy's plan is made, then free but
  handed out last, and the op that takes it waits for that step's copy-out (`StepPlan.compute_after_copy`,
  `swap_in_after_copy`); a CPU block is quarantined until the step retires (the CPU tier is
  large, so nothing waits);
- touched by compute only: free at once for compute, which runs steps in order on one lane; the
  pool hands such blocks to copy-ins last, and a copy-in that gets one waits for that step's
  compute (`StepPlan.swap_in_after`). Copy-in of step t+1 otherwise overlaps step t's compute.
- a block an unfinished copy touches is not copied out (written through, or its request rotated
  out) until that copy's step retires: a copy-in may still be writing it, and a request admitted
  in the step of a swap-in can share a block the swap-in copies in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import NamedTuple

from superinfer.engine.core.block_pool import BlockPool, UnhashedRun, block_hashes, cdiv, newest_fence
from superinfer.engine.core.request import Request


def _before_copying(block_ids: list[int], first: int, n: int, copying: dict[int, int]) -> int:
    """How many of the n blocks from block_ids[first] come before the first one an unfinished copy
    touches (a write-through stops there)."""
    k = 0
    while k < n and block_ids[first + k] not in copying:
        k += 1
    return k


class SwapIn(NamedTuple):
    copies: list[tuple[int, int]]  # (cpu block, gpu block)
    after_compute: int  # an unfinished step whose compute touches a destination (0: none)
    after_copy: int  # an unfinished step whose copies touch a source or a destination (0: none)


class KVCacheManager:
    """Per-request block tables over the GPU pool, and copies in the optional CPU pool."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_cpu_blocks: int = 0
    ) -> None:
        self.pool = BlockPool(num_blocks, reuse_under_copy=True)
        self.cpu = BlockPool(num_cpu_blocks, tracks_use=False) if num_cpu_blocks > 0 else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.swapped_out: set[Request] = set()  # their full blocks' hashes are watched in the pool

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def retire(self, completed_step: int) -> None:
        """Every step up to `completed_step` has finished its compute and its copies."""
        self.pool.retire(completed_step)
        if self.cpu:
            self.cpu.retire(completed_step)

    # --- the GPU tier --------------------------------------------------------------------
    def update_hashes(self, req: Request) -> list[bytes]:
        """Extend the request's prefix hashes to every full block of its known tokens."""
        bs, hashes, tokens = self.block_size, req.block_hashes, req.token_ids
        known, full = len(hashes), len(tokens) // bs
        if full > known:
            hashes += block_hashes(hashes[-1] if hashes else b"", tokens[known * bs : full * bs], bs)
        return hashes

    def _prompt_hashes(self, req: Request, prompt_full: int) -> list[bytes]:
        """Hashes of at least the prompt's `prompt_full` full blocks (known since the request was
        added: its outputs' are not computed for this)."""
        return req.block_hashes if len(req.block_hashes) >= prompt_full else self.update_hashes(req)

    def cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding a prefix of the request's tokens, found in the cache.

        The last token is never served from the cache: its logits are needed to sample. Neither is
        any token of a request that wants its prompt's logprobs (they come from the prefill).
        """
        if not self.enable_prefix_caching or req.sampling.prompt_logprobs is not None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        found, parent = [], b""
        for h in self.update_hashes(req)[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None and self._hash_runs_after(parent):
                block = self.pool.lookup(h)
            if block is None:
                break
            found.append(block)
            parent = h
        return found

    def _hash_runs_after(self, parent: bytes) -> bool:
        """Hash and register the unhashed blocks that follow the block with hash `parent`, if any."""
        runs = self.pool.take_runs(parent) if parent in self.pool.unhashed_after else ()
        for run in runs:
            for block, h in zip(run.blocks, block_hashes(run.parent, run.tokens, self.block_size), strict=True):
                if block >= 0:
                    self.pool.register(block, h)
        return bool(runs)

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens after its cached prefix.

        Returns False, changing nothing, when the free pool cannot cover it.
        """
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(req.block_ids) - len(cached)
        if not cached and need <= 0:
            return True  # the common decode step: the last block has room
        if need > self.pool.num_free - (self._free_taken(cached) if cached else 0):
            return False
        for block in cached:
            self.pool.touch(block)
        # A new list, not extended in place: plans already handed out share the old one.
        req.block_ids = [*req.block_ids, *cached, *(self.pool.allocate(need) if need > 0 else ())]
        return True

    def add_block_each(self, requests: Sequence[Request]) -> None:
        """One more GPU block for each request (decodes that begin a block), taken at once: the
        blocks `allocate(req, 1)` one by one would hand out. The caller has checked the free pool."""
        if requests:
            for req, block in zip(requests, self.pool.allocate(len(requests)), strict=True):
                req.block_ids = [*req.block_ids, block]  # a new list: plans share the old one

    def _free_taken(self, cached: Sequence[int]) -> int:
        """Cached blocks that sit in the free list: taking them uses up free blocks too."""
        return sum(1 for b in cached if self.pool.ref_cnt[b] == 0)

    def admission_need(self, req: Request) -> int:
        """Free GPU blocks a waiting request takes to hold its tokens (its cached prefix reused)."""
        if not self._prefix_in_use(req):
            return self.blocks_for(req.num_tokens)  # cached or not, each block it takes is free
        cached = self.cached_prefix(req)
        return self.blocks_for(req.num_tokens) - len(cached) + self._free_taken(cached)

    def prefill_blocks_floor(self, req: Request, budget: int) -> int:
        """At least the free GPU blocks a waiting request takes to prefill up to `budget` tokens
        after its cached prefix, known without a lookup: at best, each prefix block of its that
        another request holds is shared (a cached block in the free list still takes one)."""
        return self.blocks_for(min(req.num_tokens, budget)) - self._prefix_in_use(req)

    def _prefix_in_use(self, req: Request) -> int:
        """Blocks of the request's prefix that `cached_prefix` could find whose content another
        request holds: the most it can share without taking a free block."""
        if not self.pool.in_use:
            return 0
        prefix = self.update_hashes(req)[: (req.num_tokens - 1) // self.block_size]
        return len(self.pool.in_use.intersection(prefix))

    def growth_blocks(self, req: Request, num_new_tokens: int) -> int:
        """GPU blocks a running request needs to compute `num_new_tokens` more tokens."""
        return max(0, self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids))

    def owned_blocks(self, req: Request) -> int:
        """GPU blocks that freeing the request would really free (shared prefix blocks stay)."""
        return sum(1 for b in req.block_ids if self.pool.ref_cnt[b] == 1)

    def commit_full_blocks(self, req: Request, start: int, end: int) -> None:
        """Register the blocks that a step computing tokens [start, end) filled in the prefix cache."""
        bs = self.block_size
        if not self.enable_prefix_caching or end // bs == start // bs:
            return  # no block filled up in this step
        hashes, block_ids, register = self.update_hashes(req), req.block_ids, self.pool.register
        for i in range(start // bs, min(end // bs, len(block_ids), len(hashes))):
            register(block_ids[i], hashes[i])

    def filled(self, requests: Sequence[Request], indices: Sequence[int]) -> None:
        """Each request's decode row filled its block at the index beside it (the step is done).
        Such a block is registered in the prefix cache when the request releases it (finished,
        preempted or rotated out), in one pass over its blocks: while the request runs, its
        output is no other request's prefix, and hashing a block a row costs more than the rest
        of the row's update. (Prompt blocks are registered as their chunks complete:
        `commit_full_blocks`.)"""
        for req, index in zip(requests, indices, strict=True):
            req.decoded_blocks = index + 1

    def _register_decoded(self, req: Request, defer: bool = False) -> None:
        """Register the full blocks the request's completed decode rows filled, before it
        releases them (with `defer`, for good: hashed once a lookup could find them). Those
        already registered (prompt blocks, blocks from the cache or copied in) end the backward
        scan."""
        final = min(req.decoded_blocks, len(req.block_ids))
        req.decoded_blocks = 0
        if not self.enable_prefix_caching or final <= 0:
            return
        blocks, hash_of = req.block_ids, self.pool.hash_of
        first = final
        while first > 0 and hash_of[blocks[first - 1]] is None:
            first -= 1
        if first == final:
            return
        if defer and len(req.block_hashes) >= first:
            parent = req.block_hashes[first - 1] if first else b""
            bs = self.block_size
            self.pool.defer_hashes(UnhashedRun(parent, blocks[first:final], req.token_ids[first * bs : final * bs]))
        else:
            self.pool.register_all(blocks[first:final], self.update_hashes(req)[first:final])

    def free(self, req: Request) -> None:
        """Release the request's blocks in both tiers, tail first so shared prefixes go last.

        Blocks an unfinished copy touches stay quarantined until its step completes.
        """
        self._forget_swap_out(req)
        self._register_decoded(req, defer=True)
        self.pool.release(reversed(req.block_ids), req.last_step)
        req.block_ids = []
        if self.cpu:
            self.cpu.release(reversed(req.cpu_block_ids))
            if req.cpu_tail is not None:
                self.cpu.release([req.cpu_tail])
        req.cpu_block_ids = []
        req.cpu_tail = None

    # --- the CPU tier ------------------------------------------------------------------------
    def unwritten_blocks(self, req: Request, complete_tokens: int) -> int:
        """Full blocks of the request's first `complete_tokens` tokens with no CPU copy yet."""
        return max(0, min(complete_tokens // self.block_size, len(req.block_ids)) - len(req.cpu_block_ids))

    def write_through(
        self, req: Request, budget: int, step: int, complete_tokens: int | None = None
    ) -> list[tuple[int, int]]:
        """Copy up to `budget` of the request's newly full GPU blocks to the CPU tier in `step`.

        Only blocks full within the first `complete_tokens` tokens (default: all computed ones)
        are copied: KV the step being planned will write is not final yet. Returns (gpu block,
        cpu block) copies. A block whose content the CPU tier already holds (same prefix hash)
        is shared, not copied. Only prompt blocks are looked up and registered in the tier: a
        running request's output is no other request's (its hashes are computed when it rotates
        out). A block an unfinished copy touches is not copied (a copy-in may still be writing
        it): the copies stop there until that copy is done.
        """
        copies: list[tuple[int, int]] = []
        done = req.num_computed_tokens if complete_tokens is None else complete_tokens
        first, full = len(req.cpu_block_ids), min(done // self.block_size, len(req.block_ids))
        if self.cpu is None or full <= first:
            return copies  # nothing newly full (the common decode step)
        prompt_full = len(req.prompt_token_ids) // self.block_size
        hashes = self._prompt_hashes(req, prompt_full) if prompt_full > first else []
        copying = self.pool.copying
        for i in range(first, full):
            known = self.cpu.lookup(hashes[i]) if i < prompt_full else None
            if known is not None:
                self.cpu.touch(known)
                req.cpu_block_ids.append(known)
                continue
            if len(copies) >= budget or self.cpu.num_free == 0 or req.block_ids[i] in copying:
                break
            (block,) = self.cpu.allocate(1)
            if i < prompt_full:
                self.cpu.register(block, hashes[i])
            req.cpu_block_ids.append(block)
            copies.append((req.block_ids[i], block))
        self._copying((g for g, _ in copies), (c for _, c in copies), step)
        return copies

    def write_through_all(
        self, targets: Sequence[tuple[Request, int]], budget: int, step: int
    ) -> tuple[list[Request], list[tuple[int, int]]]:
        """`write_through` of each (request, complete tokens) in turn while `budget` lasts: the
        requests that got copies, and all the copies, in order. Newly full blocks of decodes are
        new content: then the CPU blocks for all of them are taken at once; if a prompt block's
        content is in the tier already, one by one."""
        planned = self._plan_new_copies(targets, budget)
        if planned is None:
            copied: list[Request] = []
            copies: list[tuple[int, int]] = []
            for req, complete in targets:
                if budget <= len(copies):
                    break
                own = self.write_through(req, budget - len(copies), step, complete)
                if own:
                    copied.append(req)
                    copies += own
            return copied, copies
        return self._copy_planned(*planned, step)

    def write_through_outputs(
        self, targets: Iterable[tuple[Request, int, int]], step: int
    ) -> tuple[list[Request], list[tuple[int, int]]]:
        """`write_through_all` for (request, first block, blocks) whose blocks are all output
        blocks (past the prompt's full blocks: no hash, no lookup) and fit the transfer budget
        and the CPU tier's free blocks (the caller checked): the steady state of a decode batch,
        without the per-block look at the tier. A request's copies stop at its first block that
        an unfinished copy touches, as `write_through`'s do."""
        copying = self.pool.copying
        planned: list[tuple[Request, int, int]] = []
        total = 0
        for req, first, n in targets:
            if copying:
                n = _before_copying(req.block_ids, first, n, copying)
            if n:
                planned.append((req, first, n))
                total += n
        return self._copy_planned(planned, [None] * total, step)

    def _copy_planned(
        self, planned: list[tuple[Request, int, int]], hashes: list[bytes | None], step: int
    ) -> tuple[list[Request], list[tuple[int, int]]]:
        """Copy each (request, first block, blocks) to CPU blocks taken at once, registering
        those with a hash (prompt blocks) in the tier's index."""
        assert self.cpu is not None
        blocks = self.cpu.allocate(len(hashes))
        if any(hashes):
            self.cpu.register_all([b for b, h in zip(blocks, hashes, strict=True) if h], [h for h in hashes if h])
        sources: list[int] = []
        copied: list[Request] = []
        taken = 0
        for req, first, n in planned:
            req.cpu_block_ids += blocks[taken : taken + n]
            sources += req.block_ids[first : first + n]
            taken += n
            copied.append(req)
        self._copying(sources, blocks, step)
        return copied, list(zip(sources, blocks, strict=True))

    def _plan_new_copies(
        self, targets: Sequence[tuple[Request, int]], budget: int
    ) -> tuple[list[tuple[Request, int, int]], list[bytes | None]] | None:
        """(request, first block, blocks) that `write_through` one by one would copy, and those
        blocks' hashes in order (None for an output block: not looked up), provided none of the
        prompt blocks it would look at has content the CPU tier holds (or may hold: a
        quarantined block's), or shares content with another of them; else None. Without such
        hits, nothing but the copies changes the tier in between, so one allocation for all
        hands out the same blocks."""
        if self.cpu is None:
            return [], []
        bs, cached, copying = self.block_size, self.cpu.cached, self.pool.copying
        limit = min(budget, self.cpu.num_free)
        planned: list[tuple[Request, int, int]] = []
        hashes: list[bytes | None] = []  # of the blocks to copy, in order
        seen: set[bytes] = set()
        for req, complete in targets:
            if len(hashes) >= budget:
                break
            first, full = len(req.cpu_block_ids), min(complete // bs, len(req.block_ids))
            if full <= first:
                continue
            prompt_full = len(req.prompt_token_ids) // bs
            own = self._prompt_hashes(req, prompt_full) if prompt_full > first else []
            block_ids, before = req.block_ids, len(hashes)
            for i in range(first, min(full, prompt_full)):
                h = own[i]
                if h in seen or h in cached:
                    return None
                if len(hashes) >= limit or block_ids[i] in copying:
                    break
                seen.add(h)
                hashes.append(h)
            else:  # its output blocks (no hash, no lookup), at once
                start = max(first, prompt_full)
                n = max(0, min(full - start, limit - len(hashes)))
                if copying:
                    n = _before_copying(block_ids, start, n, copying)
                hashes += repeat(None, n)
            if len(hashes) > before:
                planned.append((req, first, len(hashes) - before))
        return planned, hashes

    def _copying(self, gpu_blocks: Iterable[int], cpu_blocks: Iterable[int], step: int) -> None:
        self.pool.copied(gpu_blocks, step)
        self.cpu.copied(cpu_blocks, step)

    def swap_out_cost(self, req: Request) -> int:
        """Blocks to copy to rotate the request out: full blocks not yet written through, plus
        the partial tail."""
        full = req.num_computed_tokens // self.block_size
        tail = 1 if req.num_computed_tokens % self.block_size else 0
        return full - len(req.cpu_block_ids) + tail

    def swap_out(self, req: Request, step: int) -> list[tuple[int, int]] | None:
        """Move the request's KV to the CPU tier: copies (gpu, cpu), or None if it does not fit.

        Blocks this step copies out are quarantined until `step` is done; blocks already written
        through are clean and free at once (no copy reads them). Full blocks keep their prefix
        hash, so the request can find them again on its way back.
        """
        if self.cpu is None or self.swap_out_cost(req) > self.cpu.num_free:
            return None
        if self.pool.copying and not self.pool.copying.keys().isdisjoint(req.block_ids[len(req.cpu_block_ids) :]):
            return None  # a copy-in may still be writing one of its blocks: not before it is done
        copies = self.write_through(req, len(req.block_ids), step)
        if req.num_computed_tokens % self.block_size:
            (tail,) = self.cpu.allocate(1)
            req.cpu_tail = tail
            copies.append((req.block_ids[req.num_computed_tokens // self.block_size], tail))
            self._copying([copies[-1][0]], [tail], step)
        self._register_decoded(req)
        self.pool.release(reversed(req.block_ids), req.last_step)
        req.block_ids = []
        self.swapped_out.add(req)
        self.pool.watch(self._full_hashes(req))
        return copies

    def _full_hashes(self, req: Request) -> list[bytes]:
        """The hashes of the full blocks the request has copies of in the CPU tier."""
        return self.update_hashes(req)[: len(req.cpu_block_ids)]

    def _forget_swap_out(self, req: Request) -> None:
        if req in self.swapped_out:
            self.swapped_out.remove(req)
            self.pool.unwatch(self._full_hashes(req))

    def swap_in_need(self, req: Request, num_new_tokens: int) -> tuple[int, int]:
        """(free GPU blocks taken, blocks copied) to bring a rotary request back and compute
        `num_new_tokens`."""
        return self.swap_in_blocks(req, num_new_tokens), self.swap_in_copies(req)

    def swap_in_blocks(self, req: Request, num_new_tokens: int) -> int:
        """Free GPU blocks a rotary request takes to come back and compute `num_new_tokens`: all
        its blocks but the full ones another request holds on the GPU (its own blocks still
        cached in the free list are reused, yet leave the free list). Checked for every rotary
        request every step under contention: without a lookup per block, and without any
        while no swapped-out request's content is in use."""
        blocks = self.blocks_for(req.num_computed_tokens + num_new_tokens)
        if req in self.swapped_out and not self.pool.watched_in_use:
            return blocks
        return blocks - len(self.pool.in_use.intersection(self._full_hashes(req)))

    def swap_in_copies(self, req: Request) -> int:
        """Blocks copied to bring a rotary request back: its full blocks no longer cached on the
        GPU, and its partial tail."""
        misses = self.pool.lookup_all(self._full_hashes(req)).count(None)
        return misses + (req.cpu_tail is not None)

    def swap_in_copies_bound(self, req: Request) -> int:
        """At least swap_in_copies, without looking at the GPU cache: every CPU block and the tail."""
        return len(req.cpu_block_ids) + (req.cpu_tail is not None)

    def swap_in(self, req: Request, num_new_tokens: int, step: int) -> SwapIn:
        """Bring a rotary request's KV back: the copies, and what they must wait for.

        The caller has checked `swap_in_need` against the free pool. Its own full blocks still
        cached on the GPU are reused without a copy.
        """
        self._forget_swap_out(req)
        hashes = req.block_hashes
        # Take the blocks still cached on the GPU first: allocating a miss before them could
        # evict one of them (they sit in the free list) and turn a hit into another copy.
        hits = self.pool.lookup_all(hashes[: len(req.cpu_block_ids)])
        for block in hits:
            if block is not None:
                self.pool.touch(block)
        sources = [c for c, hit in zip(req.cpu_block_ids, hits, strict=True) if hit is None]
        if req.cpu_tail is not None:
            sources.append(req.cpu_tail)
        dests, after_compute, after_copy = self.pool.allocate_for_copy(len(sources))
        num_full = len(hits)
        if num_full == len(sources) - (req.cpu_tail is not None):  # no hit: the common case
            req.block_ids.extend(dests)
            if self.enable_prefix_caching:
                self.pool.register_all(dests[:num_full], hashes[:num_full])
        else:
            fresh = iter(dests)
            for i, block in enumerate(hits):
                if block is None:
                    block = next(fresh)
                    if self.enable_prefix_caching:
                        self.pool.register(block, hashes[i])
                req.block_ids.append(block)
            if req.cpu_tail is not None:
                req.block_ids.append(next(fresh))
        copies = list(zip(sources, dests, strict=True))
        after_copy = max(after_copy, newest_fence(sources, self.cpu.copying))
        if copies:
            self._copying(dests, sources, step)
        if req.cpu_tail is not None:
            self.cpu.release([req.cpu_tail])  # quarantined: this step's copy-in reads it
            req.cpu_tail = None
        growth = self.growth_blocks(req, num_new_tokens)
        if growth:
            req.block_ids.extend(self.pool.allocate(growth))
        return SwapIn(copies, after_compute, after_copy)
