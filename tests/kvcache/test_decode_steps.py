"""allocate_decode_steps (kvcache/decode_steps.py): several decode steps of several requests in one call leave
exactly the state their allocate_slots(req, 1) calls, step by step, leave -- the same block tables, free list,
evictable order, ref counts and cache -- on random workloads with a full cache (eviction), prefix hits,
requests whose outputs hash alike (the one-by-one path), block sizes 1 to 16, and a cache too small for the
steps (False, as the calls' failure)."""

import random

import pytest

from servescope.kvcache import decode_steps
from servescope.kvcache.decode_steps import allocate_decode_steps
from test_bulk_paths import _state
from test_kv_cache_manager import Seq, make


def _calls(m, seqs, starts, steps) -> bool:
    """The loop allocate_decode_steps stands for."""
    ok = True
    for j in range(steps):
        for s, p in zip(seqs, starts):
            s.num_computed_tokens = p + j
            if not m.allocate_slots(s, 1):
                ok = False
                break
        if not ok:
            break
    for s, p in zip(seqs, starts):
        s.num_computed_tokens = p
    return ok


def _admit(m, s):
    blocks, n = m.get_computed_blocks(s)
    if not m.allocate_slots(s, s.num_tokens - n, blocks, n):
        return False
    s.num_computed_tokens = s.num_tokens
    s.all_token_ids.append(0)  # its first output: one token behind, as a decode
    return True


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_decode_runs_leave_the_calls_state(block_size, caching, seed, monkeypatch):
    rng = random.Random(seed * 7 + block_size)
    bulk, ref = make(num_blocks=60, block_size=block_size, caching=caching), make(60, block_size, caching)
    paths = {"bulk": 0, "calls": 0}
    plan = decode_steps._bulk_plan

    def counted(*a):
        out = plan(*a)
        paths["bulk" if out is not None else "calls"] += 1
        return out

    monkeypatch.setattr(decode_steps, "_bulk_plan", counted)
    shared = [rng.randrange(30) for _ in range(3 * block_size)]
    live: dict = {}
    for step in range(150):
        op = rng.random()
        if op < 0.3 or not live:  # admit a prompt, often on a shared prefix (hits); twins decode alike
            toks = (shared if rng.random() < 0.5 else []) + [rng.randrange(30) for _ in range(rng.randrange(1, 20))]
            pair = (Seq(f"r{step}", toks), Seq(f"r{step}", toks))
            oks = [_admit(m, s) for m, s in zip((bulk, ref), pair)]
            assert oks[0] == oks[1]
            if oks[0]:
                live[pair[0].request_id] = pair
        elif op < 0.85:  # a decode run of some live requests, in admission order
            rids = [r for r in live if rng.random() < 0.7] or [next(iter(live))]
            steps = rng.choice([1, 2, 3, block_size, 2 * block_size + 1, rng.randrange(1, 40)])
            twin = rng.random() < 0.2  # every request decodes the same tokens: equal output blocks hash alike
            same = [rng.randrange(30) for _ in range(steps)]
            outs = [same if twin else [rng.randrange(30) for _ in range(steps)] for _ in rids]
            results = []
            for k, m in enumerate((bulk, ref)):
                seqs = [live[r][k] for r in rids]
                for s, toks in zip(seqs, outs):
                    s.all_token_ids.extend(toks)
                starts = [s.num_computed_tokens for s in seqs]
                results.append(allocate_decode_steps(m, seqs, starts, steps) if m is bulk
                               else _calls(m, seqs, starts, steps))
            assert results[0] == results[1], step
            for r in rids:
                for s in live[r]:
                    s.num_computed_tokens = s.num_tokens - 1 if results[0] else s.num_computed_tokens
            if not results[0]:  # the calls stopped part way: let every request go, as a preempted batch
                for pair in live.values():
                    for m, s in zip((bulk, ref), pair):
                        m.free(s)
                live.clear()
        else:  # a finish (its blocks evictable or free)
            r = rng.choice(list(live))
            for m, s in zip((bulk, ref), live.pop(r)):
                m.free(s)
        bulk.check_invariants()
        assert _state(bulk) == _state(ref), step
    assert paths["bulk"] > 0
    if caching:
        assert paths["calls"] > 0  # the twins' equal hashes (or a short cache) took the calls' path


def test_too_few_blocks_fails_as_the_calls_do():
    bulk, ref = make(num_blocks=6, block_size=2), make(num_blocks=6, block_size=2)
    pairs = [(Seq(r, [1, 2, 3]), Seq(r, [1, 2, 3])) for r in "ab"]
    for m, k in ((bulk, 0), (ref, 1)):
        for p in pairs:
            assert _admit(m, p[k])
            p[k].all_token_ids.extend(range(10, 20))
    starts = [3, 3]
    assert not allocate_decode_steps(bulk, [p[0] for p in pairs], starts, 8)
    assert not _calls(ref, [p[1] for p in pairs], starts, 8)
    assert _state(bulk) == _state(ref)
    assert [p[0].num_computed_tokens for p in pairs] == [3, 3]  # left as they were


def test_a_hash_cached_before_the_steps_is_inserted_as_the_calls_insert_it():
    """B decodes what A decoded: B's block 1 hashes as A's evictable block 1, which the calls evict only at B's
    last new block, after B's step 0 fills its block 1 (so that insert fails); all evictions first would let it
    succeed."""
    bulk, ref = make(num_blocks=6, block_size=2), make(num_blocks=6, block_size=2)
    outs = [0, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    for m in (bulk, ref):
        a = Seq("a", [1, 2, 3])
        assert _admit(m, a)
        a.all_token_ids[3:] = outs[:7]
        assert _calls(m, [a], [3], 6)
        a.num_computed_tokens = 9
        m.free(a)
    pair = (Seq("b", [1, 2, 3]), Seq("b", [1, 2, 3]))
    for m, b in zip((bulk, ref), pair):
        assert _admit(m, b)
        b.all_token_ids[3:] = outs
    assert allocate_decode_steps(bulk, [pair[0]], [3], 8)
    assert _calls(ref, [pair[1]], [3], 8)
    bulk.check_invariants()
    assert _state(bulk) == _state(ref)
