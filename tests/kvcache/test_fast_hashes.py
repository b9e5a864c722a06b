"""The tuple-hash chain a simulator's KV manager hashes blocks by (prefix_cache.extend_fast_hashes): the chain
block by block, grown from any known prefix, salted roots apart, the same in a process with another hash seed,
and a manager on it keeps exactly the block tables, hits and LRU a sha256 manager keeps."""

import os
import random
import subprocess
import sys

import pytest

from servescope.config import CacheConfig
from servescope.kvcache.manager import KVCacheManager
from servescope.kvcache.prefix_cache import _FAST_ROOT, _int_root, extend_fast_hashes, hash_full_blocks, salted_root
from test_kv_cache_manager import Seq, admit_each, free_each, grow_each, make, snapshot


def _one_by_one(tokens, block_size, salt=None):
    parent, out = _FAST_ROOT if salt is None else _int_root(salted_root(salt)), []
    for i in range(len(tokens) // block_size):
        parent = hash((parent, *tokens[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_the_chain_block_by_block_grown_from_any_prefix(block_size, salt):
    rng = random.Random(block_size)
    tokens = [rng.randrange(1 << 17) for _ in range(20 * block_size + 2)]
    want = _one_by_one(tokens, block_size, salt)
    assert extend_fast_hashes([], tokens, block_size, 10**6, salt) == want
    assert hash_full_blocks(tokens, block_size, limit=7, salt=salt, extend=extend_fast_hashes) == want[:7]
    for known in (1, 2, 7):
        hashes = want[:known]
        assert extend_fast_hashes(hashes, tokens, block_size, known + 1, salt) == want[:known + 1]
        assert extend_fast_hashes(hashes, tokens, block_size, 15, salt) == want[:15]
    other = extend_fast_hashes([], tokens, block_size, 10**6, "tenant-b")
    assert not set(other) & set(want)  # another salt shares no block
    changed = list(tokens)
    changed[block_size] += 1  # block 1 differs: its hash and every later one's
    assert [a == b for a, b in zip(extend_fast_hashes([], changed, block_size, 10**6, salt), want)] == \
        [True] + [False] * (len(want) - 1)


def test_the_same_in_a_process_with_another_hash_seed():
    tokens = list(range(1000, 1100))
    code = ("from servescope.kvcache.prefix_cache import extend_fast_hashes as f; "
            f"print(f([], {tokens}, 16, 99), f([], {tokens}, 16, 99, 'salt'))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{extend_fast_hashes([], tokens, 16, 99)} {extend_fast_hashes([], tokens, 16, 99, 'salt')}"


@pytest.mark.parametrize("seed", range(3))
def test_a_manager_on_the_tuple_chain_keeps_the_sha256_managers_blocks(seed):
    """Random admissions with shared prefixes, chunks, decodes and frees: the same free list, tables, ref counts,
    hits and LRU (the hashes differ, the blocks they find do not); the hashes it holds are the chain's."""
    rng = random.Random(seed)
    fast = KVCacheManager(CacheConfig(block_size=4, num_blocks=30, enable_prefix_caching=True),
                          extend_hashes=extend_fast_hashes)
    sha = make(num_blocks=30, block_size=4)
    prefixes = [[rng.randrange(40) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    live = {}
    for step in range(300):
        if rng.random() < 0.4 or not live:
            toks = rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randrange(0, 12))]
            pair = (Seq(f"r{step}", toks), Seq(f"r{step}", toks))
            if rng.random() < 0.5:  # hashed ahead, as the simulator does
                fast.set_block_hashes(pair[0].request_id, hash_full_blocks(toks, 4, extend=extend_fast_hashes))
            admit_each((fast, sha), pair, rng.choice([None, 3]))
            if fast.get_block_ids(pair[0].request_id):
                live[pair[0].request_id] = pair
            else:
                free_each((fast, sha), pair)
        elif rng.random() < 0.75:
            rid = rng.choice(sorted(live))
            tok = rng.randrange(40)
            grow_each((fast, sha), live[rid], tok)
        else:
            rid = rng.choice(sorted(live))
            free_each((fast, sha), live.pop(rid))
        fast.check_invariants()
        assert snapshot(fast) == snapshot(sha), step
        assert fast.prefix_cache.cached_blocks() == sha.prefix_cache.cached_blocks(), step
        for rid, hashes in fast._hashes.items():
            assert hashes == extend_fast_hashes([], live[rid][0].all_token_ids, 4, len(hashes)), step
    assert sha.prefix_cache_hits > 0  # the workload hit the cache
