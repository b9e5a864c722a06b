import pytest

from servescope.kvcache.block_allocator import BlockAllocator, NoFreeBlocksError


def test_allocate_in_order_and_exhaust():
    a = BlockAllocator(3)
    assert [a.allocate(), a.allocate(), a.allocate()] == [0, 1, 2]
    assert a.num_free == 0
    assert [a.ref_count(b) for b in range(3)] == [1, 1, 1]
    with pytest.raises(NoFreeBlocksError):
        a.allocate()


def test_refcounts_and_release_fifo():
    a = BlockAllocator(4)
    b0, b1 = a.allocate(), a.allocate()
    assert a.incref(b0) == 2
    assert a.decref(b0) == 1
    assert a.decref(b0) == 0
    assert not a.is_free(b0)  # held until released
    a.release(b0)
    assert a.is_free(b0)
    assert a.free_block_ids() == [2, 3, 0]
    assert a.allocate() == 2
    assert a.ref_count(b1) == 1


def test_misuse_is_caught():
    a = BlockAllocator(2)
    with pytest.raises(AssertionError):
        a.incref(0)  # on the free list
    b = a.allocate()
    with pytest.raises(AssertionError):
        a.release(b)  # still referenced
    a.decref(b)
    with pytest.raises(AssertionError):
        a.decref(b)  # below zero
    # a held block (ref 0, off the free list) may be revived: this is a prefix-cache hit
    assert a.incref(b) == 1
