"""Who holds what: ranks -> (pipeline stage, tensor-parallel shard), each stage's layers, and the checks
that reject a bad combination before any process starts.

Rank r is shard r % W of stage r // W (W = max(T, X) ranks per stage; T = tensor_parallel_size,
X = expert_parallel_size, P = pipeline_parallel_size), so the ranks of one stage are consecutive (one
node's GPUs under torchrun) and rank 0, the engine, is shard 0 of stage 0. The head (and, tied, the
embedding it shares) lives on the last stage, vLLM's layout. Expert parallelism runs over the ranks of the
stage: X = T (each rank one attention shard and E/X experts), or T = 1 (attention replicated on the X ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from servescope.analysis.kv_stages import stage_layers  # the one split rule: the planner's and simulator's too
from servescope.config import ModelConfig
from servescope.config.moe import expert_layout_problem
from servescope.errors import EngineConfigError


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    num_layers: int
    ep: int = 1  # expert-parallel ranks (1, or the stage's ranks)

    @property
    def width(self) -> int:
        """Ranks per stage."""
        return max(self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.width * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.width

    def shard_of(self, rank: int) -> int:
        return rank % self.width

    def rank_of(self, stage: int, shard: int) -> int:
        return stage * self.width + shard

    def stage_layers(self, stage: int) -> range:
        return stage_layers(self.num_layers, self.pp)[stage]

    def tp_group_ranks(self, stage: int) -> list:
        return [self.rank_of(stage, s) for s in range(self.width)]


def local_kv_heads(cfg: ModelConfig, tp: int) -> int:
    """KV heads each shard holds: Hkv / T, or one replicated head where Hkv < T (vLLM's rule)."""
    return max(1, cfg.num_key_value_heads // tp)


def check_parallel(cfg: ModelConfig, tp: int, pp: int, num_devices: int, device_kind: str,
                   ep: int = 1) -> ParallelLayout:
    """The layout of max(T, X) x P ranks over `cfg`, or EngineConfigError naming what does not divide."""
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    problem = expert_layout_problem(cfg.moe, tp, ep)  # MoE layouts: the rule of config/moe.py
    if problem:
        raise EngineConfigError(problem)
    if h % tp:
        raise EngineConfigError(f"tensor_parallel_size {tp} does not divide the {h} attention heads")
    if hkv >= tp and hkv % tp:
        raise EngineConfigError(f"tensor_parallel_size {tp} does not divide the {hkv} KV heads")
    if hkv < tp and tp % hkv:
        raise EngineConfigError(
            f"with {hkv} KV heads (< tensor_parallel_size {tp}) each KV head is replicated, which needs "
            f"tensor_parallel_size to be a multiple of {hkv}")
    if cfg.intermediate_size % tp:
        raise EngineConfigError(
            f"tensor_parallel_size {tp} does not divide the MLP width {cfg.intermediate_size}")
    if pp > cfg.num_hidden_layers:
        raise EngineConfigError(
            f"pipeline_parallel_size {pp} is more than the model's {cfg.num_hidden_layers} layers "
            f"(each stage needs at least one)")
    world = max(tp, ep) * pp
    if world > num_devices:
        raise EngineConfigError(
            f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
            f"{f' with expert_parallel_size {ep}' if ep > 1 else ''} = {world} processes, but only "
            f"{num_devices} {device_kind} {'is' if num_devices == 1 else 'are'} available")
    return ParallelLayout(tp, pp, cfg.num_hidden_layers, ep)
