"""The KV cache of a pipeline's stages: which layers each stage holds, the pools the engine gives a model's groups
of layers, and what each stage allocates of them.

Under pipeline parallelism each stage (a process, or T of them) holds its own layers and their caches only. With a
block table per group of layers of one window (kvcache/hybrid.py) one manager on rank 0 hands out every group's
block ids for all stages, so a group's pool has one size N_g on every stage, and a stage allocates N_g blocks for
each of its layers in group g. A hybrid model's stages hold different mixes of kinds (Gemma 3's five local to one
global over two stages: one stage may hold no global layer), so their KV bytes per token per group and what they
allocate differ. The engine sizes the blocks on rank 0 from stage 0's layers (the most of any stage: the first
L % P stages get one more), num_blocks blocks of each of its layers; every stage keeps its own layers' pools in no
more than num_blocks blocks of each of its layers, so the full (first) group's pool is the least any stage holding
such layers leaves for it: the capacity is the minimum over stages, set by the stage that runs out first
(`first_group_limits`, `group_blocks`). A stage cannot lend its windowed layers' saved bytes to another stage's
full layers.

The engine (engine/kv_sizing.py, every rank), the memory planner, `explain --pp` and the simulator all size the
pools here, so that what they report is what the engine's stages allocate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servescope.analysis.collectives import shard_config
from servescope.analysis.kv_layout import first_group_limits, first_window, group_blocks, layers_per_window
from servescope.analysis.op_counts import kv_cache_bytes_per_token, table_bytes, weight_bytes
from servescope.config import ModelConfig


def step_token_limit(chunked: bool, max_num_batched_tokens: int, max_model_len: int) -> int:
    """The most tokens one step adds to one sequence: a chunk with chunked prefill, else a whole prompt (the
    engine's hybrid manager, its scheduler's token budget and the simulator's both take this rule)."""
    return max_num_batched_tokens if chunked else max(max_num_batched_tokens, max_model_len)


def rank0_kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, tp: int = 1, pp: int = 1) -> int:
    """One token's K and V on the engine's rank 0: its tensor-parallel shard's KV heads (analysis/collectives.
    shard_config, parallel/layout.local_kv_heads's rule) over pipeline stage 0's layers -- the shard config the
    engine's rank 0 sizes its cache and its StepRecords' kv_bytes_used from (telemetry/step_record.kv_bytes_used)."""
    return kv_cache_bytes_per_token(stage_configs(shard_config(cfg, tp), pp)[0], kv_dtype)


def stage_layers(num_layers: int, pp: int) -> list:
    """Each stage's layers: consecutive, the first L % P stages one layer more (so that stage 0, whose KV cache
    rank 0 sizes for everyone, holds the most)."""
    if pp < 1 or pp > num_layers:
        raise ValueError(f"{pp} pipeline stages cannot split {num_layers} layers (1 <= P <= L)")
    base, extra = divmod(num_layers, pp)
    starts = [s * base + min(s, extra) for s in range(pp)]
    return [range(start, start + base + (s < extra)) for s, start in enumerate(starts)]


def stage_configs(cfg: ModelConfig, pp: int) -> list:
    """Each stage's layers as a model config of their own (their attention kinds and MLPs:
    ModelConfig.layers_config)."""
    return [cfg.layers_config(r) for r in stage_layers(cfg.num_hidden_layers, pp)]


def stage_weight_bytes(cfg: ModelConfig, wdt: str, adt: str, pp: int, stage: int) -> int:
    """Weight bytes the rank of pipeline stage `stage` holds, as parallel/pipeline.keep_stage leaves its model: its
    layers and the final norm (every stage keeps the backbone's); stage 0 the embedding table; the last stage the
    head (a tied head keeps the table as its head there, so a tied model holds the table on both end stages). One
    stage: weight_bytes."""
    if pp == 1:
        return weight_bytes(cfg, wdt, adt)
    part = stage_configs(cfg, pp)[stage]
    row, head, both = table_bytes(part, wdt, adt)
    layers_and_norm = weight_bytes(part, wdt, adt) - both
    return layers_and_norm + (cfg.vocab_size * row if stage == 0 else 0) + (head if stage == pp - 1 else 0)


def engine_group_blocks(cfg: ModelConfig, num_blocks: int, block_size: int, max_num_seqs: int, step_tokens: int,
                        max_step_tokens: int, pp: int = 1) -> Optional[dict]:
    """window -> the blocks of each group's pool that the engine builds for cfg (the whole model) in the memory of
    num_blocks blocks of every layer of each stage, or None where its layers are of one kind (one table for all
    layers). step_tokens: the tokens one decode adds to a sequence (1 + drafts); max_step_tokens: the most one
    step adds (a chunk, or a whole prompt)."""
    layers = layers_per_window(cfg)
    if len(layers) < 2:
        return None
    stages = tuple(layers_per_window(c) for c in stage_configs(cfg, pp))
    return group_blocks(layers, num_blocks, block_size, max_num_seqs, step_tokens, max_step_tokens, stages)


@dataclass(frozen=True)
class StagePool:
    """One stage's KV cache, as its runner allocates it (bytes of the rank's shard: its KV heads)."""

    stage: int
    first_layer: int
    num_layers: int
    group_layers: dict  # window -> this stage's layers in that group (0: full attention)
    bytes_per_token: dict  # window -> one token's K and V over this stage's layers of that group
    pool_blocks: dict  # window -> the blocks it allocates for each of its layers of that group (the group's pool)
    kv_bytes: int  # what it allocates
    budget_bytes: int  # num_blocks blocks of each of its layers: the memory the engine's rule gives it
    first_group_limit: Optional[int]  # the first group's pool this stage's budget allows (None: no such layer)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(self.bytes_per_token.values())

    def capacity_tokens(self, block_size: int) -> dict:
        """window -> tokens its group's pool holds (the same on every stage holding the group)."""
        return {w: n * block_size for w, n in self.pool_blocks.items()}


def stage_pools(cfg: ModelConfig, kv_dtype: str, num_blocks: int, block_size: int, pools: Optional[dict],
                pp: int) -> tuple:
    """Each stage's StagePool. cfg: the model one rank holds (its tensor-parallel shard, every layer); num_blocks:
    the engine's blocks (sized from stage 0); pools: engine_group_blocks's (None: one table, every layer holds
    num_blocks blocks)."""
    per_layer = kv_cache_bytes_per_token(cfg, kv_dtype) // cfg.num_hidden_layers
    configs = stage_configs(cfg, pp)
    held = [layers_per_window(c) for c in configs]
    limits = (first_group_limits(tuple(held), first_window(pools), pools, num_blocks) if pools
              else [num_blocks] * pp)
    out, start = [], 0
    for s, (c, windows) in enumerate(zip(configs, held)):
        blocks = {w: (pools[w] if pools else num_blocks) for w in sorted(windows)}
        per_tok = {w: per_layer * n for w, n in sorted(windows.items())}
        out.append(StagePool(s, start, c.num_hidden_layers, dict(sorted(windows.items())), per_tok, blocks,
                             sum(blocks[w] * block_size * per_tok[w] for w in windows),
                             num_blocks * block_size * per_layer * c.num_hidden_layers, limits[s]))
        start += c.num_hidden_layers
    return tuple(out)


def binding_stage(pools: tuple) -> int:
    """The stage that runs out first: the least first_group_limit (the first such stage on a tie). With one table
    every stage's limit is num_blocks and stage 0, the largest, sized them."""
    return min(pools, key=lambda p: (p.first_group_limit is None, p.first_group_limit or 0, p.stage)).stage
