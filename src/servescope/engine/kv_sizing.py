"""How many KV blocks the engine allocates: from bytes, a fraction of free memory, or a default."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from servescope.analysis.kv_layout import layers_per_window
from servescope.analysis.kv_stages import engine_group_blocks, step_token_limit
from servescope.config import BatchingConfig, EngineConfig, KVCacheConfig, ModelConfig
from servescope.errors import EngineConfigError
from servescope.model.attention import kv_quant

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2 in float32


_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for the kv_cache_dtype setting (auto: the model dtype); fp8 /
    fp8_e4m3 is torch.float8_e4m3fn, an error here, before anything is built, on a torch without it."""
    if name == "auto":
        return dtype
    if name in ("fp8", "fp8_e4m3"):
        if kv_quant.FP8 is None:
            raise EngineConfigError(f"kv_cache_dtype={name} needs torch.float8_e4m3fn, which this torch "
                                    f"({torch.__version__}) lacks; use int8")
        return kv_quant.FP8
    return _KV_DTYPES[name]


def check_kv_layout(cfg: ModelConfig, kv_dtype: torch.dtype) -> None:
    """A quantised cache keeps a float32 scale after each row of D values: D must keep it aligned. Latent
    attention stores its latent rows in the model's float dtypes only (model/mla.py writes them itself)."""
    if kv_quant.is_quantized(kv_dtype) and cfg.mla:
        raise EngineConfigError(f"a {str(kv_dtype).replace('torch.', '')} KV cache is not implemented for latent "
                                "attention (DeepSeek); use kv_cache_dtype auto, float32 or bfloat16")
    if kv_quant.is_quantized(kv_dtype) and cfg.head_dim % kv_quant.SCALE_BYTES:
        raise EngineConfigError(f"a {str(kv_dtype).replace('torch.', '')} KV cache needs a head dim divisible by "
                                f"{kv_quant.SCALE_BYTES}; this model's is {cfg.head_dim}")


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype) -> int:
    """2 (K and V) * layers * KV heads * (head dim * bytes per element, + 4 scale bytes when quantised); latent
    attention: layers * (kv_lora_rank + qk_rope_head_dim) * bytes per element."""
    heads, k_dim, v_dim = cfg.kv_cache_geometry
    rows = kv_quant.row_bytes(kv_dtype, k_dim) + (kv_quant.row_bytes(kv_dtype, v_dim) if v_dim else 0)
    return cfg.num_hidden_layers * heads * rows


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def num_kv_blocks(cache: KVCacheConfig, batching: BatchingConfig, cfg: ModelConfig, kv_dtype: torch.dtype,
                  device: torch.device) -> int:
    """Blocks of cache.block_size tokens: num_kv_blocks as given, else the memory budget's worth."""
    per_block = kv_bytes_per_token(cfg, kv_dtype) * cache.block_size
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
        source = f"kv_cache_memory_bytes={budget}"
    elif cache.kv_cache_memory_fraction is not None:
        free = available_memory_bytes(device)
        budget = int(free * cache.kv_cache_memory_fraction)
        source = f"{cache.kv_cache_memory_fraction:.0%} of {free / 2**30:.1f} GiB free"
    elif device.type == "cuda":
        free = available_memory_bytes(device)
        # keep room for activations of the largest step and the CUDA graphs' pool
        budget = int(free * 0.85) - (2 << 30)
        source = f"85% of {free / 2**30:.1f} GiB free, less 2 GiB for activations"
    else:
        # enough for max_num_seqs sequences of the full context, at most 1 GiB or a quarter of RAM
        max_len = batching.max_model_len or cfg.max_position_embeddings
        useful = per_block * batching.max_num_seqs * -(-max_len // cache.block_size)
        budget = min(CPU_DEFAULT_KV_BYTES, available_memory_bytes(device) // 4, useful)
        source = "CPU default (max_num_seqs full contexts, at most 1 GiB)"
    blocks = budget // per_block
    if blocks < 1:
        raise EngineConfigError(
            f"KV cache memory ({source}) is smaller than one block ({per_block} bytes = {cache.block_size} "
            f"tokens x {per_block // cache.block_size} bytes per token)")
    logger.debug("KV budget from %s", source)
    return int(blocks)


def kv_group_blocks(config: EngineConfig, cfg: ModelConfig, num_blocks: int) -> Optional[dict]:
    """window -> the blocks of each group's pool, where cfg's layers (the whole model's) mix attention windows and
    the engine keeps a block table per group (kvcache/hybrid.py), in the memory of num_blocks blocks of every
    layer (of every pipeline stage's layers: each stage holds the pools of its own layers' groups); None: one
    table for all layers -- one kind of layer; disable_hybrid_kv_cache_manager; a draft model with its own cache
    over a target without full-attention layers (it reads the first group's table over all its layers, which
    must hold every block: spec/draft.py)."""
    layers = layers_per_window(cfg)
    if (len(layers) < 2 or config.cache.disable_hybrid_kv_cache_manager
            or (config.speculative.speculative_method == "draft" and 0 not in layers)):
        return None
    return engine_group_blocks(cfg, num_blocks, config.cache.block_size, config.batching.max_num_seqs,
                               1 + (config.speculative.num_speculative_tokens or 0), max_step_tokens(config, cfg),
                               config.parallel.pipeline_parallel_size)


def max_step_tokens(config: EngineConfig, cfg: ModelConfig) -> int:
    """The most tokens one step adds to one sequence: a chunk, or a whole prompt without chunked prefill."""
    batching = config.batching
    return step_token_limit(batching.enable_chunked_prefill and not config.cache.no_kv_cache,
                            batching.max_num_batched_tokens, batching.max_model_len or cfg.max_position_embeddings)
