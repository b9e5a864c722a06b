"""Engine settings: EngineConfig and its parts, and the runtime configs the builder resolves them into."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

from servescope.errors import EngineConfigError

# --------------------------------------------------------------------------- engine settings
# EngineConfig is composed of parts, each validated once, in its own __post_init__; the engine
# builder (engine/builder.py) resolves them into the runtime configs the lower layers take
# (CacheConfig with the number of blocks, SchedulerConfig with the context length). Callers keep
# the flat view: EngineConfig(model=..., num_kv_blocks=...), config.replace(max_num_seqs=4) and
# config.block_size, since every flat name belongs to exactly one part.

_DTYPES = ("float32", "bfloat16", "float16")
# KV cache dtypes (vLLM's names; fp8 = fp8_e4m3): the float ones, or quantised per token and KV head
# (int8, float8 e4m3; model/attention/kv_quant.py)
KV_CACHE_DTYPES = ("auto",) + _DTYPES + ("int8", "fp8", "fp8_e4m3")
# weight-only quantization modes (model/quantize.py): int8 per channel, int4 = int4-g32-sym, or spelled out
_QUANT_RE = re.compile(r"^(gguf|int(4|8)(-(g32|g64|g128|ch))?(-(sym|asym))?)$")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise EngineConfigError(message)


@dataclass(frozen=True)
class LoadConfig:
    """Which weights, in which dtype, on which device, and the kernels chosen for them at build."""

    model: Optional[str] = None  # directory, .gguf path, or a known name; None = smollm2-135m
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    device: str = "cpu"
    # None | gguf (a GGUF's own Q4_0/Q4_1/Q8_0 blocks) | int8 | int4 | int<4|8>-<g32|g64|g128|ch>[-sym|-asym]
    quantization: Optional[str] = None
    attention_backend: str = "auto"  # auto | torch | triton
    # decode matmuls (M <= 8 rows) on a GPU: cublas (F.linear) | triton (kernels/triton_gemv.py) |
    # auto (whichever is faster per weight shape and M, timed at start-up on the model's weights)
    gpu_linear: str = "cublas"
    use_cuda_graph: bool = True
    cuda_graph_batch_sizes: tuple = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    num_threads: Optional[int] = None
    seed: int = 0  # of the random init of "random:<preset>" models
    # no tokenizer: prompts and outputs are token ids only (vLLM's name; a checkpoint without tokenizer
    # files, or a test that needs none)
    skip_tokenizer_init: bool = False

    def __post_init__(self):
        _require(self.dtype in _DTYPES + ("auto",),
                 f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        _require(self.attention_backend in ("auto", "torch", "triton"),
                 f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        _require(self.gpu_linear in ("cublas", "triton", "auto"),
                 f"gpu_linear must be cublas, triton or auto, got {self.gpu_linear!r}")
        _require(self.quantization is None or bool(_QUANT_RE.match(str(self.quantization))),
                 "quantization must be gguf, int8, int4 or int<4|8>-<g32|g64|g128|ch>[-sym|-asym] "
                 f"(e.g. int4-g128-asym), or unset, got {self.quantization!r}")


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache the user asks for: block geometry, how much memory, dtype, prefix caching.
    num_kv_blocks overrides both memory settings; none of the three: a default per device."""

    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None
    kv_cache_memory_fraction: Optional[float] = None  # of the memory free after loading weights
    num_kv_blocks: Optional[int] = None
    kv_cache_dtype: str = "auto"  # auto: same as dtype | float32 | bfloat16 | float16 | int8 | fp8 | fp8_e4m3
    enable_prefix_caching: bool = True
    no_kv_cache: bool = False  # recompute the whole sequence every step (the labs' baseline)
    # one block table for all layers even where they mix windows (vLLM's flag of the same name): the memory use
    # of a model without kvcache/hybrid.py
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self):
        _require(self.block_size > 0, f"block_size must be positive, got {self.block_size}")
        _require(not self.block_size & (self.block_size - 1),
                 f"block_size must be a power of two, got {self.block_size}")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                 f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        _require(self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 1,
                 f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks > 0,
                 f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class BatchingConfig:
    """The scheduler's limits as the user sets them (continuous batching, chunked prefill)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        _require(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens > 0,
                 f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        _require(self.max_model_len is None or self.max_model_len > 0,
                 f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (parallel/): tensor parallel (each layer's heads and MLP
    columns sharded, an all-reduce after attention and after the MLP) times pipeline parallel (layers
    split into stages); expert parallel (a mixture of experts' routed experts split over the ranks, tokens
    sent to them by all-to-all) over the tensor-parallel ranks (vLLM's enable_expert_parallel), or with
    tensor_parallel_size 1 over ranks whose attention is replicated. What depends on the model (heads
    divisible, enough layers, enough devices) is checked by the builder before any process starts."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    distributed_backend: str = "auto"  # auto (gloo on the CPU, nccl on CUDA) | gloo | nccl
    # a collective that waits longer than this (a hung or dead worker) fails the engine loudly
    distributed_timeout_s: float = 60.0
    # micro-batches a pipeline step is cut into so that the stages overlap: 0 (auto) cuts a step with
    # enough prefill tokens into P, never a decode-only one (analysis/pipeline_schedule.auto_micro_batches);
    # 1 never cuts
    pipeline_micro_batches: int = 0

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            size = getattr(self, name)
            _require(isinstance(size, int) and size >= 1, f"{name} must be a positive integer, got {size!r}")
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        _require(ep == 1 or tp in (1, ep),
                 f"expert_parallel_size {ep} runs over the tensor-parallel ranks: tensor_parallel_size must be "
                 f"{ep} (attention sharded) or 1 (attention replicated), got {tp}")
        _require(self.distributed_backend in ("auto", "gloo", "nccl"),
                 f"distributed_backend must be auto, gloo or nccl, got {self.distributed_backend!r}")
        _require(isinstance(self.pipeline_micro_batches, int) and self.pipeline_micro_batches >= 0,
                 f"pipeline_micro_batches must be 0 (auto) or a positive integer, got {self.pipeline_micro_batches!r}")
        _require(self.distributed_timeout_s > 0,
                 f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")

    @property
    def world_size(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size) * self.pipeline_parallel_size


SPECULATIVE_METHODS = ("ngram", "draft")
# LLM(speculative={...}) keys (vLLM's speculative_config names) -> SpeculativeConfig fields
SPECULATIVE_KEYS = {"method": "speculative_method", "model": "speculative_model",
                    "num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_min": "prompt_lookup_min",
                    "prompt_lookup_max": "prompt_lookup_max", "quantization": "speculative_quantization",
                    "adaptive": "speculative_adaptive"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to num_speculative_tokens (k) tokens per running
    request, the target verifies them in its next step (spec/). method ngram: prompt lookup (the
    longest suffix of prompt_lookup_max..prompt_lookup_min tokens found earlier in the sequence gives
    the tokens that followed it); draft: a smaller model sharing the vocabulary (speculative_model; the
    target's own weights when unset, then normally with speculative_quantization="int8").
    speculative_adaptive: k per request follows its acceptance rate, and speculation is skipped for a
    step whose batch the cost model predicts it would slow down."""

    speculative_method: Optional[str] = None  # None (off) | ngram | draft
    speculative_model: Optional[str] = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    speculative_quantization: Optional[str] = None  # of the draft: None or a quantization mode (int4, int8, ...)
    speculative_adaptive: bool = True

    def __post_init__(self):
        m, k = self.speculative_method, self.num_speculative_tokens
        _require(m is None or m in SPECULATIVE_METHODS,
                 f"speculative_method must be ngram or draft (or unset), got {m!r}")
        if m is None:
            _require(k == 0 and self.speculative_model is None,
                     f"num_speculative_tokens={k} / speculative_model={self.speculative_model!r} need "
                     f"speculative_method (ngram or draft)")
            return
        _require(isinstance(k, int) and k >= 1, f"num_speculative_tokens must be at least 1, got {k!r}")
        _require(k <= 16, f"num_speculative_tokens must be at most 16, got {k}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max ({self.prompt_lookup_max}) "
                 f"must satisfy 1 <= min <= max")
        _require(m == "draft" or self.speculative_model is None,
                 f"speculative_model is for the draft method, not {m}")
        _require(self.speculative_quantization is None or bool(_QUANT_RE.match(str(self.speculative_quantization))),
                 f"speculative_quantization (the draft's weights) must be one of the quantization modes (int8, "
                 f"int4, int<4|8>-<g32|g64|g128|ch>[-sym|-asym], gguf) or unset, got {self.speculative_quantization!r}")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """From vLLM-style keys: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}."""
        unknown = sorted(set(d) - set(SPECULATIVE_KEYS))
        _require(not unknown, f"unknown speculative setting(s) {unknown}; known: {sorted(SPECULATIVE_KEYS)}")
        return cls(**{SPECULATIVE_KEYS[k]: v for k, v in d.items()})


@dataclass(frozen=True)
class TelemetryConfig:
    """What each StepRecord carries besides the measured times."""

    predict_step_cost: bool = True  # annotate every StepRecord with the cost model's prediction
    hardware: Optional[str] = None  # hardware spec name for predictions; None = local probe/default


# part name -> its class; the order is the order of validation
_ENGINE_PARTS = {"load": LoadConfig, "cache": KVCacheConfig, "batching": BatchingConfig,
                 "parallel": ParallelConfig, "speculative": SpeculativeConfig, "telemetry": TelemetryConfig}
# flat setting name -> the part that owns it
_PART_OF = {f.name: part for part, cls in _ENGINE_PARTS.items() for f in dataclasses.fields(cls)}
assert len(_PART_OF) == sum(len(dataclasses.fields(c)) for c in _ENGINE_PARTS.values()), "a flat name in two parts"


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Every engine setting, as parts: load (model, dtype, device, kernels), cache (KV blocks),
    batching (scheduler limits), parallel, speculative, telemetry.

    Built from flat keyword arguments, each routed to its part (`EngineConfig(model="x",
    num_kv_blocks=64)`), from parts (`EngineConfig(cache=KVCacheConfig(...))`), or both (flat
    names then override the given part's fields). Flat names read through: `config.block_size` is
    `config.cache.block_size`. Unknown names raise TypeError, as a dataclass would.
    """

    load: LoadConfig
    cache: KVCacheConfig
    batching: BatchingConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig
    telemetry: TelemetryConfig

    def __init__(self, **settings: Any):
        for name in settings:
            if name not in _PART_OF and name not in _ENGINE_PARTS:
                raise TypeError(f"EngineConfig() got an unexpected keyword argument {name!r}")
        for part, cls in _ENGINE_PARTS.items():
            own = {k: v for k, v in settings.items() if _PART_OF.get(k) == part}
            given = settings.get(part)
            if given is not None and not isinstance(given, cls):
                raise TypeError(f"EngineConfig({part}=...) takes a {cls.__name__}, got {type(given).__name__}")
            value = cls(**own) if given is None else (dataclasses.replace(given, **own) if own else given)
            object.__setattr__(self, part, value)
        self.__post_init__()

    def __post_init__(self):
        # the checks that span parts: a step must hold at least one block's tokens
        _require(self.batching.max_num_batched_tokens >= self.cache.block_size,
                 f"max_num_batched_tokens ({self.batching.max_num_batched_tokens}) is below one KV block "
                 f"({self.cache.block_size} tokens)")

    def replace(self, **settings: Any) -> "EngineConfig":
        """A copy with some flat settings or whole parts changed (validated again)."""
        return EngineConfig(**{**{p: getattr(self, p) for p in _ENGINE_PARTS}, **settings})

    def flat(self) -> dict:
        """Every setting by its flat name: EngineConfig(**config.flat()) == config."""
        return {name: getattr(getattr(self, part), name) for name, part in _PART_OF.items()}


def _flat_setting(part: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, part), name), doc=f"EngineConfig.{part}.{name}")


for _name, _part in _PART_OF.items():
    setattr(EngineConfig, _name, _flat_setting(_part, _name))


# --------------------------------------------------------------------------- runtime configs
# Built by the engine builder from validated parts; each checks only what resolution adds.

@dataclass(frozen=True)
class CacheConfig:
    """What the KV cache manager needs: block geometry (resolved: the number of blocks) and prefix caching."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True

    def __post_init__(self):
        _require(self.num_blocks > 0, f"the KV cache has {self.num_blocks} blocks; it needs at least one")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs: batch limits and the model's context length (resolved)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    block_size: int = 16

    def __post_init__(self):
        _require(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
                 f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                 f">= max_model_len ({self.max_model_len}) so that any prompt fits in one step")
