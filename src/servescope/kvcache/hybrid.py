"""HybridKVCacheManager: a block table per group of layers of one attention window, for a model whose layers
mix windows (Gemma 2 and gpt-oss alternate sliding and full layers, Gemma 3 keeps five local to one global).

With one table for all layers (KVCacheManager alone) such a model keeps every block in every layer: its global
layers set the capacity and the windowed layers hold KV no query reads. Here each group of layers of one window
is a KVCacheManager of its own -- its pool of blocks (the runner gives the group's layers cache tensors of
[N_g, S, Hkv, D]), its allocator, prefix cache and window -- so a windowed group gives back the blocks that slid
out (at most cdiv(w, S) + 1 per decoding sequence) while the full group keeps them all. The planner sizes the
pools (analysis/kv_layout.group_blocks): a windowed group gets what max_num_seqs sequences can hold at once, the
full group the rest of the bytes, so the same memory holds more context.

Rules across the groups:
  - an allocation is all or nothing: every group is asked (can_allocate) before any allocates;
  - a prefix hit is the shortest of the groups' leading cached runs (the simplest correct rule: each group
    takes every block of the hit, a windowed group then gives back at once the ones out of view), so every
    group holds what the hit's next query reads;
  - free, rollback and reset act on every group; check_invariants checks each group's invariants.
The scheduler reads it as a KVCacheManager. num_blocks is what binds one sequence's length: the full group
(it keeps every block), or a windowed pool smaller than one sequence's worst case (then it binds as a full
one would). Block counts and hits are the first group's (the full one, when there is one); usage the fullest
group's. Pure Python, no torch: tested on plain integers.
"""

from __future__ import annotations

from dataclasses import replace

from servescope.config import CacheConfig
from servescope.kvcache.manager import NO_BLOCK, KVCacheManager, SequenceLike, cdiv
from servescope.kvcache.window_hit import first_in_view, longest_hit
from servescope.kvcache.prefix_cache import extend_block_hashes, max_hit_blocks


def binding_blocks(pools: dict, block_size: int, max_step_tokens: int) -> int:
    """The blocks that bind one sequence's length with a table per group (pools: window -> blocks): the least pool
    of a full group, or of a windowed one smaller than one sequence may ever need (its window and one step's
    tokens: cdiv(w + step, S) + 1 blocks). The simulator sizes its max_model_len by it, as the engine does."""
    return min(n for w, n in pools.items() if not w or n < cdiv(w + max_step_tokens, block_size) + 1)


class HybridKVCacheManager:
    def __init__(self, config: CacheConfig, group_blocks: dict, group_layers: dict, max_step_tokens: int,
                 extend_hashes=extend_block_hashes):
        """group_blocks: window -> the blocks of its pool (0: full attention); group_layers: window -> its layers;
        max_step_tokens: the most tokens one step adds to one sequence (a chunk, or 1 + drafts / lookahead);
        extend_hashes: the blocks' hash chain (KVCacheManager's: sha256, or a simulator's)."""
        if len(group_blocks) < 2 or set(group_blocks) != set(group_layers):
            raise ValueError(f"a hybrid KV cache needs two or more groups, got {group_blocks} / {group_layers}")
        self.config = config
        self.block_size = config.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        # the full group first (0 sorts first), then the windows in ascending order
        self.windows = tuple(sorted(group_blocks))
        self.layers = tuple(group_layers[w] for w in self.windows)
        self.groups = tuple(KVCacheManager(replace(config, num_blocks=group_blocks[w]), window=w,
                                           extend_hashes=extend_hashes) for w in self.windows)
        self.extend_hashes = extend_hashes
        for g in self.groups[1:]:  # a block's chain hash is its tokens', whatever the group: computed once
            g._hashes = self.groups[0]._hashes
        self.window = self.windows[0]
        self.num_blocks = binding_blocks(group_blocks, self.block_size, max_step_tokens)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # -- sizes (the first group's, usage the fullest group's) --------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.groups[0].num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.groups[0].num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.groups[0].num_cached_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self.groups[0].num_evictable_blocks

    @property
    def allocator(self):
        return self.groups[0].allocator

    @property
    def prefix_cache(self):
        return self.groups[0].prefix_cache

    @property
    def usage(self) -> float:
        return max(g.usage for g in self.groups)

    @property
    def prefix_cache_queries(self) -> int:
        return self.groups[0].prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.groups[0].prefix_cache_hits

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.groups[0].prefix_cache_hit_rate

    def used_kv_tokens(self) -> float:
        """Tokens' worth of every layer's KV that the used blocks hold (a group's block holds its layers' share)."""
        total = sum(self.layers)
        return sum(g.num_used_blocks * self.block_size * n for g, n in zip(self.groups, self.layers)) / total

    def group_stats(self) -> list:
        """Per group: its window, layers, pool and what it holds now (engine stats, /v1/internals, the dashboard)."""
        return [{"window": w, "layers": n, "num_blocks": g.num_blocks,
                 "capacity_tokens": g.num_blocks * self.block_size, "blocks_used": g.num_used_blocks,
                 "blocks_free": g.num_free_blocks,
                 "blocks_cached": g.num_cached_blocks, "usage": g.usage}
                for w, n, g in zip(self.windows, self.layers, self.groups)]

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.groups[0].get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> tuple:
        """The request's block table in each group (windowed groups: NO_BLOCK where a block slid out)."""
        return tuple(g.get_block_ids(request_id) for g in self.groups)

    def num_held_blocks(self, request_id: str) -> int:
        return sum(g.num_held_blocks(request_id) for g in self.groups)

    def held_kv_tokens(self, request_id: str) -> float:
        """Tokens' worth of every layer's KV that the request's blocks hold (a group's block: its layers' share)."""
        held = self.held_blocks_per_group(request_id)
        return sum(h * self.block_size * n for h, n in zip(held, self.layers)) / sum(self.layers)

    def held_blocks_per_group(self, request_id: str) -> tuple:
        return tuple(g.num_held_blocks(request_id) for g in self.groups)

    def block_map(self) -> tuple[list[int], list[str | None]]:
        """The groups' block maps one after the other (group g's block b at offset sum(N_0..N_g-1) + b)."""
        states: list[int] = []
        owners: list[str | None] = []
        for g in self.groups:
            s, o = g.block_map()
            states += s
            owners += o
        return states, owners

    # -- prefix cache ----------------------------------------------------------------------
    def get_computed_blocks(self, request: SequenceLike) -> tuple[list, int]:
        """Per group, the blocks of the longest prefix that every group can serve from its cache (a windowed
        group: the blocks the next query sees, NO_BLOCK before them; kvcache/window_hit.py), and the tokens it
        covers ([] and 0 without a hit). Touches nothing: allocate_slots() takes the blocks."""
        first = self.groups[0]
        if not self.enable_prefix_caching or request.request_id in first._blocks:
            return [], 0
        max_hit = max_hit_blocks(request.num_tokens, self.block_size)
        n, tables = self.cached_tables(first._request_hashes(request, max_hit)[:max_hit])
        return (tables, n * self.block_size) if n else ([], 0)

    def cached_run(self, hashes) -> list:
        """The first group's cached blocks of the leading run of `hashes` that every group holds."""
        runs = [g.cached_run(hashes) for g in self.groups]
        return runs[0][:min(len(r) for r in runs)]

    def cached_tables(self, hashes) -> tuple:
        """(n, per group the table of the first n blocks, NO_BLOCK where the group does not need the block):
        the longest leading run of `hashes` that every group can serve from its cache, as a hit would take it
        (kvcache/window_hit.longest_hit). Touches nothing."""
        return longest_hit([(g.prefix_cache.lookup, g.window) for g in self.groups], list(hashes), self.block_size)

    def release_out_of_view(self, request: SequenceLike, num_tokens: int) -> None:
        """In each windowed group, give back as never written the request's blocks before the view of a query
        at position num_tokens (engine/kv_transfer.py: the KV handed over for them is the view's alone)."""
        for g in self.groups:
            if g.window:
                g._let_go_before(request.request_id, first_in_view(num_tokens, g.window, self.block_size), False)

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request: SequenceLike, num_new_tokens: int, computed_blocks: list | None = None,
                       num_computed_from_cache: int = 0, num_lookahead_tokens: int = 0) -> bool:
        """KVCacheManager.allocate_slots in every group, or in none (False, nothing allocated).
        computed_blocks: get_computed_blocks()'s per-group lists (or empty)."""
        hits = computed_blocks or [[] for _ in self.groups]
        for g, hit in zip(self.groups, hits):
            if not g.can_allocate(request, num_new_tokens, hit, num_computed_from_cache, num_lookahead_tokens):
                return False
        for g, hit in zip(self.groups, hits):
            ok = g.allocate_slots(request, num_new_tokens, hit, num_computed_from_cache, num_lookahead_tokens)
            assert ok, f"{request.request_id}: group of window {g.window} refused what it said it could take"
        return True

    def rollback(self, request: SequenceLike, num_tokens: int) -> int:
        return sum(g.rollback(request, num_tokens) for g in self.groups)

    def free(self, request: SequenceLike) -> None:
        for g in self.groups:
            g.free(request)

    def reset_prefix_cache(self) -> int:
        return sum(g.reset_prefix_cache() for g in self.groups)

    def check_invariants(self) -> None:
        for g in self.groups:
            g.check_invariants()
        owners = [set(g._blocks) for g in self.groups]
        assert all(o == owners[0] for o in owners), f"requests hold blocks in some groups only: {owners}"
        for g in self.groups[1:]:
            for rid, table in g._blocks.items():
                # block i means tokens [i*S, (i+1)*S) in every group: the tables grow alike
                assert len(table) == len(self.groups[0]._blocks[rid]), f"{rid}: tables of different lengths"
                if g.window:
                    assert all(b == NO_BLOCK for b in table[:g._num_slid.get(rid, 0)]), f"{rid}: slid-out block held"
