"""Configuration and hand-off objects: ModelConfig, SamplingParams, EngineConfig and its parts.

The bottom of the layers: this package imports nothing from servescope except errors, and every
other layer may import it. All configs are frozen dataclasses validated in `__post_init__`.
  model.py     ModelConfig (and RopeScaling): the shape of a transformer
  layers.py    LayerSpec (AttentionSpec, MlpSpec): what one decoder layer computes
  mla.py       MlaSpec: the latent of multi-head latent attention (DeepSeek-V2/V3)
  families.py  the family table: HF and GGUF architecture names -> a family and its defaults
  sampling.py  SamplingParams: how to sample one request
  engine.py    EngineConfig, composed of Load/KVCache/Batching/Parallel/Speculative/Telemetry
               parts, and the runtime CacheConfig / SchedulerConfig the engine builder resolves
"""

from servescope.config.engine import (
    BatchingConfig,
    CacheConfig,
    KV_CACHE_DTYPES,
    EngineConfig,
    KVCacheConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TelemetryConfig,
)
from servescope.config.families import SUPPORTED_ARCHITECTURES
from servescope.config.layers import AttentionSpec, LayerSpec, MlpSpec
from servescope.config.model import ModelConfig, RopeScaling
from servescope.config.sampling import SAMPLING_EPS, SamplingParams, StructuredOutput, ThinkingBudget

__all__ = [
    "AttentionSpec",
    "LayerSpec",
    "MlpSpec",
    "KV_CACHE_DTYPES",
    "SAMPLING_EPS",
    "SUPPORTED_ARCHITECTURES",
    "BatchingConfig",
    "CacheConfig",
    "EngineConfig",
    "KVCacheConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "RopeScaling",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutput",
    "TelemetryConfig",
    "ThinkingBudget",
]
