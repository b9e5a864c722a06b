"""Stage 1 of building an engine: the weights. An EngineConfig's load settings -> a LoadedModel (the
built model, prepared by its executor's build-time transforms, with its shape and tokenizer).

Engines share a LoadedModel (engine/builder.py, stage 2, builds one engine on it); a draft model of
speculative decoding is a second LoadedModel (engine/spec_builder.py); a parallel worker builds its
rank's weights with `build_weights` (engine/parallel_worker.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from servescope.analysis.cpu_isa import local_fast_bf16
from servescope.analysis.presets import load_preset
from servescope.config import EngineConfig, ModelConfig
from servescope.engine.executor import ModelExecutor
from servescope.engine.kv_sizing import resolve_kv_dtype
from servescope.engine.parallel_executor import ParallelExecutor, parallel_layout
from servescope.errors import EngineConfigError
from servescope.kernels.cpu import ops as cpu_ops
from servescope.loader.build import DTYPES, build_model
from servescope.loader.quantized import saved_mode
from servescope.loader.random_init import build_random_model
from servescope.loader.source import load_model_source
from servescope.tokenizer import Tokenizer, load_tokenizer

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


# ------------------------------------------------------------------------------ devices and dtypes
def rank_threads(config: EngineConfig) -> Optional[int]:
    """Torch threads for this process: the configured num_threads, or for a parallel engine on the CPU the
    machine's cores shared out over the ranks on it (each rank taking torch's default, a thread per core,
    oversubscribes them: EP = 2 on 2 cores measured a batch-1 step at 3.2 s with two threads a rank against
    0.19 s with one, on a loaded machine); None: torch's default."""
    if config.load.num_threads:
        return config.load.num_threads
    par = config.parallel
    world = par.tensor_parallel_size * par.pipeline_parallel_size
    if world <= 1 or not config.load.device.startswith("cpu"):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun's ranks on this machine
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(local, 1))


def resolve_device(config: EngineConfig) -> torch.device:
    threads = rank_threads(config)
    if threads:
        torch.set_num_threads(threads)
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


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype,
               worker_target: Optional[Callable] = None) -> LoadedModel:
    """Load the weights config.load names and apply the build-time transforms (ModelExecutor.prepare;
    a parallel engine: start the workers (worker_target: their entry point), keep this rank's stage and
    shard, then the same transforms)."""
    load = config.load
    t0 = time.perf_counter()
    if device.type == "cpu":
        cpu_ops.load_in_background()  # a first run compiles the kernels while the weights load
    model_config, model, tokenizer, path = build_weights(config, device, dtype)
    if device.type == "cpu":  # steps reuse their large blocks (kernels/cpu/csrc/host_cache.cpp); the loading's
        cpu_ops.cache_host_memory()  # transient copies, freed before, went back to the OS
    layout = parallel_layout(config, model_config, device)
    if layout is None:
        executor = ModelExecutor.prepare(model, device, load.quantization, load.gpu_linear)
    elif worker_target is None:
        raise EngineConfigError("this model cannot be loaded tensor/pipeline-parallel here")
    else:
        executor = ParallelExecutor.start(config, model, device, layout, worker_target)
    return LoadedModel(config, executor, model_config, tokenizer, path, time.perf_counter() - t0)


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
