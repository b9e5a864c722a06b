"""KVCacheManager.block_map(): each block's state and owner, on plain integers, and its counts
agree with the manager's own (num_used / num_free / num_cached / num_evictable)."""

from servescope.kvcache.manager import BLOCK_CACHED, BLOCK_EVICTABLE, BLOCK_FREE, BLOCK_USED

from test_kv_cache_manager import Seq, admit, make  # pytest puts this folder on sys.path (no __init__.py)

F, U, C, E = BLOCK_FREE, BLOCK_USED, BLOCK_CACHED, BLOCK_EVICTABLE


def _agrees(m):
    states, _ = m.block_map()
    assert states.count(F) + states.count(E) == m.num_free_blocks
    assert states.count(U) + states.count(C) == m.num_used_blocks
    assert states.count(C) + states.count(E) == m.num_cached_blocks
    assert states.count(E) == m.num_evictable_blocks


def test_states_and_owners_through_sharing_and_freeing():
    m = make(num_blocks=8, block_size=4)
    assert m.block_map() == ([F] * 8, [None] * 8)
    a = Seq("a", range(10))  # blocks 0, 1 full (cached), block 2 partly filled (private)
    admit(m, a)
    assert m.block_map() == ([C, C, U, F, F, F, F, F], ["a", "a", "a", None, None, None, None, None])
    b = Seq("b", list(range(8)) + [99, 98])  # shares a's two full blocks, then its own block 3
    blocks, n = admit(m, b)
    assert (blocks, n) == ([0, 1], 8)
    states, owners = m.block_map()
    assert states == [C, C, U, U, F, F, F, F]
    assert owners[:4] == ["a", "a", "a", "b"]  # a shared block names one of its holders
    _agrees(m)
    m.free(a)
    m.free(b)  # the full blocks stay findable: evictable; the partly filled ones go free
    assert m.block_map() == ([E, E, F, F, F, F, F, F], [None] * 8)
    _agrees(m)


def test_counts_agree_under_eviction_pressure():
    m = make(num_blocks=6, block_size=2)
    for i in range(5):
        s = Seq(f"r{i}", [i] * 5)
        admit(m, s)
        _agrees(m)
        m.free(s)
        _agrees(m)
    states, owners = m.block_map()
    assert U not in states and C not in states and set(owners) == {None}


def test_no_prefix_caching_means_no_cached_blocks():
    m = make(num_blocks=4, block_size=2, caching=False)
    admit(m, Seq("x", range(4)))
    assert m.block_map() == ([U, U, F, F], ["x", "x", None, None])
    _agrees(m)
