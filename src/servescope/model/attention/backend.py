"""The attention interface: what a backend receives each step and what it must do.

Shape legend:
  T  tokens in the step (all sequences, flat, no padding)
  B  sequences in the step
  H  query heads, Hkv KV heads, D head dim
  N  KV blocks in the cache, S block size (tokens per block)
  M  max blocks per sequence in this step's block table

Invariant: a step first writes the K and V of all its T new tokens into the paged cache
(`store_kv`), then computes attention of every query over its sequence's cached keys
(`forward`). Because every write of a layer happens before any read of that layer, a
sequence may read a block that another sequence of the same step has just written (a
prefix-cache hit on a block computed in this step).
"""

from __future__ import annotations

from dataclasses import dataclass, field


import torch


@dataclass
class AttentionMetadata:
    """Built by the ModelRunner once per step; read by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * S + offset) of each new token
    block_tables: torch.Tensor  # [B, M] int32: the blocks of each sequence, padded with 0
    context_lens: torch.Tensor  # [B] int32: tokens in the cache for each sequence after this step
    query_start_loc: torch.Tensor  # [B+1] int32: offsets of each sequence's new tokens in the flat T
    # Host copies so that backends can loop and slice without a device sync.
    query_lens_cpu: list
    context_lens_cpu: list
    max_query_len: int
    max_context_len: int
    num_decode_seqs: int = 0  # the first num_decode_seqs sequences have query_len == 1 (decodes first)
    # Per-step values a backend derives once and reuses in every layer (masks, gathered indices).
    scratch: dict = field(default_factory=dict)
    # A cache with a block table per group of layers of one window (kvcache/hybrid.py): window -> that group's
    # metadata (its own slot_mapping, block_tables and scratch; the rest shared). Empty: every layer reads this.
    window_groups: dict = field(default_factory=dict)

    def for_window(self, window: int) -> "AttentionMetadata":
        """The metadata a layer attending over `window` (0: the whole context) reads: its group's."""
        return self.window_groups.get(window, self) if self.window_groups else self

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode_seqs == self.num_seqs

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend:
    """One implementation per kernel family; chosen once at engine start-up."""

    name = "base"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Write k, v [T, Hkv, D] into k_cache, v_cache [N, S, Hkv, D] at meta.slot_mapping."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0, sinks=None) -> torch.Tensor:
        """q [T, H, D]; k, v [T, Hkv, D] (this step's, already stored) -> out [T, H, D]. window > 0: the
        query at position p attends to keys p - window + 1 .. p only (a sliding layer; the blocks before
        that may have been freed, so they are never read). softcap > 0: each score s becomes
        softcap * tanh(s / softcap); sinks [H]: one more logit per head in the softmax, its weight dropped
        (scores.py; a backend whose kernels have neither hands such a layer to the reference's)."""
        raise NotImplementedError

    def latent_decode(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      v_dim: int) -> torch.Tensor:
        """MLA's absorbed decode (model/mla.py): q [B, H, d] (decode rows only) over the latent cache [N, S, 1, d],
        the latent rows as the keys and their first v_dim features as the values -> [B, H, v_dim]. Here: the
        backend's own decode with the whole rows as values, cut to v_dim (a backend with a kernel that reads the
        values' v_dim features only overrides it)."""
        return self.forward(q, None, None, cache, cache, meta, scale)[..., :v_dim]
