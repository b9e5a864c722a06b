"""EngineConfig's parts (each bad value rejected by the part that owns it, with a clear message),
the flat keyword view callers use, and the builder's resolution into the runtime configs (no model)."""

import dataclasses

import pytest

from servescope.config import (
    BatchingConfig,
    CacheConfig,
    EngineConfig,
    KVCacheConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    TelemetryConfig,
)
from servescope.engine.builder import resolve_max_model_len, runtime_configs
from servescope.errors import EngineConfigError


@pytest.mark.parametrize("part, kw, message", [
    (LoadConfig, dict(dtype="float64"), "dtype must be float32, bfloat16, float16 or auto"),
    (LoadConfig, dict(attention_backend="flash"), "attention_backend must be auto, torch or triton"),
    (LoadConfig, dict(gpu_linear="cutlass"), "gpu_linear must be cublas, triton or auto"),
    (LoadConfig, dict(quantization="int5"), "quantization must be gguf, int8, int4"),
    (KVCacheConfig, dict(block_size=0), "block_size must be positive, got 0"),
    (KVCacheConfig, dict(block_size=12), "block_size must be a power of two, got 12"),
    (KVCacheConfig, dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes must be positive"),
    (KVCacheConfig, dict(kv_cache_memory_fraction=1.5), r"kv_cache_memory_fraction must be in \(0, 1\]"),
    (KVCacheConfig, dict(num_kv_blocks=-1), "num_kv_blocks must be positive"),
    (KVCacheConfig, dict(kv_cache_dtype="int4"),
     "kv_cache_dtype must be one of auto, float32, bfloat16, float16, int8"),
    (BatchingConfig, dict(max_num_seqs=0), "max_num_seqs must be positive"),
    (BatchingConfig, dict(max_num_batched_tokens=-5), "max_num_batched_tokens must be positive"),
    (BatchingConfig, dict(max_model_len=0), "max_model_len must be positive"),
    (SpeculativeConfig, dict(num_speculative_tokens=4), "need speculative_method"),
    (SpeculativeConfig, dict(speculative_model="draft"), "need speculative_method"),
    (SpeculativeConfig, dict(speculative_method="eagle"), "speculative_method must be ngram or draft"),
    (SpeculativeConfig, dict(speculative_method="ngram", num_speculative_tokens=0), "at least 1"),
    (SpeculativeConfig, dict(speculative_method="ngram", num_speculative_tokens=-2), "at least 1"),
    (SpeculativeConfig, dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=4,
                             prompt_lookup_max=2), "1 <= min <= max"),
    (SpeculativeConfig, dict(speculative_method="ngram", num_speculative_tokens=3, speculative_model="x"),
     "speculative_model is for the draft method"),
    (ParallelConfig, dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (ParallelConfig, dict(pipeline_parallel_size=1.5), "pipeline_parallel_size must be a positive integer"),
    (ParallelConfig, dict(distributed_backend="mpi"), "distributed_backend must be auto, gloo or nccl"),
    (ParallelConfig, dict(distributed_timeout_s=0), "distributed_timeout_s must be positive"),
])
def test_each_bad_setting_rejected_by_its_part(part, kw, message):
    with pytest.raises(EngineConfigError, match=message):
        part(**kw)
    with pytest.raises(EngineConfigError, match=message):  # the flat spelling reaches the same check
        EngineConfig(**kw)


def test_cross_part_check():
    with pytest.raises(EngineConfigError, match=r"max_num_batched_tokens \(8\) is below one KV block \(16 tokens\)"):
        EngineConfig(max_num_batched_tokens=8)
    with pytest.raises(EngineConfigError, match="below one KV block"):
        EngineConfig().replace(block_size=64, max_num_batched_tokens=32)


def test_flat_keywords_route_to_parts_and_read_through():
    c = EngineConfig(model="random:smollm2-135m", dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4,
                     enable_prefix_caching=False, hardware="h200")
    assert c.load == LoadConfig(model="random:smollm2-135m", dtype="bfloat16")
    assert c.cache == KVCacheConfig(num_kv_blocks=64, enable_prefix_caching=False)
    assert c.batching == BatchingConfig(max_num_seqs=4)
    assert c.telemetry == TelemetryConfig(hardware="h200")
    assert (c.model, c.dtype, c.num_kv_blocks, c.max_num_seqs, c.block_size) == ("random:smollm2-135m", "bfloat16",
                                                                                   64, 4, 16)
    assert EngineConfig(**c.flat()) == c and hash(EngineConfig(**c.flat())) == hash(c)


def test_replace_and_parts():
    c = EngineConfig(num_kv_blocks=64)
    d = c.replace(max_num_seqs=2, block_size=32)
    assert (d.max_num_seqs, d.block_size, d.num_kv_blocks) == (2, 32, 64) and c.max_num_seqs == 64
    # a whole part, with flat names on top of it
    e = EngineConfig(cache=KVCacheConfig(block_size=32, num_kv_blocks=8), num_kv_blocks=9, seed=3)
    assert (e.block_size, e.num_kv_blocks, e.seed) == (32, 9, 3)
    assert dataclasses.replace(c, batching=BatchingConfig(max_num_seqs=3)).max_num_seqs == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 32
    with pytest.raises(TypeError, match="unexpected keyword argument 'blocksize'"):
        EngineConfig(blocksize=32)
    with pytest.raises(TypeError, match="takes a KVCacheConfig"):
        EngineConfig(cache=BatchingConfig())


# ------------------------------------------------------------------------------ builder resolution
MODEL = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def test_max_model_len_resolution():
    assert resolve_max_model_len(EngineConfig(), MODEL, blocks=100) == 1024  # the model's context fits
    assert resolve_max_model_len(EngineConfig(), MODEL, blocks=10) == 160  # clipped to the cache
    assert resolve_max_model_len(EngineConfig(max_model_len=128), MODEL, blocks=10) == 128
    with pytest.raises(EngineConfigError, match="could never fit"):
        resolve_max_model_len(EngineConfig(max_model_len=512), MODEL, blocks=10)


def test_runtime_configs():
    cache, sched = runtime_configs(EngineConfig(max_num_batched_tokens=256, max_num_seqs=8), 40, 1024)
    assert cache == CacheConfig(block_size=16, num_blocks=40, enable_prefix_caching=True)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len, sched.enable_chunked_prefill) == (
        8, 256, 1024, True)
    # without chunked prefill a whole sequence must fit in one step
    _, sched = runtime_configs(EngineConfig(max_num_batched_tokens=256, enable_chunked_prefill=False), 40, 1024)
    assert sched.max_num_batched_tokens == 1024 and not sched.enable_chunked_prefill
    # the no-KV-cache baseline recomputes everything: no prefix cache, no chunks
    cache, sched = runtime_configs(EngineConfig(max_num_batched_tokens=256, no_kv_cache=True), 40, 512)
    assert not cache.enable_prefix_caching and not sched.enable_chunked_prefill
    assert sched.max_num_batched_tokens == 512
