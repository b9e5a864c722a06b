"""Where device memory goes: weights, activations, and the KV cache that gets whatever is left.

The KV cache is paged in blocks of `block_size` tokens, so a sequence of n tokens holds
ceil(n / block_size) blocks; the planner counts whole blocks, as the block allocator does.
Activations are an estimate of the peak live tensors of one step of `max_num_batched_tokens`
tokens (see `activation_bytes`); pass `activation_reserve_bytes` to override it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from servescope.analysis.hardware import DTYPE_BYTES
from servescope.analysis.kv_layout import blocks_held, kv_groups, per_group_capacity
from servescope.analysis.kv_stages import (binding_stage, engine_group_blocks, stage_configs, stage_pools,
                                           stage_weight_bytes)
from servescope.analysis.op_counts import kv_cache_bytes_per_token, resolve_dtypes
from servescope.config import BatchingConfig, ModelConfig
from servescope.errors import InvalidParameterError


def activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int, act_dtype: str = "bfloat16",
                     max_num_seqs: Optional[int] = None) -> int:
    """Peak activation memory of one step of T tokens, summing the tensors alive at once in an
    unfused forward: residual and normed hidden [T, d] x2, q/k/v [T, q + 2kv], attention output
    [T, q], gate/up/act [T, i] x3, plus float32 logits [B, V] for B = min(T, max_num_seqs) rows.
    Generous by design: a plan should not run out of memory at its first long prompt."""
    T = int(max_num_batched_tokens)
    B = T if max_num_seqs is None else min(T, int(max_num_seqs))
    ab = DTYPE_BYTES[act_dtype]
    per_token = 2 * cfg.hidden_size + 2 * cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size
    return T * per_token * ab + B * cfg.vocab_size * 4


@dataclass(frozen=True)
class MemoryPlan:
    """An itemised memory budget. All sizes in bytes."""

    memory_bytes: int
    weight_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int
    block_size: int
    kv_bytes_per_block: int
    context_len: int
    blocks_per_sequence: int
    kv_bytes_per_sequence: int  # whole blocks at context_len
    free_for_kv_bytes: int  # memory - weights - activations (0 if negative)
    num_kv_blocks: int
    max_concurrent_sequences: int  # sequences of context_len that fit at once with one block table for all layers
    fits: bool  # weights + activations fit at all and at least one sequence fits
    # per attention kind (analysis/kv_layout.py): bytes per token, tokens held per sequence with one table and
    # needed by the kind; and the sequences that fit with a block table per group (what the engine does for a
    # hybrid: kvcache/hybrid.py; one process's split, whose full layers get the windowed layers' saved bytes)
    kv_groups: tuple = ()
    max_concurrent_sequences_per_group_tables: int = 0
    # pipeline parallelism (analysis/kv_stages.py): the weights, bytes per token and blocks above are stage 0's
    # (rank 0 sizes the blocks from its layers); each stage's pools as its runner allocates them, the groups'
    # pools (window -> blocks; empty with one table for all layers) and the stage that runs out first
    pipeline_stages: int = 1
    group_pool_blocks: dict = field(default_factory=dict)
    stages: tuple = ()
    binding_stage: int = 0

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kv_cache_tokens"] = self.kv_cache_tokens
        d["stages"] = [{**asdict(p), "kv_bytes_per_token": p.kv_bytes_per_token,
                        "capacity_tokens": p.capacity_tokens(self.block_size)} for p in self.stages]
        return d


def plan_memory(cfg: ModelConfig, memory_bytes: int, weight_dtype: str = "bfloat16",
                kv_dtype: Optional[str] = None, context_len: Optional[int] = None, block_size: int = 16,
                *, act_dtype: Optional[str] = None, max_num_batched_tokens: int = 2048,
                max_num_seqs: Optional[int] = None, activation_reserve_bytes: Optional[int] = None,
                memory_utilization: float = 1.0, pp: int = 1, step_tokens: int = 1,
                group_tables: bool = True) -> MemoryPlan:
    """Budget `memory_bytes * memory_utilization` for weights, one step's activations and the KV
    cache; count how many sequences of `context_len` tokens (default: the model's maximum) fit.
    pp: pipeline stages (cfg: every layer; the budget is stage 0's rank's, whose layers size the blocks, as the
    engine's rank 0 does); step_tokens: what one decode adds to a sequence (1 + drafts); group_tables: a block
    table per group of layers for a hybrid (the engine's default), else one for all layers."""
    _check_plan(memory_bytes, block_size, memory_utilization, pp, cfg)
    ctx = cfg.max_position_embeddings if context_len is None else int(context_len)
    if ctx < 1:
        raise InvalidParameterError("context_len", f"context_len must be at least 1, got {ctx}")
    wdt, adt, kdt = resolve_dtypes(weight_dtype, act_dtype, kv_dtype)
    budget = int(memory_bytes * memory_utilization)
    configs = stage_configs(cfg, pp)
    w = stage_weight_bytes(cfg, wdt, adt, pp, 0)  # rank 0's: stage 0's layers and the embedding
    act = (activation_bytes(cfg, max_num_batched_tokens, adt, max_num_seqs)
           if activation_reserve_bytes is None else int(activation_reserve_bytes))
    per_tok = kv_cache_bytes_per_token(configs[0], kdt)
    per_block = per_tok * block_size
    blocks_per_seq = blocks_held(cfg, ctx, block_size)  # all-windowed: at most a window's blocks
    groups = kv_groups(cfg, kdt, ctx, block_size)
    free = max(budget - w - act, 0)
    num_blocks = free // per_block
    max_seqs = num_blocks // blocks_per_seq
    seqs = max_num_seqs or BatchingConfig().max_num_seqs  # (the engine's default)
    pools = (engine_group_blocks(cfg, num_blocks, block_size, seqs, step_tokens, max_num_batched_tokens, pp)
             if group_tables and num_blocks else None)
    stages = stage_pools(cfg, kdt, num_blocks, block_size, pools, pp)
    # sequences each stage holds when its pools take what its kinds need, in its share of the bytes that
    # stage 0's budget sizes (one process: `free`); the stage that holds fewest binds
    per_group = min(per_group_capacity(kv_groups(c, kdt, ctx, block_size), free * c.num_hidden_layers
                                       // configs[0].num_hidden_layers) for c in configs)
    return MemoryPlan(
        memory_bytes=int(memory_bytes), weight_bytes=w, activation_bytes=act, kv_bytes_per_token=per_tok,
        block_size=block_size, kv_bytes_per_block=per_block, context_len=ctx,
        blocks_per_sequence=blocks_per_seq, kv_bytes_per_sequence=blocks_per_seq * per_block,
        free_for_kv_bytes=free, num_kv_blocks=num_blocks, max_concurrent_sequences=max_seqs,
        fits=max_seqs >= 1, kv_groups=groups, max_concurrent_sequences_per_group_tables=per_group,
        pipeline_stages=pp, group_pool_blocks=dict(pools or {}), stages=stages, binding_stage=binding_stage(stages),
    )


def _check_plan(memory_bytes: int, block_size: int, memory_utilization: float, pp: int, cfg: ModelConfig) -> None:
    if memory_bytes <= 0:
        raise InvalidParameterError("memory_bytes", f"memory_bytes must be positive, got {memory_bytes}")
    if block_size <= 0:
        raise InvalidParameterError("block_size", f"block_size must be positive, got {block_size}")
    if not 0 < memory_utilization <= 1:
        raise InvalidParameterError("memory_utilization",
                                    f"memory_utilization must be in (0, 1], got {memory_utilization}")
    if not 1 <= pp <= cfg.num_hidden_layers:
        raise InvalidParameterError("pp", f"pipeline stages must be between 1 and the {cfg.num_hidden_layers} "
                                          f"layers, got {pp}")


def max_context_for_concurrency(cfg: ModelConfig, memory_bytes: int, concurrency: int,
                                weight_dtype: str = "bfloat16", kv_dtype: Optional[str] = None,
                                block_size: int = 16, *, cap_at_model_max: bool = True, **plan_kw) -> int:
    """The longest context (a multiple of block_size) at which `concurrency` sequences fit at once;
    0 if not even one block each fits. Capped at cfg.max_position_embeddings unless told not to."""
    if concurrency < 1:
        raise InvalidParameterError("concurrency", f"concurrency must be at least 1, got {concurrency}")
    plan = plan_memory(cfg, memory_bytes, weight_dtype, kv_dtype, context_len=block_size,
                       block_size=block_size, **plan_kw)
    ctx = (plan.num_kv_blocks // concurrency) * block_size
    return min(ctx, cfg.max_position_embeddings) if cap_at_model_max else ctx
