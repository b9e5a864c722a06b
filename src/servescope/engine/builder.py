"""Engine builder: an EngineConfig's parts -> the components one LLMEngine runs on, in stages.

  weights (engine/weights.py)   load_model: the weights, prepared by ModelExecutor.prepare, the model's
                                shape and tokenizer: a LoadedModel (a parallel engine starts its workers)
  one engine (here)             build_engine: on a LoadedModel, the KV block count, the resolved context
                                length, CacheConfig and SchedulerConfig, the runner and its KV cache, the
                                KV cache manager, scheduler, sampler, step-cost predictor, CUDA graphs
  speculation (spec_builder.py) the proposer (n-gram, or a draft model: its own LoadedModel) and the
                                token decider every step calls

build_engine(config) runs them all; build_engine(config, shared=loaded) builds on an executor fork of
loaded weights (LLMEngine.with_config). The hardware spec the steps are predicted on is resolved before
and handed in (`hardware`); when none is given, engine/hardware.py picks one without measuring the
engine itself (measure/ does that, above the engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from servescope.analysis.hardware import HardwareSpec
from servescope.analysis.kv_layout import layers_per_window
from servescope.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from servescope.config.layers import window_of
from servescope.engine.executor import ModelExecutor
from servescope.engine.hardware import default_hardware, default_link
from servescope.engine.kv_sizing import (check_kv_layout, kv_bytes_per_token, kv_group_blocks, max_step_tokens,
                                         num_kv_blocks)
from servescope.engine.model_runner import ModelRunner
from servescope.engine.parallel_worker import become_torchrun_worker, worker_main
from servescope.engine.spec_builder import build_token_decider
from servescope.engine.step_cost import StepCostPredictor
from servescope.engine.token_decider import TokenDecider
from servescope.engine.weights import (WEIGHT_SETTINGS, LoadedModel, adopt_saved_quantization, load_model,
                                       resolve_device, resolve_dtypes)
from servescope.errors import EngineConfigError
from servescope.kvcache.hybrid import HybridKVCacheManager
from servescope.kvcache.manager import KVCacheManager
from servescope.model.quantize import weight_format
from servescope.sampling.sampler import Sampler
from servescope.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything one LLMEngine runs on (LLMEngine copies these onto itself)."""

    config: EngineConfig
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_model_len: int  # resolved: the setting, or the model's context clipped to the KV capacity
    kv_bytes_per_token: int
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    runner: ModelRunner  # its executor: loaded's, or a fork of it (an engine on shared weights)
    kv_manager: KVCacheManager  # or HybridKVCacheManager (its interface): a block table per group of layers
    scheduler: Scheduler
    sampler: Sampler
    cost: Optional[StepCostPredictor]  # annotates StepRecords (telemetry.predict_step_cost)
    decider: TokenDecider  # plain sampling, or speculative verification (config.speculative)


# ------------------------------------------------------------------------------ stage 2: one engine
def build_engine(config: EngineConfig, shared: Optional[LoadedModel] = None,
                 hardware: Optional[HardwareSpec] = None) -> EngineParts:
    """The parts of one engine: on freshly loaded weights, or on `shared`'s (an executor fork: the
    same weights and kernel choices, this engine's own KV cache and CUDA graphs). The weight
    settings (WEIGHT_SETTINGS) cannot differ from those `shared` was loaded with. hardware: the spec
    to predict steps on (None: engine/hardware.default_hardware)."""
    device = resolve_device(config)
    dtype, kv_dtype = resolve_dtypes(config, device)
    if shared is None:
        config = adopt_saved_quantization(config)
        become_torchrun_worker(config)  # ranks > 0 under torchrun serve rank 0 from here, then exit
        loaded = load_model(config, device, dtype, worker_main)
        executor = loaded.executor
    else:
        for name in WEIGHT_SETTINGS:
            if getattr(config.load, name) != getattr(shared.config.load, name):
                raise EngineConfigError(f"with_config cannot change {name}; build a new engine")
        loaded, executor = shared, shared.executor.fork()
    cfg = loaded.model_config
    shard_cfg = executor.shard_config(cfg)  # this process's heads and layers (a parallel engine: fewer)
    check_kv_layout(shard_cfg, kv_dtype)
    blocks = num_kv_blocks(config.cache, config.batching, shard_cfg, kv_dtype, device)
    # None: one block table for all layers; else every group's pool (a pipeline stage allocates its layers' groups)
    group_blocks = kv_group_blocks(config, cfg, blocks)
    hybrid = None if group_blocks is None else HybridKVCacheManager(
        runtime_configs(config, blocks, 1)[0], group_blocks, layers_per_window(cfg), max_step_tokens(config, cfg))
    max_len = resolve_max_model_len(config, cfg, blocks if hybrid is None else hybrid.num_blocks)
    backend = executor.attention_backend(config.load.attention_backend)
    runner = ModelRunner(executor, shard_cfg, backend, blocks, config.cache.block_size, kv_dtype, device,
                         group_blocks=group_blocks)
    executor.start_kv_cache(blocks, config.cache.block_size, kv_dtype)
    per_token = kv_bytes_per_token(shard_cfg, kv_dtype)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, %d bytes per token, %.1f MiB (%s)",
                blocks, config.cache.block_size, blocks * config.cache.block_size, per_token,
                runner.kv_cache_bytes / 2**20, str(kv_dtype).replace("torch.", ""))
    if hybrid is not None:
        logger.info("KV cache per group of layers: %s", ", ".join(
            f"window {g['window'] or 'full'} ({g['layers']} layers): {g['num_blocks']} blocks"
            for g in hybrid.group_stats()))
    cache_config, scheduler_config = runtime_configs(config, blocks, max_len)
    # blocks that slid out of every layer's window go back (a draft model's layers read the same tables:
    # they may attend over the whole context, so then every block stays)
    drafted = config.speculative.speculative_method == "draft"
    kv_manager = hybrid or KVCacheManager(cache_config, window=0 if drafted else window_of(shard_cfg.layer_specs()))
    cost = None
    if config.telemetry.predict_step_cost:
        hardware = hardware or default_hardware(device, config.telemetry.hardware)
        cost = cost_predictor(config, cfg, hardware, dtype, kv_dtype, executor.model)
    capture_cuda_graphs(config, executor, runner, max_len)
    sampler = Sampler(cfg.vocab_size, eos_token_ids=loaded.eos_token_ids)
    decider = build_token_decider(config, loaded, runner, sampler, cost, max_len)
    return EngineParts(
        config=config, loaded=loaded, device=device, dtype=dtype, kv_dtype=kv_dtype, max_model_len=max_len,
        kv_bytes_per_token=per_token, cache_config=cache_config, scheduler_config=scheduler_config,
        runner=runner, kv_manager=kv_manager, scheduler=Scheduler(scheduler_config, kv_manager),
        sampler=sampler, cost=cost, decider=decider)


def cost_predictor(config: EngineConfig, cfg: ModelConfig, hardware: HardwareSpec, dtype: torch.dtype,
                   kv_dtype: torch.dtype, model) -> StepCostPredictor:
    """The step-cost predictor of an engine of config on `hardware` (the link between ranks: the
    hardware's default, or the local one measured earlier; none measured, no communication predicted)."""
    par = config.parallel
    link = default_link(hardware) if par.world_size > 1 else None
    if par.world_size > 1 and link is None:
        logger.info("no measured link between local processes: StepRecords predict compute only "
                    "(`servescope lab parallelism` measures it)")
    return StepCostPredictor(cfg, hardware, link, dtype, kv_dtype, config.load.quantization,
                             par.tensor_parallel_size, par.pipeline_parallel_size, par.pipeline_micro_batches,
                             weight_format=weight_format(model, config.load.quantization),
                             ep=par.expert_parallel_size)


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig, blocks: int) -> int:
    """The setting, or the model's context clipped to what the KV cache holds. A set max_model_len
    that the cache cannot hold is an error: one request could never fit."""
    block_size, asked = config.cache.block_size, config.batching.max_model_len
    capacity = blocks * block_size
    max_len = asked or cfg.max_position_embeddings
    if capacity >= max_len:
        return max_len
    if asked is not None:
        raise EngineConfigError(
            f"the KV cache holds {capacity} tokens ({blocks} blocks of {block_size}), fewer than "
            f"max_model_len={max_len}: one request could never fit; give more KV memory or a smaller "
            f"max_model_len")
    return capacity


def runtime_configs(config: EngineConfig, num_blocks: int, max_model_len: int) -> tuple:
    """(CacheConfig, SchedulerConfig) for the KV cache manager and the scheduler.

    no_kv_cache (recompute everything every step) turns prefix caching and chunked prefill off, and
    like a run without chunked prefill needs a whole sequence to fit in one step's token budget."""
    cache, batching = config.cache, config.batching
    cache_config = CacheConfig(block_size=cache.block_size, num_blocks=num_blocks,
                               enable_prefix_caching=cache.enable_prefix_caching and not cache.no_kv_cache)
    chunked = batching.enable_chunked_prefill and not cache.no_kv_cache
    max_batched = batching.max_num_batched_tokens if chunked else max(batching.max_num_batched_tokens, max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=batching.max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=max_model_len,
        enable_chunked_prefill=chunked, block_size=cache.block_size)
    return cache_config, scheduler_config


def capture_cuda_graphs(config: EngineConfig, executor: ModelExecutor, runner: ModelRunner, max_model_len: int) -> None:
    """Decode CUDA graphs for the batch sizes up to max_num_seqs (CUDA, Triton attention, use_cuda_graph)."""
    if not (runner.device.type == "cuda" and config.load.use_cuda_graph and runner.backend.name == "triton"):
        return
    if runner.group_windows:  # a graph holds one set of tables for all layers (engine/cuda_graphs.py)
        logger.info("CUDA graphs are not captured for a KV cache with a block table per group of layers")
        return
    sizes = [b for b in config.load.cuda_graph_batch_sizes if b <= config.batching.max_num_seqs]
    executor.capture_cuda_graphs(runner, sizes, -(-max_model_len // config.cache.block_size))
