"""BlockAllocator: the free list and reference counts of the physical KV blocks.

A block is in exactly one of three states:
  free       on the free list, ref count 0;
  held       ref count 0, off the free list: the prefix cache keeps it as evictable;
  used       ref count >= 1 (one per block table that holds it).
The allocator only knows "on the free list or not" and the counts; which held blocks
are evictable is the prefix cache's business. Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque

from servescope.errors import ServescopeError


class NoFreeBlocksError(ServescopeError):
    """allocate() was called with an empty free list."""


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 in free-list order (FIFO: a released block goes to the back)."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._on_free_list = [True] * num_blocks
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take the first free block; its ref count becomes 1."""
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} KV blocks are in use")
        b = self._free.popleft()
        self._on_free_list[b] = False
        self._ref[b] = 1
        return b

    def allocate_many(self, n: int) -> list[int]:
        """allocate() n times (n <= num_free): the first n free blocks, in free-list order."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"{n} KV blocks asked for, {len(self._free)} free")
        free, on_free, ref = self._free, self._on_free_list, self._ref
        out = [free.popleft() for _ in range(n)]
        for b in out:
            on_free[b] = False
            ref[b] = 1
        return out

    def reuse(self, blocks: list[int]) -> list[int]:
        """Give each held block (ref 0, off the free list: one just evicted from the prefix cache) its first
        owner again: what release() then allocate() of it does when the free list is empty, without the trip.
        Returns `blocks`."""
        on_free, ref = self._on_free_list, self._ref
        for b in blocks:
            if on_free[b] or ref[b] != 0:
                raise AssertionError(f"reuse of block {b}: free={on_free[b]} ref={ref[b]}")
            ref[b] = 1
        return blocks

    def incref(self, b: int) -> int:
        """Add an owner. Allowed on a held (ref 0, evictable) block, never on a free one."""
        if self._on_free_list[b]:
            raise AssertionError(f"incref of block {b}, which is on the free list")
        self._ref[b] += 1
        return self._ref[b]

    def decref(self, b: int) -> int:
        """Drop an owner and return the new count. At 0 the block is held, not freed: the caller
        either releases it or hands it to the prefix cache."""
        if self._ref[b] <= 0:
            raise AssertionError(f"decref of block {b}, whose ref count is {self._ref[b]}")
        self._ref[b] -= 1
        return self._ref[b]

    def decref_all(self, blocks) -> list[int]:
        """decref() of each block in order; the blocks whose count reached 0, in that order."""
        ref, out = self._ref, []
        for b in blocks:
            n = ref[b] - 1
            if n < 0:
                raise AssertionError(f"decref of block {b}, whose ref count is {ref[b]}")
            ref[b] = n
            if not n:
                out.append(b)
        return out

    def release(self, b: int) -> None:
        """Put a held block (ref 0) back on the free list."""
        if self._on_free_list[b] or self._ref[b] != 0:
            raise AssertionError(f"release of block {b}: free={self._on_free_list[b]} ref={self._ref[b]}")
        self._on_free_list[b] = True
        self._free.append(b)

    def ref_count(self, b: int) -> int:
        return self._ref[b]

    def is_free(self, b: int) -> bool:
        return self._on_free_list[b]

    def free_block_ids(self) -> list[int]:
        """The free list, in allocation order (tests, invariants)."""
        return list(self._free)
