"""Configuration and hand-off objects: ModelConfig, EngineConfig, SamplingParams.

This module imports nothing from servescope except errors; every other layer may import it.
All configs are frozen dataclasses validated in `__post_init__`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from servescope.errors import EngineConfigError, InvalidParameterError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)

_HF_ARCH_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style ("llama3") or linear rope scaling. `rope_type` "default" means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("default", "llama3", "linear"):
            raise InvalidParameterError(
                "rope_scaling", f"unsupported rope_scaling type {self.rope_type!r} (supported: default, llama3, linear)"
            )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family transformer. Names follow Hugging Face's config.json."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: Optional[int] = None  # recorded, not applied (Mistral v0.2+ has none)
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    name: str = ""

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise InvalidParameterError(
                "architecture",
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, f)) <= 0:
                raise InvalidParameterError(f, f"{f} must be positive, got {getattr(self, f)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidParameterError(
                "num_key_value_heads",
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, i, L, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        attn = d * self.q_size + 2 * d * self.kv_size + self.q_size * d
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * d * i + 2 * d
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + emb + d

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "") -> "ModelConfig":
        """Build from a Hugging Face config.json dict. Raises InvalidParameterError on unknown models."""
        archs = d.get("architectures") or []
        family = None
        for a in archs:
            family = _HF_ARCH_TO_FAMILY.get(a)
            if family:
                break
        if family is None:
            mt = d.get("model_type")
            family = mt if mt in SUPPORTED_ARCHITECTURES else None
        if family is None:
            got = ", ".join(archs) or d.get("model_type") or "none given"
            raise InvalidParameterError(
                "architecture",
                f"unsupported architecture ({got}); supported: "
                + ", ".join(sorted(_HF_ARCH_TO_FAMILY)) + " (model_type llama, mistral, qwen2, qwen3)",
            )
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // heads
        rs = d.get("rope_scaling") or d.get("rope_parameters")
        rope_scaling = None
        rope_theta = float(d.get("rope_theta", 10000.0))
        if isinstance(rs, dict):
            if "rope_theta" in rs:
                rope_theta = float(rs["rope_theta"])
            rtype = rs.get("rope_type", rs.get("type", "default"))
            if rtype != "default":
                rope_scaling = RopeScaling(
                    rope_type=rtype,
                    factor=float(rs.get("factor", 1.0)),
                    low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
                )
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers can load (used by tests and presets)."""
        arch = {v: k for k, v in _HF_ARCH_TO_FAMILY.items()}[self.architecture]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.architecture in ("llama", "mistral"):
            d["attention_bias"] = self.attention_bias
        if self.rope_scaling is not None:
            d["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated here so that every entry point rejects the same way."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: tuple = ()  # stop strings, trimmed from the output
    stop_token_ids: tuple = ()
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # number of top alternatives (0..20) besides the sampled token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    MAX_LOGPROBS = 20

    def __post_init__(self):
        # normalise list inputs so the object stays hashable and immutable
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
               f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative integers")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below SAMPLING_EPS sample by argmax (the sampler's rule, vLLM's epsilon)."""
        return self.temperature < SAMPLING_EPS

    def replace(self, **kw) -> "SamplingParams":
        return dataclasses.replace(self, **kw)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)


@dataclass(frozen=True)
class CacheConfig:
    """What the KV cache manager needs: block geometry and prefix caching."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size <= 0:
            raise EngineConfigError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks <= 0:
            raise EngineConfigError(f"the KV cache has {self.num_blocks} blocks; it needs at least one")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs: batch limits and the model's context length."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    block_size: int = 16

    def __post_init__(self):
        if self.max_num_seqs <= 0:
            raise EngineConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise EngineConfigError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.block_size:
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below one KV block "
                f"({self.block_size} tokens)"
            )
        if self.max_model_len <= 0:
            raise EngineConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise EngineConfigError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}) so that any prompt fits in one step"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting. Components receive only their part (cache_config, scheduler_config)."""

    model: Optional[str] = None  # directory, .gguf path, or a known name; None = smollm2-135m
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None
    kv_cache_memory_fraction: Optional[float] = None  # of the memory free after loading weights
    num_kv_blocks: Optional[int] = None  # overrides both memory settings (tests)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    no_kv_cache: bool = False  # recompute the whole sequence every step (the labs' baseline)
    attention_backend: str = "auto"  # auto | torch | triton
    quantization: Optional[str] = None  # None | int8
    kv_cache_dtype: str = "auto"  # auto: same as dtype
    use_cuda_graph: bool = True
    # decode matmuls (M <= 8 rows) on a GPU: cublas (F.linear) | triton (model/triton_gemv.py) |
    # auto (whichever is faster per weight shape and M, timed at start-up on the model's weights)
    gpu_linear: str = "cublas"
    cuda_graph_batch_sizes: tuple = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    num_threads: Optional[int] = None
    seed: int = 0
    predict_step_cost: bool = True  # annotate every StepRecord with the cost model's prediction
    hardware: Optional[str] = None  # hardware spec name for predictions; None = local probe/default

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise EngineConfigError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise EngineConfigError(f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}")
        if self.block_size <= 0:
            raise EngineConfigError(f"block_size must be positive, got {self.block_size}")
        if self.block_size & (self.block_size - 1):
            raise EngineConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise EngineConfigError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise EngineConfigError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise EngineConfigError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.max_num_seqs <= 0:
            raise EngineConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise EngineConfigError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.block_size:
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below one KV block "
                f"({self.block_size} tokens)")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise EngineConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise EngineConfigError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.gpu_linear not in ("cublas", "triton", "auto"):
            raise EngineConfigError(f"gpu_linear must be cublas, triton or auto, got {self.gpu_linear!r}")
        if self.quantization not in (None, "int8"):
            raise EngineConfigError(f"quantization must be int8 or unset, got {self.quantization!r}")

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
