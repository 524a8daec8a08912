"""KV block accounting: a block pool with reference counts and hash-chain prefix caching.

Pure bookkeeping over block ids; the tensors live in the runner. A block's content is the KV of
`block_size` consecutive tokens of a sequence across all layers (block-first layout), so a full
block is identified by the hash of its tokens chained with the hash of the block before it.
Freed blocks keep their hash and stay findable until they are handed out again (LRU eviction).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from superinfer.engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full block of tokens, chained with its parent block's hash."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockPool:
    """Fixed set of block ids with reference counts, an LRU free list and a prefix-hash index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks, evicting the least recently freed cached ones first."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._drop_hash(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, block: int) -> None:
        """Take one more reference to a block found in the prefix cache."""
        if self.ref_cnt[block] == 0:
            del self.free[block]
        self.ref_cnt[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the free list's tail."""
        for block in blocks:
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] < 0:
                raise RuntimeError(f"block {block} released more often than it was taken")
            if self.ref_cnt[block] == 0:
                self.free[block] = None

    def register(self, block: int, h: bytes) -> None:
        """Make a full block findable by its prefix hash (the first block with a hash keeps it)."""
        if self.hash_of[block] is None:
            self.hash_of[block] = h
            self.cached.setdefault(h, block)

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def _drop_hash(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.hash_of[block] = None


class KVCacheManager:
    """Per-request block tables over one pool (the GPU tier)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def update_hashes(self, req: Request) -> list[bytes]:
        """Extend the request's prefix hashes to every full block of its known tokens."""
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else b""
            req.block_hashes.append(block_hash(parent, req.token_ids[i * bs : (i + 1) * bs]))
        return req.block_hashes

    def cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding a prefix of the request's tokens, found in the cache.

        The last token is never served from the cache: its logits are needed to sample.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        found = []
        for h in self.update_hashes(req)[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            found.append(block)
        return found

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens after its cached prefix.

        Returns False, changing nothing, when the free pool cannot cover it.
        """
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_for(total) - len(req.block_ids) - len(cached)
        cached_free = sum(1 for b in cached if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free - cached_free:
            return False
        for block in cached:
            self.pool.touch(block)
        req.block_ids.extend(cached)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def commit_full_blocks(self, req: Request, num_computed_before: int) -> None:
        """Register the blocks that this step filled with computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        end = min(req.num_computed_tokens // bs, len(req.block_ids))
        hashes = self.update_hashes(req)
        for i in range(num_computed_before // bs, end):
            self.pool.register(req.block_ids[i], hashes[i])

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first so shared prefixes are evicted last."""
        self.pool.release(reversed(req.block_ids))
        req.block_ids = []
