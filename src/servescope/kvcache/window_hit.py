"""Prefix-cache hits under sliding windows: a group of windowed layers needs only the blocks that the
request's next query can see.

A request that hits the first n blocks of its prompt computes on from token n*S; in a group of layers that
attend over their last `window` positions its first query (position n*S) reads keys n*S - window + 1 on, so
that group needs the hit's blocks from `first_in_view(n*S)` to n - 1 cached, and none before (its table
holds NO_BLOCK there, as for blocks that slid out of a running request's window). A group that reads the
whole context (window 0) needs the whole chain from the first block. The hit is the largest n that every
group can serve: with a window the blocks at the chain's start (freed first, so evicted first) need not
survive, where the rule "every block from the first" would lose the whole hit with them. vLLM's hybrid
allocator finds sliding-window hits the same way.
"""

from __future__ import annotations

from itertools import accumulate

from servescope.config.layers import first_in_view  # (also the cost model's: analysis/kv_layout.py)

# the table entry of a block that slid out of the window (or was never needed there): never read by the kernels
NO_BLOCK = -1


def longest_hit(groups: list, hashes: list, block_size: int) -> tuple:
    """groups: (prefix cache lookup: hash -> block or None, window) per group of layers; hashes: the request's
    full blocks' hashes, as many as may hit. Returns (n, per group the table of the first n blocks, NO_BLOCK
    where the group does not need the block): the largest n whose needed blocks every group holds cached,
    (0, [[], ...]) without a hit. Touches nothing."""
    limit = len(hashes)
    for lookup, window in groups:  # whole-context groups: the leading run of cached blocks bounds the hit
        if not window:
            n = 0
            while n < limit and lookup(hashes[n]) is not None:
                n += 1
            limit = n
    cached = {i: [lookup(h) for h in hashes[:limit]] for i, (lookup, window) in enumerate(groups) if window}
    if any(all(b is None for b in run) for run in cached.values()):  # (a window reads at least block n - 1)
        limit = 0
    misses = {i: list(accumulate((b is None for b in run), initial=0)) for i, run in cached.items()}
    n = limit
    while n and not all(m[n] == m[first_in_view(n * block_size, groups[i][1], block_size)]
                        for i, m in misses.items()):
        n -= 1
    tables = []
    for i, (lookup, window) in enumerate(groups):
        if window:
            first = min(first_in_view(n * block_size, window, block_size), n)
            tables.append([NO_BLOCK] * first + cached[i][first:n])
        else:
            tables.append([lookup(h) for h in hashes[:n]])
    return n, tables
