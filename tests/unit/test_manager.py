"""KVCacheManager: per-request ring + token blocks, growth, hand-off, leases, and a
hypothesis state machine over random allocate / append / free / lease sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dsv4.cache import CacheOptions, KVCacheManager, KVLayout
from dsv4.config.model import tiny_config
from dsv4.errors import NotFound, OutOfBlocks
from tests.leak import assert_no_leaks

LAYOUT = KVLayout.build(tiny_config(), CacheOptions(kv_dtype="bf16"))
RING = LAYOUT.num_ring_blocks
BS = LAYOUT.block_size


def test_allocate_append_free_grow_the_block_table() -> None:
    manager = KVCacheManager(LAYOUT, RING + 4)
    manager.allocate("a", 10)
    assert len(manager.ring_block_ids("a")) == RING and len(manager.block_table("a")) == 1
    manager.append("a", BS - 10)  # exactly fills the first token block
    assert len(manager.block_table("a")) == 1 and manager.num_tokens("a") == BS
    manager.append("a", 1)
    assert len(manager.block_table("a")) == 2
    assert manager.num_free_blocks == 2
    room = 4 * BS - manager.num_tokens("a")  # 2 held + 2 free token blocks
    assert manager.can_append("a", room) and not manager.can_append("a", room + 1)
    manager.free("a")
    manager.free("a")  # idempotent: abort paths may free twice
    assert_no_leaks(manager)


def test_allocation_is_all_or_nothing() -> None:
    manager = KVCacheManager(LAYOUT, RING + 1)
    assert manager.can_allocate(BS) and not manager.can_allocate(BS + 1)
    with pytest.raises(OutOfBlocks):
        manager.allocate("a", BS + 1)
    assert manager.num_free_blocks == RING + 1 and not manager.has_request("a")
    manager.allocate("a", 0)
    with pytest.raises(OutOfBlocks):
        manager.append("a", 2 * BS)
    assert manager.num_tokens("a") == 0 and manager.num_free_blocks == 1
    with pytest.raises(ValueError, match="already holds"):
        manager.allocate("a", 1)
    manager.free("a")
    with pytest.raises(NotFound):
        manager.block_table("a")
    assert_no_leaks(manager)


def test_handoff_moves_every_block_and_adopt_mirrors_its_order() -> None:
    prefill = KVCacheManager(LAYOUT, 2 * RING + 8)
    decode = KVCacheManager(LAYOUT, 2 * RING + 8)
    decode.allocate("other", 3)  # so the receiver's ids differ from the sender's
    prefill.allocate("r", 700)
    src = prefill.blocks_for_handoff("r")
    assert src == prefill.ring_block_ids("r") + prefill.block_table("r")
    assert len(src) == RING + 3
    dst = decode.adopt("r", 700)
    assert len(dst) == len(src) and set(dst).isdisjoint(decode.blocks_for_handoff("other"))
    assert dst == decode.ring_block_ids("r") + decode.block_table("r")
    assert LAYOUT.compacted_bytes(700) == len(src) * LAYOUT.block_stride_bytes
    decode.free("r")
    decode.free("other")
    prefill.free("r")
    assert_no_leaks(prefill, decode)


def test_lease_keeps_blocks_after_the_request_is_freed() -> None:
    manager = KVCacheManager(LAYOUT, RING + 2)
    manager.allocate("r", 300)
    leased = manager.retain("r")
    manager.free("r")  # the request finished on P; the transfer is still in flight
    assert manager.num_free_blocks == 0 and manager.num_live_requests == 0
    with pytest.raises(AssertionError, match="still held"):
        assert_no_leaks(manager)
    manager.release(leased)  # D pulled (or the lease expired)
    assert_no_leaks(manager)


class ManagerMachine(RuleBasedStateMachine):
    """Random request traffic against a small pool; the model is a dict of token counts."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(LAYOUT, 3 * RING + 6)
        self.tokens: dict[str, int] = {}
        self.leases: list[tuple[int, ...]] = []
        self.next_id = 0

    @rule(num_tokens=st.integers(0, 3 * BS))
    def allocate(self, num_tokens: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        fits = self.manager.can_allocate(num_tokens)
        try:
            self.manager.allocate(rid, num_tokens)
        except OutOfBlocks:
            assert not fits
            return
        assert fits
        self.tokens[rid] = num_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_new=st.integers(0, 2 * BS))
    def append(self, data: st.DataObject, num_new: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        fits = self.manager.can_append(rid, num_new)
        try:
            self.manager.append(rid, num_new)
        except OutOfBlocks:
            assert not fits
            return
        self.tokens[rid] += num_new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(rid)
        del self.tokens[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def retain(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.leases.append(self.manager.retain(rid))

    @precondition(lambda self: self.leases)
    @rule()
    def release(self) -> None:
        self.manager.release(self.leases.pop(0))

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        pool = self.manager.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        holders: dict[int, int] = {}
        for rid, num_tokens in self.tokens.items():
            blocks = self.manager.blocks_for_handoff(rid)
            assert len(blocks) == LAYOUT.num_blocks_for_request(num_tokens)
            assert self.manager.num_tokens(rid) == num_tokens
            for block in blocks:
                holders[block] = holders.get(block, 0) + 1
        for lease in self.leases:
            for block in lease:
                holders[block] = holders.get(block, 0) + 1
        for block in range(pool.num_blocks):
            assert pool.refcount(block) == holders.get(block, 0) >= 0
        # A block belongs to at most one live request (leases may add holders).
        owners = [b for rid in self.tokens for b in self.manager.blocks_for_handoff(rid)]
        assert len(owners) == len(set(owners))

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.manager.free(rid)
        for lease in self.leases:
            self.manager.release(lease)
        assert_no_leaks(self.manager)


ManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_manager_state_machine = ManagerMachine.TestCase
