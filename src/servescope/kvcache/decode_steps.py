"""Several decode steps of several running requests in one call to the KV manager: what a simulator applying a
stretch of steps that only decode (sim/fast_forward.py) asks of the blocks, with the state the steps' own calls
leave.

`allocate_decode_steps(kv, requests, starts, steps)` stands for, in this order,

    for j in range(steps):
        for req, p in zip(requests, starts):  # the step's order (schedule()'s: admission order)
            req.num_computed_tokens = p + j
            kv.allocate_slots(req, 1)

with every request's tokens already past its last position (p + steps). By the manager's invariants (a running
request holds cdiv(tokens, S) blocks; a block is hashed when the step computing its last token is scheduled)
only the positions that start a block (one new block) or fill one (its hash offered to the prefix cache)
change anything, and the calls' effect can be had in bulk:
  - nothing is freed or made evictable during the steps, so the blocks they take are, in order, the first
    ones of the free list and then of the evictable list (one allocator call and one eviction call), handed
    out in the steps' order (step, then request);
  - a hash inserted meets the cache as the steps left it, and when none of the new hashes is cached before
    the steps (nor comes twice among them) every insert succeeds whenever it comes: their order is moot.
Where one of these does not hold (a window, a request that holds other than cdiv(p, S) blocks where it needs
a new one, too few tokens, too few blocks, a new hash already cached) the calls are made one by one. The
requests' num_computed_tokens are left as they were at the call.
"""

from __future__ import annotations

from typing import Sequence

from servescope.kvcache.manager import KVCacheManager, SequenceLike
from servescope.kvcache.window_hit import NO_BLOCK


def allocate_decode_steps(kv: KVCacheManager, requests: Sequence[SequenceLike], starts: Sequence[int],
                          steps: int) -> bool:
    """The module's loop: True, or False when a step's allocation fails (the steps before it applied)."""
    if steps <= 0:
        return True
    plan = _bulk_plan(kv, requests, starts, steps)
    if plan is None:
        return _one_by_one(kv, requests, starts, steps)
    tables, phases, num_new, hashing = plan
    if num_new:
        blocks: list = []
        kv._allocate_blocks(num_new, blocks)  # free list first, then eviction: the order the steps take them in
        size, k = kv.block_size, 0
        for j in range(steps):
            for i in phases[j % size]:  # the requests whose position p + j starts a block, in the step's order
                tables[i].append(blocks[k])
                k += 1
    insert, hashed = kv.prefix_cache.insert_blocks, kv._num_hashed
    for rid, hashes, table, done, full in hashing:  # _cache_full_blocks of each, its hashes already known
        insert(hashes, table, done, full, NO_BLOCK)
        hashed[rid] = full
    return True


def _bulk_plan(kv: KVCacheManager, requests: Sequence[SequenceLike], starts: Sequence[int], steps: int):
    """(block tables, the requests by the step of their first new block mod S, blocks to take, (request id, its
    hashes, its table, its blocks hashed, those full after the steps) of those that fill a block), or None
    where the bulk path does not stand for the calls (the module's list)."""
    if kv.window:
        return None
    size, blocks_of, hashed = kv.block_size, kv._blocks, kv._num_hashed
    caching = kv.enable_prefix_caching
    tables: list = []
    phases: list = [[] for _ in range(size)]
    hashing: list = []
    new_hashes: list = []
    num_new = 0
    for i, (req, p) in enumerate(zip(requests, starts)):
        rid = req.request_id
        table = blocks_of.get(rid)
        if not table:
            return None
        tables.append(table)
        end = p + steps
        held = len(table)
        need = -(-end // size) - held
        if need > 0:
            first = held * size - p  # the step that starts the first new block
            if not 0 <= first < size:
                return None
            phases[first].append(i)
            num_new += need
        if caching:
            full, done = end // size, hashed.get(rid, 0)
            if full > done:
                if req.num_tokens < end:
                    return None
                hashes = kv._request_hashes(req, full)  # the chain the steps' calls extend
                new_hashes.extend(hashes[done:full])
                hashing.append((rid, hashes, table, done, full))
    if num_new > kv.num_free_blocks:
        return None
    if new_hashes and (len(set(new_hashes)) != len(new_hashes) or kv.prefix_cache.any_known(new_hashes)):
        return None
    return tables, phases, num_new, hashing


def _one_by_one(kv: KVCacheManager, requests: Sequence[SequenceLike], starts: Sequence[int], steps: int) -> bool:
    before = [req.num_computed_tokens for req in requests]
    ok = True
    for j in range(steps):
        for req, p in zip(requests, starts):
            req.num_computed_tokens = p + j
            ok = kv.allocate_slots(req, 1)
            if not ok:
                break
        if not ok:
            break
    for req, p in zip(requests, before):
        req.num_computed_tokens = p
    return ok
