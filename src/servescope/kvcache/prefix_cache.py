"""Prefix cache: block hashes, the hash -> block table, and the LRU list of evictable blocks.

A block's hash is sha256(parent hash || its token ids), so equal hashes mean equal whole
prefixes, not just equal blocks. A simulator, whose prefix caches never meet an engine's, may chain
Python's tuple hash instead (extend_fast_hashes: the same chain, a 64-bit hash, several times cheaper
per block; deterministic across processes, as int and tuple hashes are not salted). Invariants:
  - a block is in the cache only while it is FULL and its hash is final (a partly filled
    block is never hashed, hence never shared);
  - one hash maps to at most one block (a second block with the same content stays
    uncached and is simply freed when its owner lets go);
  - an evictable block is cached, has ref count 0 and is off the free list; it stays
    reusable until it is evicted to satisfy an allocation (least recently freed first).
Pure Python, no torch.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from itertools import compress, repeat
from operator import is_not, not_
from typing import Optional, Sequence

BlockHash = bytes  # 32-byte sha256 digest

_ROOT = b"servescope-kv-root"  # the parent "hash" of a sequence's first block


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a num_tokens prompt a prefix hit may use: never the block of the last token (its
    logits are due, so at least that token is computed)."""
    return (num_tokens - 1) // block_size


@functools.lru_cache(maxsize=256)
def _packer(n: int):
    """The bound pack of n little-endian int64s (one per block size: no format string parsed per block)."""
    return struct.Struct(f"<{n}q").pack


def hash_block_tokens(parent: Optional[BlockHash], token_ids: Sequence[int]) -> BlockHash:
    """Stable (process- and run-independent) hash of one full block and everything before it."""
    return hashlib.sha256((parent if parent is not None else _ROOT) + _packer(len(token_ids))(*token_ids)).digest()


def salted_root(salt: Optional[str]) -> Optional[BlockHash]:
    """The parent "hash" of a salted sequence's first block (vLLM's cache_salt): requests with
    different salts never share a block, equal salts share as usual; None: no salt."""
    return None if salt is None else hashlib.sha256(_ROOT + b"|salt|" + salt.encode("utf-8")).digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, known: Sequence[BlockHash] = (), limit: Optional[int] = None,
    salt: Optional[str] = None, extend=None,
) -> list[BlockHash]:
    """Hashes of the full blocks of token_ids (at most `limit` of them), extending the `known` prefix.
    extend: the chain's rule (extend_block_hashes, the default, or extend_fast_hashes)."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    return (extend or extend_block_hashes)(list(known[:n]), token_ids, block_size, n, salt)


def extend_block_hashes(hashes: list, token_ids: Sequence[int], block_size: int, limit: int,
                        salt: Optional[str] = None) -> list:
    """Append to `hashes` (those of the leading full blocks of token_ids) the hashes of the next full blocks,
    up to `limit` blocks in all, in place (a request's list grows a block at a time: no copy of what it holds);
    returns `hashes`. Several blocks at once take their tokens' bytes in one conversion per _PACK_BLOCKS blocks
    (_int64_bytes: the bytes hash_block_tokens packs, block by block)."""
    n = min(len(token_ids) // block_size, limit)
    k = len(hashes)
    if n <= k:
        return hashes
    parent = hashes[-1] if hashes else salted_root(salt)
    if parent is None:
        parent = _ROOT
    append, sha256 = hashes.append, hashlib.sha256
    if n == k + 1:  # a decode filling its block
        append(sha256(parent + _packer(block_size)(*token_ids[k * block_size:n * block_size])).digest())
        return hashes
    width = 8 * block_size
    for a in range(k, n, _PACK_BLOCKS):
        data = _int64_bytes(token_ids[a * block_size:min(n, a + _PACK_BLOCKS) * block_size])
        for off in range(0, len(data), width):
            parent = sha256(parent + data[off:off + width]).digest()
            append(parent)
    return hashes


def extend_fast_hashes(hashes: list, token_ids: Sequence[int], block_size: int, limit: int,
                       salt: Optional[str] = None) -> list:
    """extend_block_hashes with Python's tuple hash for sha256: block i's hash is hash((block i-1's, *its tokens)),
    the first block's parent an int drawn from the sha256 root (salted as extend_block_hashes salts it). The same
    on every process and run (int and tuple hashes are not salted), a 64-bit int: for a simulator's caches, where
    no hash meets the engine's, at about a third of sha256's cost per block (its call, the tokens' packing)."""
    n = min(len(token_ids) // block_size, limit)
    k = len(hashes)
    if n <= k:
        return hashes
    parent = hashes[-1] if hashes else _FAST_ROOT if salt is None else _int_root(salted_root(salt))
    append = hashes.append
    if n == k + 1:  # a decode filling its block
        append(hash((parent, *token_ids[k * block_size:n * block_size])))
        return hashes
    # the blocks as tuples of block_size tokens, cut by zip from one iterator over their span (no slice per block)
    for block in zip(*[iter(token_ids[k * block_size:n * block_size])] * block_size):
        parent = hash((parent, *block))
        append(parent)
    return hashes


def _int_root(root: BlockHash) -> int:
    return int.from_bytes(root[:8], "little")


_FAST_ROOT = _int_root(hashlib.sha256(_ROOT).digest())
_PACK_BLOCKS = 32  # blocks packed in one struct call (one bound pack per count of blocks: few, cached)


def _int64_bytes(token_ids: Sequence[int]) -> bytes:
    """The tokens as little-endian int64s, back to back (struct's "<{n}q", cached per n; several times faster
    than array's conversion of Python ints). A token outside int64 raises OverflowError."""
    try:
        return _packer(len(token_ids))(*token_ids)
    except struct.error as e:
        raise OverflowError(f"a token id is not an int64: {e}") from None


class PrefixCache:
    """hash <-> block maps plus the evictable LRU (first entry = least recently freed = evicted first).

    The block -> hash side is a list indexed by block id (blocks are 0..num_blocks-1; None: no hash), so that the
    per-block tests over a request's whole table (free, the bulk inserts) read a list, not a dict of every cached
    block."""

    def __init__(self, num_blocks: int):
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: list = [None] * num_blocks  # block -> its hash, None while it has none
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # -- lookups ---------------------------------------------------------------------------
    def lookup(self, h: BlockHash) -> Optional[int]:
        return self._block_of.get(h)

    def any_known(self, hashes) -> bool:
        """Whether any of the hashes is cached (one set operation)."""
        return not self._block_of.keys().isdisjoint(hashes)

    def is_cached(self, block: int) -> bool:
        return self._hash_of[block] is not None

    def hash_of(self, block: int) -> Optional[BlockHash]:
        return self._hash_of[block]

    def any_cached(self, blocks: Sequence[int]) -> bool:
        return any(map(is_not, map(self._hash_of.__getitem__, blocks), repeat(None)))

    def split_cached(self, blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """(the cached blocks, the others), each in the order given."""
        flags = list(map(is_not, map(self._hash_of.__getitem__, blocks), repeat(None)))
        cached = list(compress(blocks, flags))
        if len(cached) == len(blocks):
            return cached, []
        return cached, list(compress(blocks, map(not_, flags)))

    def cached_blocks(self) -> list[int]:
        """The blocks that have a hash, in block order."""
        return [b for b, h in enumerate(self._hash_of) if h is not None]

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, next to be evicted first."""
        return list(self._evictable)

    # -- updates ---------------------------------------------------------------------------
    def insert(self, h: BlockHash, block: int) -> bool:
        """Cache a full block under h. False (and nothing changes) if h is already cached by
        another block, or this block already has a hash."""
        if h in self._block_of or self._hash_of[block] is not None:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        return True

    def insert_blocks(self, hashes: Sequence[BlockHash], blocks: Sequence[int], start: int, stop: int,
                      skip: int) -> None:
        """insert(hashes[i], blocks[i]) for i in [start, stop), passing over blocks equal to `skip` (NO_BLOCK)."""
        block_of, hash_of = self._block_of, self._hash_of
        for i in range(start, stop):
            h, b = hashes[i], blocks[i]
            if b != skip and h not in block_of and hash_of[b] is None:
                block_of[h] = b
                hash_of[b] = h

    def uncache(self, block: int) -> None:
        """Forget a block's hash (it must not be evictable: evict() or take() it first)."""
        assert block not in self._evictable, f"uncache of evictable block {block}"
        h = self._hash_of[block]
        if h is None:
            raise KeyError(block)
        self._hash_of[block] = None
        del self._block_of[h]

    def add_evictable(self, block: int) -> None:
        """A cached block's last owner let go: it becomes the most recently freed evictable block."""
        assert self._hash_of[block] is not None, f"block {block} is not cached"
        assert block not in self._evictable, f"block {block} is already evictable"
        self._evictable[block] = None

    def add_evictable_all(self, blocks: Sequence[int]) -> None:
        """add_evictable() of each block in order: each cached and not evictable (the caller's ref counts say so:
        a block comes here when its last holder lets go, and an evictable block has none)."""
        if None in map(self._hash_of.__getitem__, blocks):
            raise AssertionError(f"not cached: {[b for b in blocks if self._hash_of[b] is None]}")
        evictable = self._evictable
        for b in blocks:  # (an OrderedDict takes keys one by one about twice as fast as from update(dict))
            evictable[b] = None

    def take(self, block: int) -> None:
        """A cache hit revives an evictable block: it is no longer a candidate for eviction."""
        del self._evictable[block]

    def evict(self) -> int:
        """Drop the least recently freed evictable block from the cache and return it (ref 0)."""
        block, _ = self._evictable.popitem(last=False)
        self.uncache(block)
        return block

    def evict_many(self, n: int) -> list[int]:
        """evict() n times: the n least recently freed evictable blocks, in that order, their hashes dropped."""
        if n > len(self._evictable):
            raise KeyError(f"{n} evictions asked for, {len(self._evictable)} evictable blocks")
        popitem, hash_of, block_of = self._evictable.popitem, self._hash_of, self._block_of
        out = []
        for _ in range(n):
            b = popitem(last=False)[0]
            del block_of[hash_of[b]]
            hash_of[b] = None
            out.append(b)
        return out

    def clear(self) -> list[int]:
        """Forget every hash; return the blocks that were evictable (now merely held, ref 0)."""
        evictable = list(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of[:] = [None] * len(self._hash_of)
        return evictable

    def check_invariants(self) -> None:
        assert len(self._block_of) == len(self._hash_of) - self._hash_of.count(None)
        for h, b in self._block_of.items():
            assert self._hash_of[b] == h, f"block {b}: hash maps disagree"
        for b in self._evictable:
            assert self._hash_of[b] is not None, f"evictable block {b} is not cached"
