"""Reference-counted pool of KV block ids (pure Python, one per worker, engine thread only).

A block id indexes the first dimension of the backing tensor `[num_blocks, block_stride]`.
`allocate` hands out ids with refcount 1; `incref` adds a holder (a transfer lease, a shared
prefix); `free` drops one holder and returns the id to the free list when none is left, so
blocks are reused only after every in-flight transfer that holds them has released them.
"""

from __future__ import annotations

from collections.abc import Iterable

from dsv4.errors import OutOfBlocks


class BlockPool:
    """Owned by `KVCacheManager`; tests use it directly. Not thread-safe (engine thread)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        # LIFO: recently freed (cache-warm) ids are reused first; pop() takes from the end.
        self._free_ids = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_ids)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free ids (refcount 1 each), all or nothing.

        Called by `KVCacheManager`; raises `OutOfBlocks` and changes nothing when too few are
        free.
        """
        if num_blocks > len(self._free_ids):
            raise OutOfBlocks(
                f"need {num_blocks} KV blocks, {len(self._free_ids)} of {self.num_blocks} free"
            )
        if num_blocks <= 0:
            return []
        block_ids = self._free_ids[-num_blocks:][::-1]
        del self._free_ids[-num_blocks:]
        for block_id in block_ids:
            self._refcounts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each (already allocated) id, e.g. a KV transfer lease."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if self._refcounts[block_id] <= 0:
                raise ValueError(f"incref of free block {block_id}")
        for block_id in block_ids:
            self._refcounts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each id; ids whose last holder left go back to the free list.

        Raises `ValueError` (a bug in the caller) on a double free, before changing anything.
        """
        block_ids = list(block_ids)
        drops: dict[int, int] = {}
        for block_id in block_ids:
            drops[block_id] = drops.get(block_id, 0) + 1
            if drops[block_id] > self._refcounts[block_id]:
                raise ValueError(f"double free of block {block_id}")
        # Reversed so that the next allocate pops them back in their original order.
        for block_id in reversed(block_ids):
            self._refcounts[block_id] -= 1
            if self._refcounts[block_id] == 0:
                self._free_ids.append(block_id)

    def find_leaks(self) -> list[str]:
        """Describe every block still held (empty list: all free). For leak checks in tests."""
        if self.num_used_blocks == 0:
            return []
        held = [i for i, count in enumerate(self._refcounts) if count]
        return [f"{len(held)} of {self.num_blocks} KV blocks still held: {held[:16]}"]

    def check_no_leaks(self) -> None:
        leaks = self.find_leaks()
        if leaks:
            raise AssertionError("; ".join(leaks))
