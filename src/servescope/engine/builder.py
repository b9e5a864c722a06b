"""Engine builder: an EngineConfig's parts -> the components one LLMEngine runs on.

Two stages, so that engines can share weights:
  load_model    the weights (loaded, then prepared by ModelExecutor.prepare), the model's shape and
                tokenizer: a LoadedModel
  build_engine  one engine's parts on a LoadedModel: the KV block count, the resolved context
                length, CacheConfig and SchedulerConfig, the runner and its KV cache, the KV cache
                manager, scheduler, sampler, step-cost predictor and CUDA graphs

build_engine(config) runs both; build_engine(config, shared=loaded) only the second, on an executor
fork of the loaded weights (LLMEngine.with_config).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from servescope.analysis.cpu_isa import local_fast_bf16
from servescope.analysis.presets import load_preset
from servescope.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from servescope.engine.executor import ModelExecutor
from servescope.engine.kv_sizing import check_kv_layout, kv_bytes_per_token, num_kv_blocks, resolve_kv_dtype
from servescope.engine.model_runner import ModelRunner
from servescope.engine.parallel_executor import ParallelExecutor, parallel_layout
from servescope.engine.parallel_worker import become_torchrun_worker, worker_main
from servescope.engine.spec_builder import build_spec_decoder
from servescope.engine.spec_decode import SpecDecoder
from servescope.engine.step_cost import StepCostPredictor
from servescope.errors import EngineConfigError
from servescope.kernels.cpu import ops as cpu_ops
from servescope.kvcache.manager import KVCacheManager
from servescope.loader.build import DTYPES, build_model
from servescope.loader.quantized import saved_mode
from servescope.loader.random_init import build_random_model
from servescope.loader.source import load_model_source
from servescope.model.attention import get_attention_backend
from servescope.model.quantize import weight_format
from servescope.sampling.sampler import Sampler
from servescope.scheduler.scheduler import Scheduler
from servescope.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"  # "random:<preset>": a preset's shape with random weights, no tokenizer

# settings that decide the weights: an engine on a LoadedModel must have the ones it was loaded with
WEIGHT_SETTINGS = ("model", "dtype", "device", "quantization")


@dataclass(frozen=True)
class LoadedModel:
    """Weights and what came with them. Engines built on one share the nn.Module, which holds no
    per-request state; each has its own executor fork, KV cache and scheduler."""

    config: EngineConfig  # the settings the weights were loaded with
    executor: ModelExecutor
    model_config: ModelConfig
    tokenizer: Optional[Tokenizer]  # None for random models
    source_path: object
    load_seconds: float

    @property
    def eos_token_ids(self) -> tuple:
        """The model's and the tokenizer's end-of-sequence ids, sorted."""
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))


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
    kv_manager: KVCacheManager
    scheduler: Scheduler
    sampler: Sampler
    cost: Optional[StepCostPredictor]  # annotates StepRecords (telemetry.predict_step_cost)
    spec: Optional[SpecDecoder] = None  # speculative decoding (config.speculative), None when off


# ------------------------------------------------------------------------------ devices and dtypes
def resolve_device(config: EngineConfig) -> torch.device:
    if config.load.num_threads:
        torch.set_num_threads(config.load.num_threads)
    device = torch.device(config.load.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineConfigError("device 'cuda' was asked for but torch sees no CUDA device")
    return device


def resolve_dtypes(config: EngineConfig, device: torch.device) -> tuple:
    """(weight and activation dtype, KV cache dtype); "auto" is bfloat16 on a GPU and on a CPU with
    bfloat16 dot products (AVX512-BF16, AMX, ARM BF16) that oneDNN may use, else float32: without them
    bfloat16 matmuls are emulated, hundreds of times slower (analysis/cpu_isa.local_fast_bf16)."""
    name = config.load.dtype
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" or local_fast_bf16() else "float32"
    if name == "float16" and device.type == "cpu":
        raise EngineConfigError("float16 is for GPUs; on the CPU use float32 or bfloat16")
    kv = config.cache.kv_cache_dtype
    return DTYPES[name], resolve_kv_dtype(kv, DTYPES[name])


# ------------------------------------------------------------------------------ stage 1: weights
def build_weights(config: EngineConfig, device: torch.device, dtype: torch.dtype, count_devices: bool = True) -> tuple:
    """(ModelConfig, the built model, tokenizer or None, source path) of config.load, before any
    build-time transform. A parallel layout that does not fit the model is rejected here, before the
    weights are built and before any worker process starts (count_devices False: a worker's build,
    whose engine counted the devices)."""
    load, max_pos = config.load, config.batching.max_model_len
    if load.model and load.model.startswith(RANDOM_PREFIX):
        model_config = load_preset(load.model[len(RANDOM_PREFIX):])
        parallel_layout(config, model_config, device, count_devices)
        # rotary tables for the preset's whole context (as for checkpoints below), so that an engine on
        # these weights with a longer max_model_len (with_config) never indexes past them
        model = build_random_model(model_config, dtype, device, seed=load.seed,
                                   max_positions=max(max_pos or 0, model_config.max_position_embeddings))
        return model_config, model, None, load.model
    src = load_model_source(load.model, keep_packed=load.quantization == "gguf")
    if load.quantization == "gguf" and src.format != "gguf":
        raise EngineConfigError(f"quantization gguf runs a .gguf file's own blocks; {src.path} is not one")
    parallel_layout(config, src.config, device, count_devices)
    model = build_model(src.config, src.state_dict, dtype, device,
                        max_positions=max(max_pos or 0, src.config.max_position_embeddings), packed=src.packed)
    tokenizer = None if load.skip_tokenizer_init else load_tokenizer(src.tokenizer_source)
    return src.config, model, tokenizer, src.path


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load the weights config.load names and apply the build-time transforms (ModelExecutor.prepare;
    a parallel engine: start the workers, keep this rank's stage and shard, then the same transforms)."""
    load = config.load
    t0 = time.perf_counter()
    if device.type == "cpu":
        cpu_ops.load_in_background()  # a first run compiles the kernels while the weights load
    model_config, model, tokenizer, path = build_weights(config, device, dtype)
    layout = parallel_layout(config, model_config, device)
    if layout is None:
        executor = ModelExecutor.prepare(model, device, load.quantization, load.gpu_linear)
    else:
        executor = ParallelExecutor.start(config, model, device, layout, worker_main)
    return LoadedModel(config, executor, model_config, tokenizer, path, time.perf_counter() - t0)


# ------------------------------------------------------------------------------ stage 2: one engine
def build_engine(config: EngineConfig, shared: Optional[LoadedModel] = None) -> EngineParts:
    """The parts of one engine: on freshly loaded weights, or on `shared`'s (an executor fork: the
    same weights and kernel choices, this engine's own KV cache and CUDA graphs). The weight
    settings (WEIGHT_SETTINGS) cannot differ from those `shared` was loaded with."""
    device = resolve_device(config)
    dtype, kv_dtype = resolve_dtypes(config, device)
    if shared is None:
        config = adopt_saved_quantization(config)
        become_torchrun_worker(config)  # ranks > 0 under torchrun serve rank 0 from here, then exit
        loaded = load_model(config, device, dtype)
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
    max_len = resolve_max_model_len(config, cfg, blocks)
    backend = get_attention_backend(config.load.attention_backend, device)
    runner = ModelRunner(executor, shard_cfg, backend, blocks, config.cache.block_size, kv_dtype, device)
    executor.start_kv_cache(blocks, config.cache.block_size, kv_dtype)
    per_token = kv_bytes_per_token(shard_cfg, kv_dtype)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, %d bytes per token, %.1f MiB (%s)",
                blocks, config.cache.block_size, blocks * config.cache.block_size, per_token,
                runner.kv_cache_bytes / 2**20, str(kv_dtype).replace("torch.", ""))
    cache_config, scheduler_config = runtime_configs(config, blocks, max_len)
    kv_manager = KVCacheManager(cache_config)
    cost = None
    if config.telemetry.predict_step_cost:
        cost = StepCostPredictor(cfg, device, dtype, kv_dtype, config.load.quantization, config.telemetry.hardware,
                                 config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
                                 config.parallel.pipeline_micro_batches,
                                 weight_format=weight_format(executor.model, config.load.quantization))
    capture_cuda_graphs(config, executor, runner, max_len)
    sampler = Sampler(cfg.vocab_size, eos_token_ids=loaded.eos_token_ids)
    return EngineParts(
        config=config, loaded=loaded, device=device, dtype=dtype, kv_dtype=kv_dtype, max_model_len=max_len,
        kv_bytes_per_token=per_token, cache_config=cache_config, scheduler_config=scheduler_config,
        runner=runner, kv_manager=kv_manager, scheduler=Scheduler(scheduler_config, kv_manager),
        sampler=sampler, cost=cost, spec=build_spec_decoder(config, loaded, runner, sampler, cost, max_len))


def adopt_saved_quantization(config: EngineConfig) -> EngineConfig:
    """A checkpoint saved by `servescope quantize` runs in the mode it was saved in: config with that
    quantization, so the executor, the cost model and the summaries see it. Another mode is an error
    (its weights are already rounded), as is a parallel layout (the shards cut float weights)."""
    model = config.load.model
    mode = None if model is None or model.startswith(RANDOM_PREFIX) else saved_mode(os.path.expanduser(model))
    if mode is None:
        return config
    if config.load.quantization not in (None, mode):
        raise EngineConfigError(f"{model} was saved quantised as {mode}; run it without --quantization "
                                f"(or with {mode}), or quantise the float model to {config.load.quantization}")
    if config.parallel.world_size > 1:
        raise EngineConfigError(f"{model} is a saved quantised checkpoint ({mode}); tensor/pipeline parallelism "
                                "shards float weights: run the float model with --quantization instead")
    return config if config.load.quantization == mode else config.replace(quantization=mode)


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
    sizes = [b for b in config.load.cuda_graph_batch_sizes if b <= config.batching.max_num_seqs]
    executor.capture_cuda_graphs(runner, sizes, -(-max_model_len // config.cache.block_size))
