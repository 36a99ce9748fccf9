"""BlockAllocator: the KV pool's free list, reference counts and prefix cache. Plain Python, no torch."""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A full block's identity: its tokens chained to everything before them.

    Two blocks share a hash only if their whole prefixes are equal, so a hit can reuse the K/V
    (which depend on every earlier token) as they are.
    """
    return hashlib.blake2b((parent or b"") + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockAllocator:
    """Hands out KV block ids from a free list and takes them back.

    A block is either free (reference count 0, on the free list) or owned (count >= 1, off
    it). Counts above one are for sharing (prefix caching). Freed blocks go to the back
    of the free list, so allocation order is first-in first-out and tests can assert exact ids.

    Prefix cache: a full block may carry a hash (see hash_block). It stays findable after its
    last owner frees it, while it sits on the free list, and is evicted only when allocate hands
    it out again: the front of the free list is the least recently freed, so eviction is LRU.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding those tokens' K/V

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self.free_ids)

    def allocate(self, num: int) -> list[int]:
        """Takes `num` blocks off the free list. Callers check can_allocate first."""
        if num > len(self.free_ids):
            raise RuntimeError(f"asked for {num} blocks with {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(num)]
        for block_id in ids:
            self.ref_counts[block_id] = 1
            block_hash = self.block_hashes[block_id]
            if block_hash is not None:  # evict: its old contents are about to be overwritten
                del self.cached[block_hash]
                self.block_hashes[block_id] = None
        return ids

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def take_cached(self, block_id: int) -> None:
        """Adds an owner to a cached block, taking it off the free list if nobody held it."""
        if self.ref_counts[block_id] == 0:
            self.free_ids.remove(block_id)
        self.ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Records that an owned, full block holds the tokens block_hash names (first holder wins)."""
        if block_hash not in self.cached and self.block_hashes[block_id] is None:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash

    def share(self, block_id: int) -> None:
        """Adds one owner to an owned block."""
        assert self.ref_counts[block_id] > 0, f"block {block_id} is free and cannot be shared"
        self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drops one owner from each block; a block with no owner left returns to the pool."""
        for block_id in reversed(block_ids):  # tail blocks first: least likely to be reused
            count = self.ref_counts[block_id]
            assert count > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self.free_ids.append(block_id)

    def check_invariants(self, owners: dict[str, list[int]] | None = None) -> None:
        """Every block is free xor owned, and counts agree with the owners given.

        Args:
            owners: request id -> block ids it holds. When given, each block's reference count
                must equal the number of times owners list it.
        Raises:
            AssertionError: naming the first block that breaks the invariant.
        """
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        for block_id, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {block_id} has count {count}"
            assert (count == 0) == (block_id in free), f"block {block_id}: count {count}, free={block_id in free}"
        for block_hash, block_id in self.cached.items():
            assert self.block_hashes[block_id] == block_hash, f"block {block_id} is cached under a stale hash"
        assert sum(h is not None for h in self.block_hashes) == len(self.cached), "a hashed block is not cached"
        if owners is not None:
            expected = [0] * self.num_blocks
            for ids in owners.values():
                for block_id in ids:
                    expected[block_id] += 1
            for block_id, (want, got) in enumerate(zip(expected, self.ref_counts, strict=True)):
                assert want == got, f"block {block_id}: owners hold it {want} times, count is {got}"
