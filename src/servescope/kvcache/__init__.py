"""servescope.kvcache: paged KV block allocator, prefix cache and per-request block tables (pure Python)."""

from servescope.kvcache.block_allocator import BlockAllocator, NoFreeBlocksError
from servescope.kvcache.manager import KVCacheManager
from servescope.kvcache.prefix_cache import PrefixCache, hash_block_tokens, hash_full_blocks

__all__ = [
    "BlockAllocator",
    "NoFreeBlocksError",
    "KVCacheManager",
    "PrefixCache",
    "hash_block_tokens",
    "hash_full_blocks",
]
