"""ModelConfig: the shape of a Llama-family transformer, from or to a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from servescope.errors import InvalidParameterError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

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
