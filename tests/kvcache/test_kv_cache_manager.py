"""KVCacheManager on plain integers: exact block ids, reference counts and free/evictable lists."""

import pytest

from servescope.config import CacheConfig
from servescope.kvcache.manager import KVCacheManager


class Seq:
    """The part of a Request the manager reads."""

    def __init__(self, rid, tokens):
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_computed_tokens = 0

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


def make(num_blocks=8, block_size=4, caching=True):
    return KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching))


def admit(m, seq, chunk=None, compute=True):
    """Admit like the scheduler does; `compute` plays the model having run the step."""
    blocks, n = m.get_computed_blocks(seq)
    new = seq.num_tokens - n if chunk is None else min(chunk, seq.num_tokens - n)
    assert m.allocate_slots(seq, new, blocks, n)
    seq.num_computed_tokens = n
    if compute:
        seq.num_computed_tokens += new
    m.check_invariants()
    return blocks, n


def refs(m, blocks):
    return [m.allocator.ref_count(b) for b in blocks]


def admit_each(managers, seqs, chunk=None) -> None:
    """The same new request admitted in each manager: its cached prefix looked up, then its prompt's slots (at most
    `chunk` tokens of it; None: all) allocated (twin managers kept in step by random tests)."""
    for m, s in zip(managers, seqs):
        blocks, n = m.get_computed_blocks(s)
        new = s.num_tokens - n if chunk is None else min(chunk, s.num_tokens - n)
        if m.allocate_slots(s, new, blocks, n):
            s.num_computed_tokens = n + new


def grow_each(managers, seqs, tok: int) -> None:
    """One decode (or the rest of a chunked prompt) of the same request in each manager: the token appended where
    the request has computed all it holds, then its slots allocated (twin managers kept in step by random tests)."""
    for m, s in zip(managers, seqs):
        if s.num_computed_tokens == s.num_tokens:
            s.all_token_ids.append(tok)
        if m.allocate_slots(s, s.num_tokens - s.num_computed_tokens):
            s.num_computed_tokens = s.num_tokens


def free_each(managers, seqs) -> None:
    for m, s in zip(managers, seqs):
        m.free(s)


def snapshot(m):
    return (
        m.allocator.free_block_ids(),
        m.prefix_cache.evictable_blocks(),
        [m.allocator.ref_count(b) for b in range(m.num_blocks)],
        {r: list(t) for r, t in m._blocks.items()},
        m.num_cached_blocks,
        m.prefix_cache_queries,
        m.prefix_cache_hits,
    )


def test_allocate_and_free_without_caching():
    m = make(caching=False)
    a = Seq("a", range(10))
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert (m.num_free_blocks, m.num_used_blocks, m.usage) == (5, 3, 3 / 8)
    assert m.num_cached_blocks == 0
    m.free(a)
    m.check_invariants()
    assert m.allocator.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]  # tail of the sequence first
    assert m.get_block_ids("a") == []


def test_growth_one_token_at_a_time_adds_a_block_at_each_boundary():
    m = make()
    a = Seq("a", range(3))
    admit(m, a)
    assert m.get_block_ids("a") == [0] and m.num_cached_blocks == 0  # 3/4 full: not cached
    a.all_token_ids.append(3)  # sampled token; its KV is computed next step
    assert m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert m.get_block_ids("a") == [0] and m.num_cached_blocks == 1  # now full: cached
    a.all_token_ids.append(4)
    assert m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert m.get_block_ids("a") == [0, 1]
    m.check_invariants()


def test_prefix_hit_shares_full_blocks_only():
    m = make()
    a = Seq("a", range(10))
    admit(m, a)
    assert m.num_cached_blocks == 2  # tokens 8, 9 fill half a block: never cached
    b = Seq("b", list(range(8)) + [100, 101, 102])
    blocks, n = admit(m, b)
    assert (blocks, n) == ([0, 1], 8)
    assert m.get_block_ids("b") == [0, 1, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (10 + 11, 8)
    # a different first block breaks the chain even if later blocks match
    c = Seq("c", [99] + list(range(1, 10)))
    assert m.get_computed_blocks(c) == ([], 0)


def test_two_requests_same_prompt_share_prompt_blocks():  # like n=2
    m = make()
    prompt = list(range(10))
    a, b = Seq("a", prompt), Seq("b", prompt)
    admit(m, a)
    admit(m, b)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]


@pytest.mark.parametrize("n_tokens, hit", [(8, 4), (9, 8), (7, 4), (4, 0), (3, 0)])
def test_fully_cached_prompt_recomputes_last_token(n_tokens, hit):
    m = make()
    admit(m, Seq("a", range(n_tokens)))
    b = Seq("b", range(n_tokens))
    blocks, n = m.get_computed_blocks(b)
    assert n == hit and n < n_tokens
    assert blocks == list(range(hit // 4))


def test_prompt_exact_multiple_of_block_size():
    m = make()
    a = Seq("a", range(8))
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1] and m.num_cached_blocks == 2
    b = Seq("b", range(8))
    blocks, n = admit(m, b)
    assert (blocks, n) == ([0], 4)
    # b recomputes tokens 4..7 into its own block; same content as block 1, so it stays private
    assert m.get_block_ids("b") == [0, 2]
    assert refs(m, [0, 1, 2]) == [2, 1, 1]
    assert not m.prefix_cache.is_cached(2)
    m.free(a)
    m.free(b)
    m.check_invariants()
    assert m.prefix_cache.evictable_blocks() == [1, 0]
    assert m.allocator.free_block_ids()[-1] == 2  # the private duplicate was simply freed


def test_same_step_hit_before_kv_is_written():
    m = make()
    a, b = Seq("a", range(9)), Seq("b", range(9))
    admit(m, a, compute=False)  # scheduled, not yet run
    blocks, n = admit(m, b, compute=False)
    assert (blocks, n) == ([0, 1], 8)
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]


def test_free_of_unwritten_blocks_drops_their_hashes():
    m = make()
    a = Seq("a", range(12))
    admit(m, a, chunk=8, compute=False)  # hashed for a step that never ran (aborted or preempted)
    assert m.num_cached_blocks == 2
    m.free(a)
    m.check_invariants()
    assert m.num_cached_blocks == 0 and m.num_evictable_blocks == 0
    assert m.get_computed_blocks(Seq("b", range(12))) == ([], 0)


def test_evictable_lru_order_and_eviction():
    m = make()
    a = Seq("a", range(10))
    b = Seq("b", list(range(8)) + [100, 101, 102])
    admit(m, a)
    admit(m, b)
    m.free(a)
    m.check_invariants()
    assert refs(m, [0, 1]) == [1, 1] and m.allocator.is_free(2)
    m.free(b)
    m.check_invariants()
    assert m.prefix_cache.evictable_blocks() == [1, 0]  # the tail goes first
    assert m.allocator.free_block_ids() == [4, 5, 6, 7, 2, 3]
    assert (m.num_free_blocks, m.num_used_blocks, m.num_cached_blocks) == (8, 0, 2)
    # 7 blocks: the 6 free ones, then the least recently freed cached block (1)
    c = Seq("c", range(1000, 1028))
    admit(m, c)
    assert m.get_block_ids("c") == [4, 5, 6, 7, 2, 3, 1]
    assert m.prefix_cache.evictable_blocks() == [0]
    # a's first block is still reusable; the chain breaks at the evicted second block
    assert m.get_computed_blocks(Seq("d", range(10))) == ([0], 4)


def test_hit_on_evictable_block_revives_it():
    m = make()
    a = Seq("a", range(10))
    admit(m, a)
    m.free(a)
    blocks, n = admit(m, Seq("b", range(10)))
    assert (blocks, n) == ([0, 1], 8)
    assert m.prefix_cache.evictable_blocks() == []
    assert refs(m, [0, 1]) == [1, 1]


def test_failed_allocation_changes_nothing():
    m = make(num_blocks=4)
    a = Seq("a", range(8))
    admit(m, a)
    m.free(a)  # blocks 0, 1 evictable, 2, 3 free
    b = Seq("b", range(20))  # hits 0, 1, needs 3 more, but taking the hits leaves only 2
    blocks, n = m.get_computed_blocks(b)
    assert (blocks, n) == ([0, 1], 8)
    before = snapshot(m)
    assert not m.allocate_slots(b, 12, blocks, n)
    assert snapshot(m) == before
    m.check_invariants()
    b2 = Seq("b2", range(16))
    admit(m, b2)
    assert m.get_block_ids("b2") == [0, 1, 2, 3]
    # a running request that cannot grow leaves everything as it was
    b2.all_token_ids.append(16)
    before = snapshot(m)
    assert not m.allocate_slots(b2, 1)
    assert snapshot(m) == before


def test_reset_prefix_cache():
    m = make()
    a = Seq("a", range(10))
    b = Seq("b", range(100, 110))
    admit(m, a)
    admit(m, b)
    m.free(a)
    assert m.reset_prefix_cache() == 4
    m.check_invariants()
    assert m.num_cached_blocks == 0 and m.num_evictable_blocks == 0
    assert m.num_free_blocks == 5
    m.free(b)
    m.check_invariants()
    assert m.allocator.num_free == 8


def test_prefix_caching_disabled_never_hits():
    m = make(caching=False)
    admit(m, Seq("a", range(10)))
    assert m.get_computed_blocks(Seq("b", range(10))) == ([], 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (0, 0)


def test_check_invariants_catches_a_leak():
    m = make()
    a = Seq("a", range(10))
    admit(m, a)
    m.allocator.incref(0)
    with pytest.raises(AssertionError):
        m.check_invariants()
