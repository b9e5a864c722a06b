"""The KV manager's bulk paths (several blocks hashed from one byte conversion, blocks taken from the free list and
from eviction in one go, a request's blocks let go in one pass) leave exactly the state the one-block-at-a-time
rules leave: the same hashes, block ids, reference counts, free list and evictable order, on random workloads with
prefix hits, duplicates, partial and unwritten blocks, preemption-like frees and a full cache."""

import random

import pytest

from servescope.kvcache.block_allocator import BlockAllocator, NoFreeBlocksError
from servescope.kvcache.manager import KVCacheManager
from servescope.kvcache.prefix_cache import PrefixCache, extend_block_hashes, hash_block_tokens, salted_root
from servescope.kvcache.window_hit import NO_BLOCK
from test_kv_cache_manager import Seq, admit_each, free_each, grow_each, make, snapshot


def _one_by_one(tokens, block_size, salt=None):
    parent, out = salted_root(salt), []
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_hashes_of_several_blocks_at_once_equal_the_chain_block_by_block(block_size, salt):
    rng = random.Random(block_size)
    values = [0, 1, -5, 2**40, -(2**63), 2**63 - 1]
    tokens = [rng.choice(values + [rng.randrange(1 << 20)]) for _ in range(20 * block_size + 2)]
    want = _one_by_one(tokens, block_size, salt)
    assert extend_block_hashes([], tokens, block_size, 10**6, salt) == want
    for known in (1, 2, 7):  # grown from a prefix, one block and several at a time, up to a limit
        hashes = want[:known]
        assert extend_block_hashes(hashes, tokens, block_size, known + 1, salt) == want[:known + 1]
        assert extend_block_hashes(hashes, tokens, block_size, 15, salt) == want[:15]
    with pytest.raises(OverflowError):  # not an int64 (as struct refuses it one block at a time)
        extend_block_hashes([], [2**63] * (2 * block_size), block_size, 2)


def test_allocator_and_cache_in_bulk_as_one_at_a_time():
    a, b = BlockAllocator(10), BlockAllocator(10)
    assert a.allocate_many(4) == [b.allocate() for _ in range(4)]
    with pytest.raises(NoFreeBlocksError):
        a.allocate_many(7)
    assert a.decref_all([2, 0, 3]) == [2, 0, 3]
    with pytest.raises(AssertionError):
        a.decref_all([2])  # its count is 0
    with pytest.raises(AssertionError):
        a.reuse([5])  # on the free list
    assert a.reuse([2, 0]) == [2, 0] and (a.ref_count(2), a.ref_count(0)) == (1, 1)
    c, d = PrefixCache(16), PrefixCache(16)
    for cache in (c, d):
        for blk in (7, 3, 9, 1):
            cache.insert(hash_block_tokens(None, [blk]), blk)
    c.add_evictable_all([3, 7, 1])
    for blk in (3, 7, 1):
        d.add_evictable(blk)
    assert c.evict_many(2) == [d.evict(), d.evict()]
    assert (c.evictable_blocks(), c.num_cached) == (d.evictable_blocks(), d.num_cached)
    with pytest.raises(KeyError):
        c.evict_many(2)


class OneAtATime(KVCacheManager):
    """The manager with its bulk paths replaced by the one-block rules they stand for."""

    def _allocate_blocks(self, n, table):
        for _ in range(n):
            if self.allocator.num_free == 0:
                self.allocator.release(self.prefix_cache.evict())
            table.append(self.allocator.allocate())

    def _cache_full_blocks(self, request, num_tokens):
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start, table = self._num_hashed.get(rid, 0), self._blocks[rid]
        num_full = min(num_tokens // self.block_size, len(table))
        if num_full <= start:
            return
        hashes = _one_by_one(request.all_token_ids, self.block_size)[:num_full]
        for i in range(start, num_full):
            if table[i] != NO_BLOCK:
                self.prefix_cache.insert(hashes[i], table[i])
        self._hashes[rid] = hashes
        self._num_hashed[rid] = num_full

    def free(self, request):
        rid = request.request_id
        table = self._blocks.pop(rid, [])
        for d in (self._hashes, self._num_hashed, self._num_slid):
            d.pop(rid, None)
        num_written = request.num_computed_tokens // self.block_size
        for i in range(len(table) - 1, -1, -1):
            if table[i] != NO_BLOCK:
                self._drop(table[i], written=i < num_written)


def _state(m):
    c = m.prefix_cache
    return snapshot(m), dict(c._block_of), list(c._evictable)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_random_workloads_leave_the_one_block_at_a_time_state(seed, caching):
    rng = random.Random(seed)
    bulk = make(num_blocks=40, block_size=4, caching=caching)
    ref = OneAtATime(bulk.config)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    live = {}  # rid -> (Seq in bulk, Seq in ref)
    for step in range(400):
        op = rng.random()
        if op < 0.35 or not live:  # admit, often on a shared prefix (hits, same-content duplicates)
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 14))]
            pair = (Seq(f"r{step}", toks), Seq(f"r{step}", toks))
            admit_each((bulk, ref), pair, rng.choice([None, 3, 9]))
            assert (bulk.get_block_ids(pair[0].request_id) != []) == (ref.get_block_ids(pair[1].request_id) != [])
            if bulk.get_block_ids(pair[0].request_id):
                live[pair[0].request_id] = pair
        elif op < 0.8:  # a decode (or the rest of a chunked prompt) of a live request
            rid = rng.choice(sorted(live))
            tok = rng.randrange(50)
            grow_each((bulk, ref), live[rid], tok)
        else:  # finish or preempt; sometimes before the step's KV is written (unwritten hashed blocks)
            rid = rng.choice(sorted(live))
            back = rng.choice([0, 0, 1, 5])
            for m, s in zip((bulk, ref), live.pop(rid)):
                s.num_computed_tokens = max(s.num_computed_tokens - back, 0)
                m.free(s)
        bulk.check_invariants()
        assert _state(bulk) == _state(ref), step


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_requests_hashes_grown_step_by_step_are_its_salted_chain(salt):
    """The manager reads a request's salt for its first block alone; the chain it grows over a chunked prefill
    and decodes is hash_full_blocks' of all its tokens under that salt (a second salt: other hashes)."""
    m = make(num_blocks=32, block_size=4)
    seq = Seq("a", list(range(10)))
    seq.cache_salt = salt
    for chunk in (3, 4, 3):  # a chunked prefill, then decodes
        assert m.allocate_slots(seq, chunk)
        seq.num_computed_tokens += chunk
    for tok in range(20):
        seq.all_token_ids.append(100 + tok)
        assert m.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
    want = _one_by_one(seq.all_token_ids, 4, salt)
    assert m._hashes["a"] == want[:len(m._hashes["a"])] and len(m._hashes["a"]) == seq.num_computed_tokens // 4
    assert want != _one_by_one(seq.all_token_ids, 4, "tenant-b")
    m.check_invariants()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_hashes_set_before_admission_leave_the_state_computed_ones_leave(seed, salt):
    """set_block_hashes (a simulator hashes a prompt ahead, hash_full_blocks under the request's salt): random
    admissions with shared prefixes, chunks, decodes and frees leave the same hashes, tables, cache and LRU as
    the manager's own hashing; a request that holds blocks refuses them."""
    from servescope.kvcache.prefix_cache import hash_full_blocks
    rng = random.Random(seed)
    ahead, own = make(num_blocks=30, block_size=4), make(num_blocks=30, block_size=4)
    prefixes = [[rng.randrange(40) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    live = {}
    for step in range(300):
        if rng.random() < 0.4 or not live:
            toks = rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randrange(0, 12))]
            pair = (Seq(f"r{step}", toks), Seq(f"r{step}", toks))
            for s in pair:
                s.cache_salt = salt
            ahead.set_block_hashes(pair[0].request_id, hash_full_blocks(toks, 4, salt=salt))
            admit_each((ahead, own), pair, rng.choice([None, 3]))
            if ahead.get_block_ids(pair[0].request_id):
                live[pair[0].request_id] = pair
            else:  # not admitted: the hashes set ahead go with it, as the scheduler frees a refusal
                free_each((ahead, own), pair)
        elif rng.random() < 0.75:
            rid = rng.choice(sorted(live))
            tok = rng.randrange(40)
            grow_each((ahead, own), live[rid], tok)
        else:
            rid = rng.choice(sorted(live))
            free_each((ahead, own), live.pop(rid))
        ahead.check_invariants()
        assert _state(ahead) == _state(own), step
        assert ahead._hashes.keys() == own._hashes.keys(), step
        for rid, hashes in own._hashes.items():  # (the ones set ahead may reach further: every full prompt block)
            longer = ahead._hashes[rid]
            assert longer[:len(hashes)] == hashes and longer == hash_full_blocks(
                live[rid][0].all_token_ids, 4, salt=salt)[:len(longer)], step
    rid = next(iter(live))
    with pytest.raises(ValueError, match="holds blocks"):
        ahead.set_block_hashes(rid, [])
