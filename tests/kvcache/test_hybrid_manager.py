"""HybridKVCacheManager: a block table per group of layers of one window (plain integers). A windowed group holds
at most cdiv(window, S) + 1 blocks per decoding sequence at 8k context while the full group holds them all; an
allocation is all or nothing; a prefix hit is what every group can serve (a windowed group: the blocks in view);
preemption and abort free every group; the invariants hold after random sequences of operations; the planner's
pools keep the bytes of the uniform cache."""

import random

import pytest

from servescope.analysis.kv_layout import group_blocks
from servescope.config import CacheConfig
from servescope.kvcache.hybrid import HybridKVCacheManager
from servescope.kvcache.manager import NO_BLOCK, cdiv

from test_kv_cache_manager import Seq, admit  # tests/kvcache, on sys.path as the test file's folder
from test_window_blocks import evict


def make(blocks: dict, layers=None, block_size=16, caching=True, step=64):
    layers = layers or {w: 1 for w in blocks}
    return HybridKVCacheManager(CacheConfig(block_size=block_size, num_blocks=max(blocks.values()),
                                            enable_prefix_caching=caching), blocks, layers, step)


def run(m, seq, chunk):
    """Chunked prefill of the rest of seq's tokens, as the scheduler and the model do."""
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert m.allocate_slots(seq, n)
        seq.num_computed_tokens += n
        m.check_invariants()


def decode(m, seq, steps):
    most = [0] * m.num_groups
    for i in range(steps):
        seq.all_token_ids.append(10_000 + i)
        assert m.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        most = [max(a, b) for a, b in zip(most, m.held_blocks_per_group(seq.request_id))]
    m.check_invariants()
    return most


@pytest.mark.parametrize("window,block_size", [(4096, 16), (512, 16), (128, 16), (40, 16), (5, 4)])
def test_the_windowed_group_holds_at_most_window_over_s_plus_one_at_8k(window, block_size):
    chunk = 64
    full = cdiv(8192, block_size)
    m = make({0: full, window: cdiv(window + chunk, block_size) + 1}, block_size=block_size, step=chunk)
    seq = Seq("a", range(300))
    admit(m, seq, chunk=chunk)
    run(m, seq, chunk)
    most = decode(m, seq, 8192 - 300)
    assert seq.num_computed_tokens == 8192
    assert most[0] == full and most[1] <= cdiv(window, block_size) + 1
    full_table, win_table = m.get_group_block_ids("a")
    assert NO_BLOCK not in full_table and len(win_table) == len(full_table)  # block i: tokens [i*S, (i+1)*S)
    first_visible = 8191 - window + 1
    assert all((b == NO_BLOCK) == ((i + 1) * block_size <= first_visible) for i, b in enumerate(win_table))
    m.free(seq)
    m.check_invariants()
    assert all(g.num_used_blocks == 0 for g in m.groups)


def test_an_allocation_is_all_or_nothing():
    m = make({0: 64, 16: 3}, step=16)  # the windowed pool holds 3 blocks: one sequence of a 16-token window
    a = Seq("a", range(40))
    admit(m, a, chunk=16)
    run(m, a, 16)  # a holds 2 windowed blocks (positions 25..39)
    b = Seq("b", range(100, 140))
    before = [(g.num_free_blocks, g.num_used_blocks) for g in m.groups]
    assert m.get_computed_blocks(b) == ([], 0)
    assert not m.allocate_slots(b, 40)  # the full group has room for 3 blocks, the windowed one not
    assert [(g.num_free_blocks, g.num_used_blocks) for g in m.groups] == before
    assert m.get_group_block_ids("b") == ([], [])
    m.check_invariants()


def test_preemption_and_abort_free_every_group():
    m = make({0: 40, 32: 12, 64: 14}, layers={0: 1, 32: 2, 64: 3}, step=16)
    seqs = [Seq(str(i), range(100 * i, 100 * i + 70)) for i in range(2)]
    for s in seqs:
        admit(m, s, chunk=16)
        run(m, s, 16)
        decode(m, s, 20)
    assert all(g.num_used_blocks > 0 for g in m.groups)
    for s in seqs:
        m.free(s)
        m.check_invariants()
    assert all(g.num_used_blocks == 0 for g in m.groups)


def test_a_prefix_hit_is_what_every_group_holds():
    m = make({0: 64, 16: 64}, step=64)
    a = Seq("a", range(100))
    admit(m, a)  # 6 full blocks hashed in both groups; the windowed group gives back all but its last 2
    m.free(a)
    b = Seq("b", list(range(100)) + [7])
    blocks, n = m.get_computed_blocks(b)
    assert n == 96 and [len(x) for x in blocks] == [6, 6]
    # the windowed group's evictable blocks are reused first by another sequence: the hit shortens to what it holds
    c = Seq("c", range(1000, 1000 + 16 * 60))
    assert m.allocate_slots(c, 16 * 60)
    blocks, n = m.get_computed_blocks(b)
    assert n < 96 and all(len(x) == n // 16 for x in blocks)
    m.free(c)
    admit(m, b)
    m.check_invariants()


def test_a_windowed_group_serves_a_hit_from_the_blocks_in_view():
    """The windowed group's first blocks (the LRU's first victims) are gone, the full group holds the whole chain:
    the hit is whole; the windowed group's table takes only the blocks its first new token reads (keys 81 on)."""
    m = make({0: 64, 16: 64}, step=64)
    a = Seq("a", range(100))
    admit(m, a)
    m.free(a)
    evict(m.groups[1], range(100), range(4))  # blocks 0-3 of the windowed group
    b = Seq("b", list(range(100)) + [7])
    (full, windowed), n = m.get_computed_blocks(b)
    assert n == 96 and len(full) == 6 and NO_BLOCK not in full
    assert windowed[:5] == [NO_BLOCK] * 5 and windowed[5] != NO_BLOCK
    admit(m, b)
    decode(m, b, 20)
    m.free(b)
    m.check_invariants()
    assert m.num_free_blocks == m.num_blocks


def test_random_operations_keep_every_invariant():
    rng = random.Random(3)
    m = make({0: 48, 8: 20, 24: 30}, layers={0: 2, 8: 3, 24: 1}, block_size=4, step=12)
    live, finished, n = {}, 0, 0
    shared = [rng.randrange(100) for _ in range(20)]
    for _ in range(1500):
        op = rng.random()
        if op < 0.25 and len(live) < 6:  # admit a new request (half of them behind a shared prefix)
            n += 1
            s = Seq(f"r{n}", (shared if n % 2 else []) + [rng.randrange(100) for _ in range(rng.randrange(1, 40))])
            blocks, hit = m.get_computed_blocks(s)
            chunk = min(12, s.num_tokens - hit)
            if m.allocate_slots(s, chunk, blocks, hit):
                s.num_computed_tokens = hit + chunk
                live[s.request_id] = s
        elif op < 0.8 and live:  # a step of one request: the next chunk, or a decode token (maybe with drafts)
            s = live[rng.choice(sorted(live))]
            if s.num_computed_tokens == s.num_tokens:
                s.all_token_ids.append(rng.randrange(100))
            k = rng.choice([0, 0, 2]) if s.num_computed_tokens == s.num_tokens - 1 else 0
            num = min(12, s.num_tokens - s.num_computed_tokens) + k
            if m.allocate_slots(s, num):
                s.num_computed_tokens += num - k
                if k:
                    m.rollback(s, s.num_tokens)
            else:  # preempt it, as the scheduler does
                m.free(s)
                del live[s.request_id]
        elif live:  # finish or abort one
            s = live.pop(rng.choice(sorted(live)))
            m.free(s)
            finished += 1
        if rng.random() < 0.01:
            m.reset_prefix_cache()
        m.check_invariants()
    for s in live.values():
        m.free(s)
    m.check_invariants()
    assert finished > 20 and all(g.num_used_blocks == 0 for g in m.groups)


def test_the_pools_keep_the_uniform_caches_bytes():
    # Gemma 3's shape: 5 windowed layers to 1 full, window 512, 16-token blocks
    layers = {0: 1, 512: 5}
    out = group_blocks(layers, num_blocks=10_000, block_size=16, max_num_seqs=8, max_step_tokens=1,
                       max_num_batched_tokens=256)
    assert out[512] == 8 * (cdiv(513, 16) + 1) + 16 + 1
    assert out[0] == (10_000 * 6 - out[512] * 5) // 1
    assert out[0] * 1 + out[512] * 5 <= 10_000 * 6
    # a pool never gets more than the uniform cache's blocks: then the split is the uniform one
    small = group_blocks(layers, num_blocks=20, block_size=16, max_num_seqs=8, max_step_tokens=1,
                         max_num_batched_tokens=256)
    assert small == {0: 20, 512: 20}


def test_pipeline_stages_each_fit_their_own_layers_pools():
    """Gemma 3's 5:1 over two stages of 3 layers (3 windowed | 2 windowed + the full one): every stage holds the
    pools of its layers' groups over the same block ids in no more than num_blocks blocks of each of its layers;
    the full pool is what the stage holding it leaves, less than one process's (which lends it every windowed
    layer's saved bytes), and a stage with no full layer bounds nothing."""
    layers, stages = {0: 1, 512: 5}, ({512: 3}, {512: 2, 0: 1})
    kw = dict(num_blocks=10_000, block_size=16, max_num_seqs=8, max_step_tokens=1, max_num_batched_tokens=256)
    one, staged = group_blocks(layers, **kw), group_blocks(layers, **kw, stages=stages)
    assert staged[512] == one[512] and staged[0] == 10_000 * 3 - staged[512] * 2 < one[0]
    for held in stages:
        assert sum(staged[w] * n for w, n in held.items()) <= 10_000 * sum(held.values())
    assert group_blocks(layers, **kw, stages=(layers,)) == one  # one stage: one process's split


def test_a_windowed_pool_smaller_than_one_sequence_binds_the_length():
    roomy = make({0: 100, 64: 20}, step=32)
    assert roomy.num_blocks == 100  # one sequence needs at most cdiv(64 + 32, 16) + 1 = 7 windowed blocks
    tight = make({0: 100, 64: 5}, step=32)
    assert tight.num_blocks == 5


def test_the_block_map_shows_every_groups_blocks():
    m = make({0: 10, 16: 6}, step=16)
    a = Seq("a", range(40))
    admit(m, a, chunk=16)
    run(m, a, 16)
    states, owners = m.block_map()
    assert len(states) == len(owners) == 16
    assert owners[:10].count("a") == 3 and owners[10:].count("a") == m.held_blocks_per_group("a")[1] == 2
