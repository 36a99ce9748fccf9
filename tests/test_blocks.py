"""BlockAllocator: exact free-list order, reference counts, and the invariant check.

Every expected id below is worked out from the rule the allocator documents: blocks start on
the free list as 0..N-1, allocation takes from the front, and free() returns a request's blocks
tail first to the back of the list.
"""

from __future__ import annotations

import pytest

from nanoserve.blocks import BlockAllocator


def test_fresh_pool_hands_out_ids_in_order():
    allocator = BlockAllocator(5)
    assert allocator.allocate(2) == [0, 1]
    assert allocator.allocate(1) == [2]
    assert allocator.allocate(2) == [3, 4]
    assert allocator.num_free == 0
    assert allocator.ref_counts == [1, 1, 1, 1, 1]


def test_freed_blocks_go_to_the_back_tail_first():
    allocator = BlockAllocator(6)
    first = allocator.allocate(3)  # [0, 1, 2]; free list now [3, 4, 5]
    assert first == [0, 1, 2]
    allocator.free(first)  # appended tail first: 2, 1, 0
    assert list(allocator.free_ids) == [3, 4, 5, 2, 1, 0]
    assert allocator.allocate(4) == [3, 4, 5, 2]
    assert allocator.allocate(2) == [1, 0]
    allocator.check_invariants({"a": [3, 4, 5, 2], "b": [1, 0]})


def test_interleaved_frees_keep_fifo_order():
    allocator = BlockAllocator(4)
    a = allocator.allocate(1)  # [0]
    b = allocator.allocate(2)  # [1, 2]
    allocator.free(a)  # free list [3, 0]
    allocator.free(b)  # free list [3, 0, 2, 1]
    assert list(allocator.free_ids) == [3, 0, 2, 1]
    assert allocator.allocate(4) == [3, 0, 2, 1]


def test_share_counts_and_free_of_a_shared_block_keeps_it_owned():
    allocator = BlockAllocator(4)
    (block,) = allocator.allocate(1)
    assert block == 0
    allocator.share(block)
    allocator.share(block)
    assert allocator.ref_counts[0] == 3
    allocator.check_invariants({"a": [0], "b": [0], "c": [0]})

    allocator.free([block])  # c lets go: a and b still hold it
    assert allocator.ref_counts[0] == 2
    assert 0 not in allocator.free_ids
    assert allocator.num_free == 3
    allocator.check_invariants({"a": [0], "b": [0]})
    assert allocator.allocate(3) == [1, 2, 3]  # the shared block is not handed out again

    allocator.free([block])
    allocator.free([block])  # last owner: back to the pool
    assert allocator.ref_counts[0] == 0
    assert list(allocator.free_ids) == [0]
    allocator.check_invariants({"d": [1, 2, 3]})


def test_share_of_a_free_block_is_refused():
    allocator = BlockAllocator(2)
    with pytest.raises(AssertionError, match="block 1 is free"):
        allocator.share(1)


def test_double_free_is_caught():
    allocator = BlockAllocator(3)
    ids = allocator.allocate(2)
    allocator.free(ids)
    with pytest.raises(AssertionError, match="block 1 freed twice"):  # tail first: block 1 is checked first
        allocator.free(ids)


@pytest.mark.parametrize("num, fits", [(0, True), (1, True), (3, True), (4, False), (100, False)])
def test_can_allocate_boundaries_on_a_fresh_pool(num, fits):
    assert BlockAllocator(3).can_allocate(num) is fits


def test_can_allocate_tracks_the_free_count():
    allocator = BlockAllocator(3)
    allocator.allocate(1)
    assert allocator.can_allocate(2) and not allocator.can_allocate(3)
    allocator.allocate(2)
    assert allocator.can_allocate(0) and not allocator.can_allocate(1)
    with pytest.raises(RuntimeError, match="asked for 1 blocks with 0 free"):
        allocator.allocate(1)


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_pool_size_below_one_is_refused(num_blocks):
    with pytest.raises(ValueError, match=f"num_blocks={num_blocks} must be >= 1"):
        BlockAllocator(num_blocks)


# ---- the invariant check catches corrupted states ----------------------------------------------


def test_check_invariants_passes_on_a_consistent_state():
    allocator = BlockAllocator(5)
    a = allocator.allocate(2)
    b = allocator.allocate(1)
    allocator.share(a[1])
    allocator.check_invariants()
    allocator.check_invariants({"a": a, "b": b, "c": [a[1]]})


def test_check_invariants_catches_a_block_listed_free_twice():
    allocator = BlockAllocator(3)
    allocator.allocate(1)  # block 0 owned
    allocator.free_ids.append(1)  # a double free that bypassed free(): 1 is now listed twice
    with pytest.raises(AssertionError, match="free list twice"):
        allocator.check_invariants()


def test_check_invariants_catches_an_owned_block_on_the_free_list():
    allocator = BlockAllocator(3)
    allocator.allocate(1)  # block 0 owned
    allocator.free_ids.append(0)  # corrupted: count 1 but also free
    with pytest.raises(AssertionError, match="block 0: count 1, free=True"):
        allocator.check_invariants()


def test_check_invariants_catches_a_free_block_missing_from_the_free_list():
    allocator = BlockAllocator(3)
    allocator.free_ids.remove(2)  # leaked: count 0 but nowhere to be found
    with pytest.raises(AssertionError, match="block 2: count 0, free=False"):
        allocator.check_invariants()


def test_check_invariants_catches_a_negative_count():
    allocator = BlockAllocator(2)
    allocator.ref_counts[1] = -1
    with pytest.raises(AssertionError, match="block 1 has count -1"):
        allocator.check_invariants()


def test_check_invariants_catches_owners_that_disagree_with_the_counts():
    allocator = BlockAllocator(4)
    a = allocator.allocate(2)  # [0, 1]
    with pytest.raises(AssertionError, match="block 1: owners hold it 0 times, count is 1"):
        allocator.check_invariants({"a": [0]})  # an owner forgot block 1: a leak
    with pytest.raises(AssertionError, match="block 0: owners hold it 2 times, count is 1"):
        allocator.check_invariants({"a": a, "b": [0]})  # two owners without a share
    with pytest.raises(AssertionError, match="block 2: owners hold it 1 times, count is 0"):
        allocator.check_invariants({"a": a, "b": [2]})  # an owner of a free block
