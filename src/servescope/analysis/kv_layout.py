"""The KV cache per group of layers of one attention kind (full, or sliding over a window w): bytes per token,
the tokens each group's layers hold per sequence, and how the engine splits a memory budget between the groups.

The engine keeps a block table per group of layers of one window (kvcache/hybrid.py, vLLM's hybrid allocator
idea) when a model mixes windows (Gemma 2, Gemma 3, gpt-oss): a windowed group holds at most cdiv(w, S) + 1
blocks per sequence, the full group every block; `group_blocks` sizes each group's pool (per pipeline stage: each
holds its layers' groups). One table for all layers remains where per-group tables are not built
(disable_hybrid_kv_cache_manager; a draft model over a target without full-attention layers): there a hybrid keeps
every block in every layer (`blocks_held`, the planner's max_concurrent_sequences); an all-windowed model
(Mistral) gives back what slid out either way (config/layers.window_of). Latent attention (MLA) is a group of kind
"latent": one row of kv_lora_rank + qk_rope_head_dim values per token and layer instead of K and V per KV head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servescope.analysis.op_counts import kv_cache_bytes_per_token
from servescope.config import ModelConfig
from servescope.config.layers import first_in_view, window_of


@dataclass(frozen=True)
class KVGroup:
    kind: str  # "full" | "sliding" | "latent"
    window: int  # 0 for full attention
    layers: int
    bytes_per_token: int  # K and V of one token over this group's layers
    engine_tokens_per_sequence: int  # slots its layers hold per sequence with one table for all layers
    needed_tokens_per_sequence: int  # what the kind needs (whole blocks): a window's, or the context's; what
    # the engine's table per group holds

    @property
    def engine_bytes_per_sequence(self) -> int:
        return self.bytes_per_token * self.engine_tokens_per_sequence

    @property
    def needed_bytes_per_sequence(self) -> int:
        return self.bytes_per_token * self.needed_tokens_per_sequence


def blocks_held(cfg: ModelConfig, context: int, block_size: int) -> int:
    """Blocks one sequence of `context` tokens holds with one block table for all layers (the same in every
    layer)."""
    blocks = math.ceil(context / block_size)
    window = window_of(cfg.layer_specs())
    return min(blocks, math.ceil(window / block_size) + 1) if window else blocks


def kv_groups(cfg: ModelConfig, kv_dtype: str, context: int, block_size: int) -> tuple:
    """One KVGroup per attention kind of cfg's layers (full first), at `context` tokens per sequence."""
    per_layer = kv_cache_bytes_per_token(cfg, kv_dtype) // cfg.num_hidden_layers
    counts = layers_per_window(cfg)
    held = blocks_held(cfg, context, block_size) * block_size
    blocks = math.ceil(context / block_size)
    out = []
    for window in sorted(counts):
        need = min(blocks, math.ceil(window / block_size) + 1) if window else blocks
        kind = "sliding" if window else ("latent" if cfg.mla else "full")
        out.append(KVGroup(kind, window, counts[window], per_layer * counts[window],
                           held, need * block_size))
    return tuple(out)


def per_group_capacity(groups, free_bytes: int) -> int:
    """Sequences that fit in free_bytes when each group holds only what its kind needs (a table per group)."""
    need = sum(g.needed_bytes_per_sequence for g in groups)
    return free_bytes // need if need else 0


def layers_per_window(cfg: ModelConfig) -> dict:
    """window -> the number of cfg's layers attending over it (0: the whole context)."""
    counts: dict = {}
    for spec in cfg.layer_specs():
        counts[spec.attention.window] = counts.get(spec.attention.window, 0) + 1
    return counts


def group_blocks(layers: dict, num_blocks: int, block_size: int, max_num_seqs: int, max_step_tokens: int,
                 max_num_batched_tokens: int, stages: tuple = ()) -> dict:
    """The pools of a cache with a block table per group (kvcache/hybrid.py) in the memory of num_blocks blocks
    of every layer: window -> blocks. layers: window -> its layers (layers_per_window).

    A windowed group gets what max_num_seqs sequences hold at once -- each at most cdiv(w + step, S) + 1 blocks
    (its window, and the tokens one step adds: 1 + drafts for a decode) -- plus one step's prefill chunks
    (cdiv(max_num_batched_tokens, S) + 1), never more than num_blocks; the first group (full attention, or the
    widest window) gets the rest of the bytes: with L layers in all and L_g in group g,
    N_first = (num_blocks * L - sum of N_g * L_g over the others) // L_first.

    stages: per pipeline stage, its layers per window (() : one process holds them all). Every stage keeps the
    pools of the groups its layers belong to, over the same block ids, in no more than num_blocks blocks of each
    of its own layers; N_first is then the least that the stages holding first-group layers leave for it."""
    first = first_window(layers)
    out = {}
    for w in layers:
        if w != first:
            per_seq = math.ceil((w + max_step_tokens) / block_size) + 1
            out[w] = min(num_blocks, max_num_seqs * per_seq + math.ceil(max_num_batched_tokens / block_size) + 1)
    out[first] = min(n for n in first_group_limits(stages or (layers,), first, out, num_blocks) if n is not None)
    return out


def first_window(windows) -> int:
    """The first group's window: full attention (0) where some layer has it, else the widest window (the group
    that gets the rest of the bytes and binds a sequence's length)."""
    return 0 if 0 in windows else max(windows)


def first_group_limits(stages: tuple, first: int, others: dict, num_blocks: int) -> list:
    """Per stage (its layers per window), the first group's pool that its num_blocks blocks of each of its layers
    leave after the other groups' pools (others: window -> blocks), or None where it holds no first-group layer:
    group_blocks takes the least (the stage that runs out first; analysis/kv_stages.py)."""
    return [(num_blocks * sum(held.values()) - sum(others[w] * n for w, n in held.items() if w != first))
            // held[first] if held.get(first) else None for held in stages]


def handed_over_bytes(cfg: ModelConfig, kv_dtype: str, num_tokens: int, block_size: int) -> int:
    """KV bytes prefill/decode disaggregation sends for a prompt's first num_tokens tokens (whole blocks:
    engine/kv_transfer.py): every layer's tokens with one block table for all layers; with a table per group of
    layers (windows that differ between layers: kvcache/hybrid.py) each layer only the blocks a query at
    num_tokens reads -- all of a whole-context layer's, a windowed layer's last few."""
    windows = [spec.attention.window for spec in cfg.layer_specs()]
    per_layer_token = kv_cache_bytes_per_token(cfg, kv_dtype) // len(windows)
    if len(set(windows)) == 1:
        return per_layer_token * num_tokens * len(windows)
    seen = (num_tokens - min(first_in_view(num_tokens, w, block_size) * block_size, num_tokens) for w in windows)
    return per_layer_token * sum(seen)
