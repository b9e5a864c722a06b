"""KVCacheManager: each request's block table on top of the allocator and the prefix cache.

Invariants (check_invariants() asserts them; tests call it after every sequence of operations):
  - every block is in exactly one of: the free list, the evictable LRU, used (ref count >= 1);
  - a block's ref count equals the number of request block tables that hold it;
  - block i of a request holds the KV of its tokens [i*S, (i+1)*S) (S = block_size); a request holds exactly
    ceil(tokens allocated / S) blocks;
  - a block is cached (hashed) only while it is full and its hash is final: the hash of block i of a request
    is the chain hash of that request's first (i+1)*S tokens;
  - a block is hashed when the step that computes its last token is scheduled (allocate_slots), so a request
    admitted later in the same step can hit it: the engine writes all KV of a layer before any attention of
    that layer reads it.
  - with a window (every layer of the model attends over its last `window` positions), a block whose every
    position lies before the window of the request's next query goes back at once (a cached one stays
    findable, evictable): its table entry becomes NO_BLOCK, so block i still means tokens [i*S, (i+1)*S) and
    a decoding request holds at most cdiv(window, S) + 1 blocks. A prefix hit needs only the blocks its next
    query sees (kvcache/window_hit.py): NO_BLOCK before them. A model whose layers mix windows gets a block
    table per group of layers (kvcache/hybrid.py: one manager like this one per group, each with its own
    window and pool); one table for all layers of such a model (window 0) keeps every block.
Pure Python, no torch: tested on plain integers.
"""

from __future__ import annotations

import logging
from functools import partial
from itertools import takewhile
from operator import is_not
from typing import Protocol, Sequence

from servescope.config import CacheConfig
from servescope.kvcache.block_allocator import BlockAllocator
from servescope.kvcache.prefix_cache import BlockHash, PrefixCache, extend_block_hashes, max_hit_blocks
from servescope.kvcache.window_hit import NO_BLOCK, first_in_view, longest_hit

logger = logging.getLogger(__name__)


class SequenceLike(Protocol):
    """What the manager reads from a request (scheduler.Request satisfies it)."""

    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...


# KVCacheManager.block_map() states
BLOCK_FREE, BLOCK_USED, BLOCK_CACHED, BLOCK_EVICTABLE = 0, 1, 2, 3


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    num_groups = 1  # one block table for all layers (kvcache/hybrid.py: one per group of layers)

    def __init__(self, config: CacheConfig, window: int = 0, extend_hashes=extend_block_hashes):
        self.config = config
        self.extend_hashes = extend_hashes  # the hashes' chain: sha256, or a simulator's extend_fast_hashes
        # every layer's attention window (config/layers.window_of); 0: some layer reads the whole context
        self.window = window
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        self.allocator = BlockAllocator(config.num_blocks)
        self.prefix_cache = PrefixCache(config.num_blocks)
        self._blocks: dict[str, list[int]] = {}  # request id -> block table
        self._hashes: dict[str, list[BlockHash]] = {}  # request id -> hashes of its full blocks so far
        self._num_hashed: dict[str, int] = {}  # request id -> its leading blocks already offered to the cache
        self._num_slid: dict[str, int] = {}  # request id -> its leading blocks given back (out of the window)
        # metrics, in tokens, counted at each admission (a request re-tried every step counts once)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free plus evictable."""
        return self.allocator.num_free + self.prefix_cache.num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash in the prefix cache, used or evictable."""
        return self.prefix_cache.num_cached

    @property
    def num_evictable_blocks(self) -> int:
        return self.prefix_cache.num_evictable

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (0..1)."""
        return self.num_used_blocks / self.num_blocks

    def used_kv_tokens(self) -> float:
        """Tokens' worth of every layer's KV that the used blocks hold."""
        return self.num_used_blocks * self.block_size

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._blocks.get(request_id, ()))

    def get_group_block_ids(self, request_id: str) -> tuple:
        """The request's block table per group of layers (kvcache/hybrid.py); () with one table for all layers."""
        return ()

    def block_map(self) -> tuple[list[int], list[str | None]]:
        """Each block's state and first owner, for live views: (states, owners), both of length num_blocks.
        States: BLOCK_FREE, BLOCK_USED (held, not findable), BLOCK_CACHED (held and in the prefix cache, so a
        later request can share it), BLOCK_EVICTABLE (in the prefix cache, held by nobody, reused last).
        owners[b] is a request id holding b (None when none does)."""
        states = [BLOCK_FREE] * self.num_blocks
        owners: list[str | None] = [None] * self.num_blocks
        for rid, table in self._blocks.items():
            for b in (b for b in table if b != NO_BLOCK):
                if owners[b] is None:
                    owners[b] = rid
                states[b] = BLOCK_CACHED if self.prefix_cache.is_cached(b) else BLOCK_USED
        for b in self.prefix_cache.evictable_blocks():
            states[b] = BLOCK_EVICTABLE
        return states, owners

    # -- prefix cache lookup ---------------------------------------------------------------
    def get_computed_blocks(self, request: SequenceLike) -> tuple[list[int], int]:
        """Longest cached prefix of the request's FULL blocks, and how many tokens it covers.

        Never all tokens: the last token must be recomputed because its logits are needed, so at most
        (num_tokens - 1) // S blocks can hit (a fully cached prompt drops its last block). Touches nothing:
        allocate_slots() takes the blocks."""
        if not self.enable_prefix_caching or request.request_id in self._blocks:
            return [], 0
        max_hit = max_hit_blocks(request.num_tokens, self.block_size)
        n, (blocks,) = self.cached_tables(self._request_hashes(request, max_hit)[:max_hit])
        return blocks, n * self.block_size

    def cached_tables(self, hashes) -> tuple:
        """(n, [its table]): the hit of a request whose full blocks hash so (get_computed_blocks's rule)."""
        return longest_hit([(self.prefix_cache.lookup, self.window)], list(hashes), self.block_size)

    def cached_run(self, hashes) -> list:
        """The cached blocks of the leading run of `hashes` (up to the first miss). Touches nothing."""
        return list(takewhile(partial(is_not, None), map(self.prefix_cache.lookup, hashes)))

    def _request_hashes(self, request: SequenceLike, num_full: int) -> list[BlockHash]:
        known = self._hashes.get(request.request_id)
        if known is None:
            if num_full <= 0:
                return []
            known = self._hashes[request.request_id] = []
        if len(known) < num_full:  # extended in place: the list is this request's alone
            self.extend_hashes(known, request.all_token_ids, self.block_size, num_full,  # (a salt roots block 0 alone)
                               getattr(request, "cache_salt", None) if not known else None)
        return known

    def set_block_hashes(self, request_id: str, hashes: Sequence[BlockHash]) -> None:
        """A request's leading full blocks' hashes computed before it holds blocks (hash_full_blocks of its tokens
        under its salt by extend_hashes, e.g. a simulator's while it waits): taken and extended as the manager's own."""
        if request_id in self._blocks:
            raise ValueError(f"request {request_id} holds blocks: its hashes are the manager's")
        self._hashes[request_id] = list(hashes)

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: SequenceLike,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        num_computed_from_cache: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make the request hold blocks for num_computed_tokens + num_computed_from_cache + num_new_tokens
        tokens (call before advancing request.num_computed_tokens).

        computed_blocks/num_computed_from_cache come from get_computed_blocks() and are only given at
        admission, when the request holds nothing. Returns False, changing nothing, if free + evictable blocks
        do not suffice. Afterwards every block that the scheduled tokens fill is hashed into the prefix cache.
        num_lookahead_tokens: slots for that many more positions (a draft model's KV of unverified tokens),
        never hashed."""
        rid = request.request_id
        held = self._blocks.get(rid, [])
        if held and not computed_blocks and not num_lookahead_tokens and not self.window:
            # the common step of a running request (a decode, the next chunk): the blocks its new tokens need
            # past those it holds (none, mostly), then the blocks the step fills are hashed -- what the general
            # path below does for a request that holds blocks and gets no hit, without its bookkeeping
            total = request.num_computed_tokens + num_new_tokens
            size = self.block_size
            if total > len(held) * size:
                need = -(-total // size) - len(held)
                if need > self.allocator.num_free + self.prefix_cache.num_evictable:
                    return False
                self._allocate_blocks(need, held)
            filled = min(total, request.num_tokens)
            if self.enable_prefix_caching and filled // size > self._num_hashed.get(rid, 0):
                self._cache_full_blocks(request, filled)
            return True
        computed_blocks = computed_blocks or []
        if computed_blocks:
            assert not held and request.num_computed_tokens == 0, f"{rid}: cache hit for a request that holds blocks"
            assert num_computed_from_cache == len(computed_blocks) * self.block_size
        admitting = not held
        num_new_blocks = self._blocks_to_allocate(request, num_new_tokens, computed_blocks, num_computed_from_cache,
                                                  num_lookahead_tokens)
        if num_new_blocks is None:
            return False
        total = request.num_computed_tokens + num_computed_from_cache + num_new_tokens
        table = self._blocks.setdefault(rid, held)
        for b in computed_blocks:
            if b != NO_BLOCK:  # (a windowed hit's blocks out of view: kvcache/window_hit.py)
                if self.allocator.ref_count(b) == 0:
                    self.prefix_cache.take(b)
                self.allocator.incref(b)
            table.append(b)
        if computed_blocks:
            self._num_hashed[rid] = len(computed_blocks)
        if admitting:
            self._release_slid_out(rid, num_computed_from_cache)
        self._allocate_blocks(num_new_blocks, table)

        if admitting and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed_from_cache
        self._cache_full_blocks(request, min(total, request.num_tokens))
        return True

    def can_allocate(self, request: SequenceLike, num_new_tokens: int, computed_blocks: list[int] | None = None,
                     num_computed_from_cache: int = 0, num_lookahead_tokens: int = 0) -> bool:
        """Whether allocate_slots() with the same arguments would succeed. Allocates nothing; a running
        request's blocks that slid out of the window go back (as allocate_slots would: none reads them)."""
        return self._blocks_to_allocate(request, num_new_tokens, computed_blocks or [], num_computed_from_cache,
                                        num_lookahead_tokens) is not None

    def _blocks_to_allocate(self, request: SequenceLike, num_new_tokens: int, computed_blocks: list[int],
                            num_computed_from_cache: int, num_lookahead_tokens: int) -> int | None:
        """New blocks the allocation takes, or None when free + evictable blocks do not suffice."""
        held = self._blocks.get(request.request_id, [])
        if held:  # blocks out of view go back first (whether or not this allocation succeeds: none reads them)
            self._release_slid_out(request.request_id, request.num_computed_tokens)
        total = request.num_computed_tokens + num_computed_from_cache + num_new_tokens
        num_new_blocks = max(self.num_blocks_for(total + num_lookahead_tokens) - len(held) - len(computed_blocks), 0)
        # Hit blocks that sit in the evictable list stop being available once we take them.
        num_hit_evictable = sum(1 for b in computed_blocks if b != NO_BLOCK and self.allocator.ref_count(b) == 0)
        return None if num_new_blocks > self.num_free_blocks - num_hit_evictable else num_new_blocks

    def _allocate_blocks(self, n: int, table: list) -> None:
        """Append n newly allocated blocks to the table, each from the free list, or when it is empty the least
        recently freed cached block (its hash dies with it)."""
        k = min(n, self.allocator.num_free)
        table.extend(self.allocator.allocate_many(k))
        if n > k:  # each evicted block goes where release() then allocate() of it would put it, at once
            table.extend(self.allocator.reuse(self.prefix_cache.evict_many(n - k)))

    def _cache_full_blocks(self, request: SequenceLike, num_tokens: int) -> None:
        """Hash the request's blocks that are full within its first num_tokens tokens."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_hashed.get(rid, 0)
        table = self._blocks[rid]
        num_full = min(num_tokens // self.block_size, len(table))
        if num_full <= start:
            return
        # (a block whose content another block already holds stays private: insert's rule)
        self.prefix_cache.insert_blocks(self._request_hashes(request, num_full), table, start, num_full, NO_BLOCK)
        self._num_hashed[rid] = num_full

    def rollback(self, request: SequenceLike, num_tokens: int) -> int:
        """Give back the blocks past the first num_tokens tokens (slots of rejected draft tokens, or an unused
        lookahead). Such a block holds no verified token, so it was never hashed. Returns how many it freed."""
        table = self._blocks.get(request.request_id)
        if not table:
            return 0
        keep = max(self.num_blocks_for(num_tokens), self._num_hashed.get(request.request_id, 0))
        freed = 0
        while len(table) > keep:
            b = table.pop()
            assert not self.prefix_cache.is_cached(b), f"rollback of cached block {b}"
            if self.allocator.decref(b) == 0:
                self.allocator.release(b)
            freed += 1
        return freed

    # -- release ---------------------------------------------------------------------------
    def free(self, request: SequenceLike) -> None:
        """Drop the request's hold on its blocks (call before resetting num_computed_tokens).

        Blocks go back from the tail of the sequence first, so that in the evictable LRU the tail is evicted
        before the prefix it extends (prefixes are the blocks others can hit). A cached block whose KV was
        never written (hashed for a step that did not complete, i.e. at or past num_computed_tokens) loses its
        hash instead of becoming evictable."""
        rid = request.request_id
        table = self._blocks.pop(rid, [])
        self._hashes.pop(rid, None)
        self._num_hashed.pop(rid, None)
        self._num_slid.pop(rid, None)
        num_written = request.num_computed_tokens // self.block_size
        cache = self.prefix_cache
        if NO_BLOCK not in table and not cache.any_cached(table[num_written:]):  # _drop of each, in bulk
            cached, let_go = cache.split_cached(self.allocator.decref_all(table[::-1]))  # (no unwritten one cached)
            cache.add_evictable_all(cached)
            for b in let_go:
                self.allocator.release(b)
            return
        for i in range(len(table) - 1, -1, -1):
            if table[i] != NO_BLOCK:
                self._drop(table[i], written=i < num_written)

    def _drop(self, b: int, written: bool) -> None:
        """One hold on block b ends: with no holder left, a cached block whose KV is written becomes
        evictable (still findable), any other goes back to the free list."""
        if self.allocator.decref(b) > 0:
            return
        if self.prefix_cache.is_cached(b) and written:
            self.prefix_cache.add_evictable(b)
        else:
            self._let_go(b)

    def _let_go(self, b: int) -> None:
        """A block nobody holds whose KV is not written, or that is not cached, goes back to the free list."""
        if self.prefix_cache.is_cached(b):
            self.prefix_cache.uncache(b)
        self.allocator.release(b)

    def _release_slid_out(self, rid: str, num_computed: int) -> None:
        """Give back the request's blocks that lie wholly before the window of its next query (position
        num_computed sees keys num_computed - window + 1 on): no layer reads them again."""
        if self.window:
            self._let_go_before(rid, first_in_view(num_computed, self.window, self.block_size), written=True)

    def _let_go_before(self, rid: str, num_blocks: int, written: bool) -> None:  # (not written: hybrid.py)
        table = self._blocks[rid]
        dead = min(num_blocks, len(table))
        for i in range(self._num_slid.get(rid, 0), dead):
            if table[i] != NO_BLOCK:  # (a hit's blocks out of view were never taken)
                self._drop(table[i], written=written)
                table[i] = NO_BLOCK
        self._num_slid[rid] = max(dead, self._num_slid.get(rid, 0))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its table less the entries that slid out of the window)."""
        return sum(b != NO_BLOCK for b in self._blocks.get(request_id, ()))

    def held_kv_tokens(self, request_id: str) -> float:
        """Tokens' worth of every layer's KV that the request's blocks hold."""
        return self.num_held_blocks(request_id) * self.block_size

    def reset_prefix_cache(self) -> int:
        """Forget every hash (e.g. after weights change). Evictable blocks become free; blocks in use keep their
        KV but can no longer be hit. Returns the number of hashes dropped."""
        n = self.prefix_cache.num_cached
        for b in self.prefix_cache.clear():
            self.allocator.release(b)
        # Blocks already offered stay "offered": they will not be re-hashed.
        logger.info("prefix cache reset: %d block hashes dropped", n)
        return n

    # -- invariants ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        alloc, cache = self.allocator, self.prefix_cache
        cache.check_invariants()
        owners = [0] * self.num_blocks
        for rid, table in self._blocks.items():
            held = [b for b in table if b != NO_BLOCK]
            assert len(set(held)) == len(held), f"{rid}: a block appears twice in its table {table}"
            assert all(b == NO_BLOCK for b in table[:self._num_slid.get(rid, 0)]), f"{rid}: slid-out block held"
            for b in held:
                owners[b] += 1
            hashes = self._hashes.get(rid, [])
            assert self._num_hashed.get(rid, 0) <= len(table), f"{rid}: more blocks offered than held"
            for i, b in enumerate(table):
                h = cache.hash_of(b) if b != NO_BLOCK else None
                if h is not None and i < self._num_hashed.get(rid, 0):
                    assert i < len(hashes) and hashes[i] == h, f"{rid}: block {b} (#{i}) cached under a foreign hash"
        free = set(alloc.free_block_ids())
        assert len(free) == alloc.num_free, "a block is on the free list twice"
        evictable = set(cache.evictable_blocks())
        for b in range(self.num_blocks):
            states = (b in free) + (b in evictable) + (alloc.ref_count(b) > 0)
            assert states == 1, f"block {b}: free={b in free} evictable={b in evictable} ref={alloc.ref_count(b)}"
            assert alloc.ref_count(b) == owners[b], f"block {b}: ref {alloc.ref_count(b)} but {owners[b]} owners"
            if b in free:
                assert not cache.is_cached(b), f"free block {b} is still cached"
        if not self.enable_prefix_caching:
            assert cache.num_cached == 0
