from servescope.kvcache.prefix_cache import PrefixCache, hash_block_tokens, hash_full_blocks


def test_hash_is_a_chain_and_stable():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])  # deterministic
    assert len(h0) == 32
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    # the same block after a different prefix hashes differently
    assert h1 != hash_block_tokens(hash_block_tokens(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert h1 != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3]) != hash_block_tokens(None, [1, 2, 3, 0])


def test_hash_full_blocks_ignores_partial_block_and_extends():
    toks = list(range(10))
    hs = hash_full_blocks(toks, 4)
    assert len(hs) == 2  # tokens 8, 9 are not a full block
    assert hs[1] == hash_block_tokens(hs[0], [4, 5, 6, 7])
    assert hash_full_blocks(toks, 4, known=hs[:1]) == hs
    assert hash_full_blocks(toks, 4, limit=1) == hs[:1]
    assert hash_full_blocks(toks + [10, 11], 4, known=hs)[:2] == hs


def test_insert_lookup_and_duplicates():
    c = PrefixCache(16)
    h = hash_block_tokens(None, [1, 2])
    assert c.insert(h, 5)
    assert c.lookup(h) == 5
    assert not c.insert(h, 6)  # same content in another block: that one stays private
    assert not c.is_cached(6)
    assert not c.insert(hash_block_tokens(None, [3, 4]), 5)  # a block has one hash
    c.check_invariants()


def test_lru_eviction_order():
    c = PrefixCache(16)
    hs = [hash_block_tokens(None, [i]) for i in range(3)]
    for i, h in enumerate(hs):
        c.insert(h, 10 + i)
    c.add_evictable(12)
    c.add_evictable(10)
    c.add_evictable(11)
    c.take(10)  # a hit revives it
    assert c.evictable_blocks() == [12, 11]
    assert c.evict() == 12
    assert c.lookup(hs[2]) is None and not c.is_cached(12)
    c.add_evictable(10)
    assert c.evict() == 11
    assert c.evict() == 10
    assert c.num_cached == 0
    c.check_invariants()
