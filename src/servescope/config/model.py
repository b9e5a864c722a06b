"""ModelConfig: the shape of a decoder-only transformer, from or to a Hugging Face config.json.

The family (config/families.py) says what a config.json implies; `layer_specs()` says what each layer
computes (config/layers.py), which the model builds and the cost model counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from servescope.config.attention_fields import global_rope_dict, variant_fields, variant_to_hf
from servescope.config.families import family, family_of_hf
from servescope.config.hf_fields import check_fields, window_layers
from servescope.config.layers import AttentionSpec, LayerSpec, MlpSpec
from servescope.config.mla import MlaSpec, mla_from_hf, mla_parameters, mla_to_hf, yarn_mscale
from servescope.config.moe import MoeConfig, expert_parameters, moe_from_hf, moe_to_hf
from servescope.errors import InvalidParameterError

ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style ("llama3"), linear or LongRoPE ("longrope", Phi-3) rope scaling. `rope_type`
    "default" means none. LongRoPE divides each frequency by its short factor at positions below
    original_max_position_embeddings and by its long factor from there on, and scales cos and sin by
    attention_factor."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple = ()  # longrope: one per frequency (head_dim / 2)
    long_factor: tuple = ()
    attention_factor: Optional[float] = None  # longrope, yarn: None derives it from the context extension
    # yarn (DeepSeek-V2/V3): the ramp between interpolated and original frequencies, and cos / sin times
    # mscale(factor, mscale) / mscale(factor, mscale_all_dim) (transformers' _compute_yarn_parameters)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise InvalidParameterError(
                "rope_scaling", f"unsupported rope_scaling type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
            )
        if self.rope_type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise InvalidParameterError("rope_scaling", "longrope needs short_factor and long_factor of equal length")

    @property
    def yarn_attention_factor(self) -> float:
        """yarn: the factor on cos and sin (given, or from mscale and mscale_all_dim, else from factor alone)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def to_hf(self) -> dict:
        """The rope_scaling dict of config.json (the yarn keys only for yarn)."""
        rs = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {k: v for k, v in rs.items() if v is not None and v != [] and (k not in _YARN_KEYS
                                                                              or self.rope_type == "yarn")}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer. Names follow Hugging Face's config.json."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES (config/families.py)
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
    qk_norm_all_heads: bool = False  # OLMoE: that RMSNorm over all heads' features at once
    sliding_window: Optional[int] = None  # the window of the layers that have one (AttentionSpec kind "sliding")
    # per-layer attention kinds ("full" / "sliding") when they differ between layers (Qwen2's max_window_layers,
    # Gemma 2's alternation); empty: every layer is "sliding" when sliding_window is set, else "full". May be
    # longer than num_hidden_layers in the config of a pipeline stage's first layers.
    layer_types: tuple = ()
    hidden_act: str = "silu"
    # Gemma 2/3 and gpt-oss (config/attention_fields.py reads them): the norms' placement (config/layers.py),
    # embeddings times sqrt(hidden_size), the attention scale query_pre_attn_scalar ** -0.5 instead of
    # head_dim ** -0.5, tanh soft-capping of the attention scores and of the final logits, the sliding layers'
    # own rotary base, learned attention sinks
    norm_placement: str = "pre"
    scale_embeddings: bool = False
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    rope_local_theta: Optional[float] = None
    attention_sinks: bool = False
    attention_out_bias: bool = False  # gpt-oss: a bias on o_proj too
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    name: str = ""
    moe: Optional[MoeConfig] = None  # the experts of a mixture-of-experts model (config/moe.py)
    mla: Optional[MlaSpec] = None  # latent attention in every layer (DeepSeek-V2/V3, config/mla.py)

    def __post_init__(self):
        family(self.architecture)  # raises on an unknown one
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
        if self.sliding_window is not None and int(self.sliding_window) <= 0:
            raise InvalidParameterError("sliding_window", f"sliding_window must be positive, got {self.sliding_window}")
        if self.layer_types and (len(self.layer_types) < self.num_hidden_layers or self.sliding_window is None):
            raise InvalidParameterError("layer_types", "layer_types needs one kind per layer and a sliding_window")

    def layer_specs(self) -> tuple:
        """What each decoder layer computes (config/layers.py), validated: a kind the model does not
        implement raises here, at load time."""
        n = self.num_hidden_layers
        mlps = {False: MlpSpec(activation=self.hidden_act)}
        sparse = self.moe.sparse_layers if self.moe else (False,) * n
        if self.moe:
            mlps[True] = MlpSpec("moe", self.hidden_act, self.moe.experts)
        kinds = self.layer_types or ("latent" if self.mla else "sliding" if self.sliding_window else "full",) * n
        specs = {(k, s): LayerSpec(self._attention_spec(k), mlps[s], norm=self.norm_placement)
                 for k, s in set(zip(kinds[:n], sparse[:n]))}
        return tuple(specs[ks] for ks in zip(kinds[:n], sparse[:n]))

    def layers_config(self, layers: range) -> "ModelConfig":
        """The config of this model's consecutive `layers` alone (a pipeline stage's: their attention kinds and
        MLPs, as layer_specs() gives them; the rest of the model's shape unchanged)."""
        lo, hi = layers.start, layers.stop
        moe = dataclasses.replace(self.moe, sparse_layers=self.moe.sparse_layers[lo:hi]) if self.moe else None
        return dataclasses.replace(self, num_hidden_layers=hi - lo, layer_types=self.layer_types[lo:hi], moe=moe)

    def _attention_spec(self, kind: str) -> AttentionSpec:
        sliding = kind == "sliding"
        if kind == "latent":
            return AttentionSpec(kind, bias=self.attention_bias, out_bias=self.attention_bias, latent=self.mla)
        return AttentionSpec(kind, bias=self.attention_bias, qk_norm=self.qk_norm,
                             window=int(self.sliding_window or 0) if sliding else 0,
                             qk_norm_all_heads=self.qk_norm_all_heads,
                             softcap=float(self.attn_logit_softcapping or 0.0),
                             sinks=self.attention_sinks, out_bias=self.attention_out_bias,
                             rope_theta=float(self.rope_local_theta or 0.0) if sliding else 0.0)

    @property
    def attention_scale(self) -> float:
        """The factor on q.k: head_dim ** -0.5, or query_pre_attn_scalar ** -0.5 where the config sets it
        (latent attention: its own, config/mla.py)."""
        if self.mla:
            return self.mla.scale
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def kv_cache_geometry(self) -> tuple:
        """(heads, K row width, V row width) of one layer's KV cache per token: (Hkv, D, D), or for latent
        attention (1, kv_lora_rank + qk_rope_head_dim, 0): the latent row alone, read as keys and values."""
        if self.mla:
            return 1, self.mla.latent_dim, 0
        return self.num_key_value_heads, self.head_dim, self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, i, L, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        attn = d * self.q_size + 2 * d * self.kv_size + self.q_size * d
        if self.mla:
            attn = mla_parameters(self.mla, d, self.num_attention_heads, self.attention_bias)
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        attn += (d if self.attention_out_bias else 0) + (self.num_attention_heads if self.attention_sinks else 0)
        if self.qk_norm:
            attn += self.q_size + self.kv_size if self.qk_norm_all_heads else 2 * self.head_dim
        norms = (4 if self.norm_placement == "sandwich" else 2) * d
        sparse = self.moe.num_sparse(L) if self.moe else 0
        moe = sparse * expert_parameters(self.moe.experts, d)[0] if self.moe else 0
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        return L * (attn + norms) + (L - sparse) * 3 * d * i + moe + emb + d

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "") -> "ModelConfig":
        """Build from a Hugging Face config.json dict. Raises InvalidParameterError on unknown models
        and on fields that ask for maths the model does not implement."""
        fam = family_of_hf(d)
        check_fields(d, fam.hf_fields, fam.name)
        variants = variant_fields(d)  # (before the per-layer-type rope_parameters become the global layers')
        d = global_rope_dict({**fam.hf_defaults, **d})
        sliding_window, kinds = window_layers(fam.window_pattern, d, int(d["num_hidden_layers"]))
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // heads
        mla = mla_from_hf(d, _rope_dict(d)) if "kv_lora_rank" in fam.hf_fields else None
        if mla:  # the rotary tables' width: DeepSeek rotates qk_rope_head_dim features of each head
            head_dim = mla.qk_rope_head_dim
        partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if float(partial) != 1.0:
            raise InvalidParameterError("partial_rotary_factor", f"partial_rotary_factor {partial} (rotary "
                                                                 "over part of each head) is not implemented")
        rope_theta, rope_scaling = _rope_from_hf(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        fields = dict(
            architecture=fam.name,
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
            attention_bias=bool(d.get("qkv_bias", d.get("attention_bias", False))),  # Qwen2-MoE: qkv_bias
            attention_out_bias=fam.out_bias and bool(d.get("attention_bias", False)),
            qk_norm=bool(d.get("qk_norm", False)),
            sliding_window=sliding_window,
            layer_types=kinds if len(set(kinds)) > 1 else (),
            hidden_act=str(d.get("hidden_act", "silu")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            moe=moe_from_hf(fam.name, d, int(d["num_hidden_layers"])),
            mla=mla,
        )
        cfg = cls(**{**fields, **variants, **fam.fixed})
        cfg.layer_specs()  # a layer kind the model does not implement fails here, at load
        return cfg

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers can load (used by tests and presets)."""
        d: dict[str, Any] = {
            "architectures": [family(self.architecture).hf_architecture],
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
            "hidden_act": self.hidden_act,
        }
        if self.architecture in ("llama", "mistral", "qwen3_moe", "olmoe", "gpt_oss"):
            d["attention_bias"] = self.attention_bias
        if self.architecture == "qwen2_moe":
            d["qkv_bias"] = self.attention_bias
        d.update(moe_to_hf(self.architecture, self.moe, self.num_hidden_layers))
        if self.mla:
            d.update(mla_to_hf(self.mla), attention_bias=self.attention_bias)
        d.update(_window_to_hf(self))
        d.update(variant_to_hf(self))
        if self.rope_scaling is not None:
            rs = self.rope_scaling.to_hf()
            if self.rope_scaling.rope_type == "longrope":
                d["original_max_position_embeddings"] = rs["original_max_position_embeddings"]
            d["rope_scaling"] = rs
        elif family(self.architecture).hf_defaults.get("rope_parameters"):  # (gpt-oss: yarn unless it says not)
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d


def _rope_from_hf(d: dict) -> tuple:
    """(rope_theta, RopeScaling or None) of a config.json: `rope_scaling` or transformers 5's
    `rope_parameters` (which may carry rope_theta)."""
    rs = _rope_dict(d)
    rope_theta = float(d.get("rope_theta", 10000.0))
    if not rs:
        return rope_theta, None
    rope_theta = float(rs.get("rope_theta", rope_theta))
    rtype = rs.get("rope_type", rs.get("type", "default"))
    if rtype == "default":
        return rope_theta, None
    original = rs.get("original_max_position_embeddings", d.get("original_max_position_embeddings", 8192))
    attention_factor = rs.get("attention_factor")
    return rope_theta, RopeScaling(
        rope_type=rtype,
        factor=float(rs.get("factor") or 1.0),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        short_factor=tuple(float(x) for x in rs.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in rs.get("long_factor") or ()),
        attention_factor=None if attention_factor is None else float(attention_factor),
        **{k: (bool(rs[k]) if k == "truncate" else float(rs[k])) for k in _YARN_KEYS if rs.get(k) is not None},
    )


def _rope_dict(d: dict) -> dict:
    """The rope_scaling / rope_parameters dict of a config.json ({} where it has none)."""
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    return rs if isinstance(rs, dict) else {}


def _window_to_hf(cfg: ModelConfig) -> dict:
    """The config.json fields that give cfg's windowed layers back under its family's window_pattern."""
    if cfg.sliding_window is None:  # (gpt-oss: windowed unless it says null)
        return {"sliding_window": None} if family(cfg.architecture).hf_defaults.get("sliding_window") else {}
    out = {"sliding_window": cfg.sliding_window}
    if family(cfg.architecture).window_pattern == "max_window_layers":
        out.update(use_sliding_window=True, max_window_layers=0)  # all windowed unless layer_types says otherwise
    if cfg.layer_types:
        out["layer_types"] = [f"{k}_attention" for k in cfg.layer_types[:cfg.num_hidden_layers]]
    return out
