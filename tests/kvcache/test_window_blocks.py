"""KVCacheManager with a window (every layer windowed): blocks that slid out of the window go back to the
allocator, a decoding sequence holds at most cdiv(window, S) + 1 blocks whatever its length, and prefix
hits stay correct (plain integers)."""

import pytest

from servescope.config import CacheConfig
from servescope.kvcache.manager import NO_BLOCK, KVCacheManager, cdiv
from servescope.kvcache.prefix_cache import hash_full_blocks

from test_kv_cache_manager import Seq, admit  # tests/kvcache, on sys.path as the test file's folder


def make(num_blocks, block_size, window, caching=True):
    return KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
                          window=window)


def decode(m, seq, steps):
    """`steps` decode steps: one new token each, as the scheduler and the model do."""
    most = 0
    for i in range(steps):
        seq.all_token_ids.append(10_000 + i)
        assert m.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        most = max(most, m.num_held_blocks(seq.request_id))
    m.check_invariants()
    return most


@pytest.mark.parametrize("window,block_size", [(4096, 16), (64, 16), (40, 16), (16, 16), (5, 4)])
def test_a_windowed_sequence_holds_at_most_window_over_block_size_plus_one(window, block_size):
    chunk = 24
    m = make(num_blocks=cdiv(window, block_size) + cdiv(chunk, block_size) + 1, block_size=block_size, window=window)
    seq = Seq("a", range(100))
    admit(m, seq, chunk=chunk)  # a chunked prefill (the cache would not hold 100 tokens at once) ...
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert m.allocate_slots(seq, n)
        seq.num_computed_tokens += n
        m.check_invariants()
    most = decode(m, seq, 8192 - 100)  # ... and decodes to 8k context on a cache far smaller than 8k tokens
    assert seq.num_computed_tokens == 8192
    assert most <= cdiv(window, block_size) + 1
    table = m.get_block_ids("a")
    assert len(table) == cdiv(8192, block_size)  # block i is still tokens [i*S, (i+1)*S)
    first_visible = 8191 - window + 1  # of the last query (at 8191): blocks go back at the next allocation
    # every block holding a position that query saw is held; every one wholly before it is not
    for i, b in enumerate(table):
        assert (b == NO_BLOCK) == ((i + 1) * block_size <= first_visible), (i, b)
    m.free(seq)
    m.check_invariants()
    assert m.num_used_blocks == 0


def test_without_a_window_every_block_stays():
    m = make(num_blocks=40, block_size=16, window=0)
    seq = Seq("a", range(20))
    admit(m, seq)
    decode(m, seq, 500)
    assert m.num_held_blocks("a") == cdiv(520, 16) and NO_BLOCK not in m.get_block_ids("a")


def test_slid_out_blocks_are_freed_or_evictable_and_reused():
    m = make(num_blocks=6, block_size=4, window=8)
    a = Seq("a", range(8))
    admit(m, a)
    decode(m, a, 30)  # 38 tokens: far more than 6 blocks' 24 without the window
    assert m.num_held_blocks("a") <= cdiv(8, 4) + 1
    # the slid-out blocks were hashed (prefix caching): they wait as evictable, still findable
    assert m.num_evictable_blocks > 0 and m.num_free_blocks == 6 - m.num_held_blocks("a")
    b = Seq("b", range(100, 112))  # another request takes them over (3 blocks: the ones a gave back)
    admit(m, b)
    m.check_invariants()


def test_a_prefix_hit_takes_only_the_blocks_in_view():
    m = make(num_blocks=16, block_size=4, window=6)
    a = Seq("a", range(24))
    admit(m, a)  # 6 full blocks, hashed; all but the last two slide out when a decodes on
    decode(m, a, 1)
    b = Seq("b", list(range(24)) + [7, 7, 7])
    blocks, n = m.get_computed_blocks(b)
    # b's first new token (position 24) sees keys 19 on: blocks 4 and 5; the hit does not take blocks 0-3
    hashes = m._request_hashes(b, 6)
    assert n == 24 and blocks == [NO_BLOCK] * 4 + [m.prefix_cache.lookup(h) for h in hashes[4:6]]
    admit(m, b)
    assert m.get_block_ids("b")[:6] == blocks
    m.check_invariants()
    m.free(a)
    m.free(b)
    m.check_invariants()


def evict(m, token_ids, indices):
    """Evict the cached blocks of token_ids' full blocks `indices` (as the LRU does for another request)."""
    hashes = hash_full_blocks(token_ids, m.block_size)
    for i in indices:
        b = m.prefix_cache.lookup(hashes[i])
        m.prefix_cache.take(b)
        m.prefix_cache.uncache(b)
        m.allocator.release(b)


@pytest.mark.parametrize("evicted,hit", [((), 6), ((0, 1), 6), ((0, 1, 2, 3), 6), ((5,), 5), ((4,), 4), ((2, 5), 5),
                                         ((3, 5), 3), ((0, 1, 2, 3, 4, 5), 0)])
def test_evicted_blocks_end_the_hit_only_where_the_window_reads_them(evicted, hit):
    """Window 6, blocks of 4: a hit of n blocks reads blocks (4n - 5) // 4 .. n - 1 (the keys its first new
    token sees). The blocks at the chain's start go first in the LRU; losing them costs nothing."""
    m = make(num_blocks=16, block_size=4, window=6)
    a = Seq("a", range(24))
    admit(m, a)
    decode(m, a, 1)
    m.free(a)
    evict(m, range(24), evicted)
    m.check_invariants()
    c = Seq("c", list(range(24)) + [9])
    blocks, n = m.get_computed_blocks(c)
    assert n == 4 * hit and len(blocks) == hit
    first = max(0, 4 * hit - 6 + 1) // 4
    assert all(b == NO_BLOCK for b in blocks[:first]) and NO_BLOCK not in blocks[first:]
    admit(m, c)
    decode(m, c, 6)
    m.free(c)
    m.check_invariants()
    assert m.num_free_blocks == 16  # nothing leaked: every block free or evictable


