"""Per-request KV block bookkeeping on top of `BlockPool` (pure Python, engine thread only).

A request holds `layout.num_ring_blocks` ring blocks (sliding windows + compressor state rings,
fixed size) and one token block per `block_size` positions it has room for (compressed KV and
indexer keys; see `dsv4.cache.layout`). The scheduler calls `allocate` when it admits a
request, `append` before it schedules more tokens and `free` when the request finishes, is
aborted or is preempted. The KV hand-off uses `blocks_for_handoff` + `retain` on the sending
side and `adopt` on the receiving side.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dsv4.cache.block_pool import BlockPool
from dsv4.cache.layout import KVLayout
from dsv4.errors import NotFound


@dataclass
class _RequestBlocks:
    ring_block_ids: list[int]
    token_block_ids: list[int]
    num_tokens: int  # positions the token blocks have room for


class KVCacheManager:
    """One per worker, built at start-up with `layout.num_blocks_for_budget(...)` blocks;
    called by the scheduler (allocate / append / free) and the KV hand-off code."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}

    # ---- capacity --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_live_requests(self) -> int:
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a new request of `num_tokens` positions takes (ring + token blocks)."""
        return self.layout.num_blocks_for_request(num_tokens)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.num_blocks_needed(num_tokens) <= self.pool.num_free_blocks

    def num_append_blocks(self, request_id: str, num_new_tokens: int) -> int:
        """Extra token blocks `append(request_id, num_new_tokens)` would take."""
        entry = self._get(request_id)
        needed = self.layout.num_token_blocks(entry.num_tokens + num_new_tokens)
        return max(0, needed - len(entry.token_block_ids))

    def can_append(self, request_id: str, num_new_tokens: int) -> bool:
        return self.num_append_blocks(request_id, num_new_tokens) <= self.pool.num_free_blocks

    # ---- allocate / append / free ----------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> None:
        """Give a new request its ring blocks and room for `num_tokens` positions.

        All or nothing: raises `OutOfBlocks` (nothing taken) when the pool is short, and
        `ValueError` when the request already holds blocks.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        block_ids = self.pool.allocate(self.num_blocks_needed(num_tokens))
        ring = self.layout.num_ring_blocks
        self._requests[request_id] = _RequestBlocks(block_ids[:ring], block_ids[ring:], num_tokens)

    def append(self, request_id: str, num_new_tokens: int) -> None:
        """Grow the request's room by `num_new_tokens` positions (all or nothing)."""
        entry = self._get(request_id)
        new_blocks = self.pool.allocate(self.num_append_blocks(request_id, num_new_tokens))
        entry.token_block_ids.extend(new_blocks)
        entry.num_tokens += num_new_tokens

    def free(self, request_id: str) -> None:
        """Drop the request's hold on all its blocks. Unknown ids are ignored (idempotent),
        so abort paths may call it more than once. Blocks retained by a lease stay held."""
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.pool.free(entry.ring_block_ids + entry.token_block_ids)

    # ---- lookups for the runner ------------------------------------------------------------
    def block_table(self, request_id: str) -> tuple[int, ...]:
        """Token block ids in position order: block i covers positions [i*bs, (i+1)*bs)."""
        return tuple(self._get(request_id).token_block_ids)

    def ring_block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's ring blocks, indexed by `CacheRegion.ring_block_index`."""
        return tuple(self._get(request_id).ring_block_ids)

    def num_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_tokens

    # ---- KV hand-off -----------------------------------------------------------------------
    def blocks_for_handoff(self, request_id: str) -> tuple[int, ...]:
        """Every block that holds live state, ring blocks first, then token blocks in order.

        That is all of the request's blocks: the ring blocks hold only the window and the
        partial compressor state, and no compressed entry ever expires. The receiver's `adopt`
        returns its blocks in the same order, so the transfer is `src[i] -> dst[i]`.
        """
        entry = self._get(request_id)
        return tuple(entry.ring_block_ids + entry.token_block_ids)

    def retain(self, request_id: str) -> tuple[int, ...]:
        """Hold the hand-off blocks for a transfer lease (P side); pair with `release`."""
        block_ids = self.blocks_for_handoff(request_id)
        self.pool.incref(block_ids)
        return block_ids

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop a lease taken by `retain` (after the transfer finished or the lease expired)."""
        self.pool.free(block_ids)

    def adopt(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Receiving side: allocate blocks for a pulled request of `num_tokens` positions and
        return them in `blocks_for_handoff` order. Raises `OutOfBlocks` (nothing taken)."""
        self.allocate(request_id, num_tokens)
        return self.blocks_for_handoff(request_id)

    # ---- leak check ------------------------------------------------------------------------
    def find_leaks(self) -> list[str]:
        """Live requests and held blocks (empty list: clean). Used by `tests/leak.py`."""
        leaks = [
            f"{len(self._requests)} requests still hold KV blocks: {sorted(self._requests)[:8]}"
        ]
        return (leaks if self._requests else []) + self.pool.find_leaks()

    def check_no_leaks(self) -> None:
        leaks = self.find_leaks()
        if leaks:
            raise AssertionError("; ".join(leaks))

    def _get(self, request_id: str) -> _RequestBlocks:
        try:
            return self._requests[request_id]
        except KeyError:
            raise NotFound(f"request {request_id!r} holds no KV blocks") from None
