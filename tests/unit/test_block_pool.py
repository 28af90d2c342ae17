"""BlockPool: all-or-nothing allocation, refcounts, double-free detection, leak report."""

from __future__ import annotations

import pytest

from dsv4.cache import BlockPool
from dsv4.errors import OutOfBlocks
from tests.leak import assert_no_leaks


def test_allocate_free_counts_and_reuse() -> None:
    pool = BlockPool(8)
    first = pool.allocate(3)
    assert first == [0, 1, 2] and pool.num_used_blocks == 3 and pool.num_free_blocks == 5
    second = pool.allocate(5)
    assert sorted(first + second) == list(range(8)) and pool.num_free_blocks == 0
    pool.free(first)
    assert pool.allocate(3) == first  # freed ids come back first, in their order
    pool.free(first)
    pool.free(second)
    assert_no_leaks(pool)


def test_out_of_blocks_changes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free_blocks == 1 and pool.allocate(0) == []
    pool.free(held)
    assert_no_leaks(pool)


def test_incref_keeps_block_until_last_holder_frees() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.incref([block])
    assert pool.refcount(block) == 2
    pool.free([block])
    assert pool.num_free_blocks == 1 and pool.refcount(block) == 1
    pool.free([block])
    assert pool.refcount(block) == 0
    assert_no_leaks(pool)


def test_double_free_and_incref_of_free_block_are_rejected_atomically() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[0], ids[1], ids[1]])
    assert pool.refcount(ids[0]) == 1 and pool.refcount(ids[1]) == 1  # nothing changed
    with pytest.raises(ValueError, match="incref of free block"):
        pool.incref([ids[0], 2])
    assert pool.refcount(ids[0]) == 1
    pool.free(ids)
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[0]])
    assert_no_leaks(pool)


def test_leak_report_names_held_blocks() -> None:
    pool = BlockPool(4)
    held = pool.allocate(2)
    with pytest.raises(AssertionError, match="2 of 4 KV blocks still held"):
        assert_no_leaks(pool)
    pool.free(held)
    assert_no_leaks(pool)
