"""A prompt's KV blocks out of one engine's cache and into another's (prefill/decode disaggregation).

Out: after the prefill engine finished a request (one sampled token), the full blocks of its prompt are
cached and evictable in its prefix cache until the next allocation reuses them; their ids are found by
the prompt's block hashes (the same chain hash the engine caches them under, with the request's salt),
and their K and V rows of every layer are copied into one tensor [layers, 2, blocks, block_size, kv
heads, head dim (+ scales for int8 / fp8 KV)].

In: the decode engine takes those blocks as if it had computed them: a holder sequence of the prompt's
leading full blocks gets fresh blocks through the KV manager (which hashes them), the rows are written
there, and the holder lets go with its KV marked written, so the blocks stay in the prefix cache as
evictable. The request, added next, is admitted by the decode engine's own scheduler as a prefix-cache
hit over those blocks and computes only the prompt's last partial block (and its first token). Nothing
of the scheduler or the KV manager changes for it; a cache too full to take the blocks just means the
decode engine recomputes the prompt.

A cache with a block table per group of layers of one window (kvcache/hybrid.py): n is the longest run of
full blocks every group can serve as a hit would take it, and each group sends only what a query at n
blocks reads (its view: a windowed group's last few blocks); the holder's blocks before a windowed group's
view are given back unwritten, so no hash points at rows that were never sent.
"""

from __future__ import annotations

import math
import threading
from typing import Optional, Sequence

import torch

from servescope.config import SamplingParams
from servescope.kvcache.prefix_cache import hash_full_blocks, max_hit_blocks
from servescope.kvcache.window_hit import first_in_view
from servescope.scheduler.request import Request


KEEP_BYTES = 256 << 20  # host buffers a BufferPool keeps for reuse, in all


class BufferPool:
    """Host buffers for KV on its way out or in, reused: fresh memory costs a page fault per page on first
    touch, which on a VM costs more than the copy into it (47 MB gathered: ~100 ms into fresh memory, ~30 ms
    into a reused buffer). Spares are kept up to `keep_bytes` in all (the smallest let go first); take and give
    may be called from different threads."""

    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self._spare: list = []  # flat uint8 tensors
        self._lent: dict = {}  # data pointer of a tensor taken -> its flat buffer
        self._lock = threading.Lock()

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over a spare buffer (or a new one): give it back when done with it."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        with self._lock:
            fits = [i for i, b in enumerate(self._spare) if b.numel() >= nbytes]
            flat = self._spare.pop(min(fits, key=lambda i: self._spare[i].numel())) if fits else None
        if flat is None:
            flat = torch.empty(nbytes, dtype=torch.uint8)
        out = flat[:nbytes].view(dtype).view(tuple(shape))
        with self._lock:
            self._lent[out.data_ptr()] = flat
        return out

    def give(self, tensor: torch.Tensor) -> None:
        """Back to the spares (a tensor this pool did not lend: ignored)."""
        with self._lock:
            flat = self._lent.pop(tensor.data_ptr(), None) if tensor.numel() else None
            if flat is None:
                return
            self._spare.append(flat)
            self._spare.sort(key=torch.Tensor.numel)
            while sum(b.numel() for b in self._spare) > self.keep_bytes:
                self._spare.pop(0)

    @property
    def spare_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._spare)


def block_shape(caches, num_blocks: int) -> tuple:
    """The shape gather_blocks gives for `num_blocks` blocks of these caches."""
    return (len(caches), 2, num_blocks, *caches[0][0].shape[1:])


def gather_blocks(caches, block_ids: Sequence[int], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows of `block_ids` of every layer's (K, V) cache, copied once into one contiguous CPU tensor
    [layers, 2, blocks, *a block's shape] (what is sent: no per-layer tensors stacked afterwards): `out` when
    given (a CPU tensor of that shape and the caches' dtype, e.g. from a BufferPool), else a new one."""
    k0 = caches[0][0]
    shape = block_shape(caches, len(block_ids))
    if out is not None and (tuple(out.shape) != shape or out.dtype != k0.dtype or out.device.type != "cpu"):
        raise ValueError(f"gather_blocks: out is {tuple(out.shape)} {out.dtype} on {out.device}, needs {shape} "
                         f"{k0.dtype} on the CPU")
    on_cpu = k0.device.type == "cpu"
    dst = out if out is not None and on_cpu else torch.empty(shape, dtype=k0.dtype, device=k0.device)
    idx = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
    for layer, (k, v) in enumerate(caches):
        torch.index_select(k, 0, idx, out=dst[layer, 0])
        torch.index_select(v, 0, idx, out=dst[layer, 1])
    if on_cpu:
        return dst
    return out.copy_(dst) if out is not None else dst.cpu()  # one device-to-host copy off a GPU


def scatter_blocks(caches, block_ids: Sequence[int], kv: torch.Tensor) -> None:
    """gather_blocks' inverse: `kv`'s rows written into `block_ids` of every layer's cache."""
    k0 = caches[0][0]
    idx = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
    kv = kv.to(k0.device)  # one host-to-device copy onto a GPU; none on a CPU
    for layer, (k, v) in enumerate(caches):
        k.index_copy_(0, idx, kv[layer, 0])
        v.index_copy_(0, idx, kv[layer, 1])


def export_prompt_kv(engine, prompt_ids: Sequence[int], cache_salt: Optional[str],
                     pool: Optional[BufferPool] = None) -> tuple:
    """(KV, n): the KV of the prompt's leading n full blocks that `engine`'s prefix cache holds, in a buffer of
    `pool` when given (give it back once sent). Call right after the step that finished the request, before
    another allocation can evict them. One block table: [layers, 2, n, *block]. A table per group of layers
    (kvcache/hybrid.py): each group's blocks that a query at n blocks reads (a windowed group's last ones), the
    groups one after another as [rows, *block] (`group_parts`), n being the longest run every group serves."""
    km = engine.kv_manager
    limit = max_hit_blocks(len(prompt_ids), km.block_size)
    hashes = hash_full_blocks(prompt_ids, km.block_size, limit=limit, salt=cache_salt)
    caches = engine.runner.kv_caches
    if km.num_groups == 1:
        blocks = km.cached_run(hashes)
        out = None if pool is None else pool.take(block_shape(caches, len(blocks)), caches[0][0].dtype)
        return gather_blocks(caches, blocks, out), len(blocks)
    n, tables = km.cached_tables(hashes)
    shape = kv_shape(engine, n)
    kv = pool.take(shape, caches[0][0].dtype) if pool is not None else torch.empty(shape, dtype=caches[0][0].dtype)
    for (layers, first, view), table in zip(group_parts(engine, n, kv), tables):
        gather_blocks(layers, table[first:n], view)
    return kv, n


def group_parts(engine, n: int, kv: torch.Tensor) -> list:
    """Per group of layers of one window (the KV manager's order): (its layers' caches, the first block a query
    at n blocks reads there, its part of the hybrid KV tensor `kv` as [layers, 2, blocks, *block])."""
    km, caches = engine.kv_manager, engine.runner.kv_caches
    parts, offset = [], 0
    for window in km.windows:
        layers = [c for c, w in zip(caches, engine.runner.layer_windows) if w == window]
        first = min(first_in_view(n * km.block_size, window, km.block_size), n)
        rows = len(layers) * 2 * (n - first)
        parts.append((layers, first, kv[offset:offset + rows].view(len(layers), 2, n - first, *kv.shape[1:])))
        offset += rows
    return parts


def kv_shape(engine, num_blocks: int) -> tuple:
    """The shape export_prompt_kv gives for `num_blocks` blocks of this engine's cache."""
    caches, km = engine.runner.kv_caches, engine.kv_manager
    if km.num_groups == 1:
        return block_shape(caches, num_blocks)
    rows = sum(2 * (num_blocks - min(first_in_view(num_blocks * km.block_size, w, km.block_size), num_blocks))
               for w in engine.runner.layer_windows)
    return (rows, *caches[0][0].shape[1:])


def adopt_prompt_kv(engine, request_id: str, prompt_ids: Sequence[int], cache_salt: Optional[str],
                    kv: torch.Tensor, num_blocks: Optional[int] = None) -> int:
    """Write `kv` (export_prompt_kv's tensor of another engine of the same model and KV layout, for the prompt's
    first num_blocks full blocks; one block table: its shape says) into this engine's cache as cached,
    evictable blocks of the prompt's leading full blocks. Returns the blocks taken; 0 (nothing changed) when
    the cache has no room or nothing was sent. A windowed group's blocks before the sent view are given back
    unwritten (kvcache/hybrid.release_out_of_view): a later hit needs only the view."""
    km = engine.kv_manager
    hybrid = km.num_groups > 1
    if num_blocks is None:
        if hybrid:
            raise ValueError("a KV cache with a table per group of layers needs the sent KV's number of blocks")
        num_blocks = kv.shape[2] if kv.dim() > 2 else 0
    caches = engine.runner.kv_caches
    if tuple(kv.shape) != kv_shape(engine, num_blocks) or kv.dtype != caches[0][0].dtype:
        raise ValueError(f"KV of shape {tuple(kv.shape)} {kv.dtype} does not fit this engine's cache "
                         f"{kv_shape(engine, num_blocks)} {caches[0][0].dtype}")
    if num_blocks == 0:
        return 0
    tokens = list(prompt_ids[:num_blocks * km.block_size])
    holder = Request(f"{request_id}/kv-in", tokens, SamplingParams(cache_salt=cache_salt), arrival_time=0.0)
    if not km.allocate_slots(holder, len(tokens)):
        return 0
    try:
        if not hybrid:
            scatter_blocks(caches, km.get_block_ids(holder.request_id), kv)
        else:
            for (layers, first, view), table in zip(group_parts(engine, num_blocks, kv),
                                                    km.get_group_block_ids(holder.request_id)):
                scatter_blocks(layers, table[first:num_blocks], view)
            km.release_out_of_view(holder, len(tokens))
        holder.num_computed_tokens = len(tokens)  # written: free() leaves the hashed blocks findable
    finally:
        km.free(holder)  # a failed copy frees unwritten blocks (their hashes go): no block leaks
    return num_blocks
