"""Triton attention backend: the Triton KV store, paged decode and paged prefill kernels.

Shape legend: T tokens, B sequences, H query heads, Hkv KV heads, D head dim,
N blocks, S block size, M blocks per sequence.

Decode rows (the first meta.num_decode_seqs, one token each) are the memory-bound part of a
step and go to the paged decode kernel (split-K over long contexts). The prefill chunks after
them go to the paged prefill kernel in one launch (kernels/triton/prefill.py): each chunk's
queries over its sequence's keys read through the block table, windows, soft-caps and sinks
included, so no step runs reference code.

Invariant for CUDA graphs: a decode-only forward performs no host sync and allocates only
tensors whose shapes follow from (B, H, D) and host values of the metadata; a slot of -1
(padded graph row) is skipped by the store and a context length of 0 yields a zero output.
"""

from __future__ import annotations

import torch

from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.kernels.triton.attention import paged_decode, store_kv
from servescope.kernels.triton.prefill import paged_prefill


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True  # negative slots and empty contexts are handled by the kernels

    def store_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        mods = dict(window=window, softcap=softcap, sinks=sinks)
        nd = meta.num_decode_seqs
        if nd == meta.num_seqs:  # decode only: T == B, every row is one query
            return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                max_context_len=meta.max_context_len, **mods)
        out = torch.empty_like(q)  # [T, H, D]
        if nd:
            # decodes lead the flat layout: tokens [0, nd) are sequences [0, nd)
            paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd], scale,
                         max_context_len=max(meta.context_lens_cpu[:nd]), out=out[:nd], **mods)
        # sequences [nd, B): query_start_loc[nd:] holds their rows' offsets in the flat q and out
        paged_prefill(q, k_cache, v_cache, meta.block_tables[nd:], meta.context_lens[nd:], meta.query_start_loc[nd:],
                      scale, max_query_len=max(meta.query_lens_cpu[nd:]), out=out, **mods)
        return out
