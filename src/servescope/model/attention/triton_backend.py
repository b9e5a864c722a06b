"""Triton attention backend: Triton KV store and paged decode; prefill chunks via the reference.

Shape legend: T tokens, B sequences, H query heads, Hkv KV heads, D head dim,
N blocks, S block size, M blocks per sequence.

Decode rows (the first meta.num_decode_seqs, one token each) are the memory-bound part of a
step and go to the paged decode kernel, which reads K and V straight through the block table.
Prefill chunks are compute-bound and rare per step; they reuse TorchAttentionBackend (SDPA) on
a sub-metadata of the non-decode rows, so the two backends cannot drift apart.

Invariant for CUDA graphs: a decode-only forward performs no host sync and allocates only
tensors whose shapes follow from (B, H, D) and host values of the metadata; a slot of -1
(padded graph row) is skipped by the store and a context length of 0 yields a zero output.
"""

from __future__ import annotations

import torch

from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.attention.reference import TorchAttentionBackend
from servescope.kernels.triton.attention import paged_decode, store_kv


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True  # negative slots and empty contexts are handled by the kernels

    def __init__(self):
        self._reference = TorchAttentionBackend()

    def store_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        # soft-caps and sinks: the decode kernel's SOFTCAP / SINKS, the reference's scores.attend for prefills
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
        out[nd:] = self._reference.forward(q[nd:], k[nd:], v[nd:], k_cache, v_cache,
                                           _prefill_rows(meta, nd), scale, **mods)
        return out


def _prefill_rows(meta: AttentionMetadata, nd: int) -> AttentionMetadata:
    """The metadata of sequences [nd, B) alone (their tokens start at nd, after the decodes)."""
    if nd == 0:
        return meta
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[nd:],
        block_tables=meta.block_tables[nd:],
        context_lens=meta.context_lens[nd:],
        query_start_loc=meta.query_start_loc[nd:] - nd,
        query_lens_cpu=meta.query_lens_cpu[nd:],
        context_lens_cpu=meta.context_lens_cpu[nd:],
        max_query_len=max(meta.query_lens_cpu[nd:]),
        max_context_len=max(meta.context_lens_cpu[nd:]),
        num_decode_seqs=0,
    )
