"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as data: the shape of the latent and its config.json fields.

A latent layer projects each token to one compressed KV row: c (kv_lora_rank features, RMS-normed by
kv_a_layernorm) and k_pe (qk_rope_head_dim features, rotated, shared by every head). The KV cache stores
that row, [c | k_pe], instead of per-head K and V: (kv_lora_rank + qk_rope_head_dim) values per token per
layer. Each head's key is [W_UK c | k_pe] (qk_nope_head_dim + qk_rope_head_dim) and its value W_UV c
(v_head_dim), W_UK and W_UV being kv_b_proj's rows; the query comes from x directly (q_proj) or through a
low-rank pair with its own norm (q_a_proj, q_a_layernorm, q_b_proj) when q_lora_rank is set. The module
is model/mla.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servescope.errors import InvalidParameterError

# config.json fields of the DeepSeek-V2/V3 families beyond Llama's (their expert fields: config/moe.py)
MLA_FIELDS = frozenset({"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                        "qk_head_dim", "rope_interleave"})


@dataclass(frozen=True)
class MlaSpec:
    """The latent attention of one layer (AttentionSpec.latent)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: the query is one projection of x (DeepSeek-V2-Lite), else a low-rank pair
    # DeepSeek's rope rotates interleaved pairs (x0, x1), (x2, x3) ...; False: rotate-half like Llama
    rope_interleave: bool = True
    softmax_scale: float = 0.0  # the factor on q.k; 0: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(name, f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_nope_head_dim < 0 or self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
            raise InvalidParameterError("qk_rope_head_dim", "qk_nope_head_dim and q_lora_rank must not be negative "
                                                            "and qk_rope_head_dim must be even")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the KV cache holds per token and layer: the normed latent and the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale or self.qk_head_dim ** -0.5


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1), transformers' yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_from_hf(d: dict, rope: dict) -> MlaSpec:
    """The MlaSpec of a DeepSeek config.json dict; rope: its rope_scaling / rope_parameters dict ({} for
    none). A scaled rope with mscale_all_dim scales the softmax too: scale * mscale(factor, all_dim) ** 2,
    as DeepSeek's reference and transformers' yarn_apply_mscale do."""
    nope, rot = int(d.get("qk_nope_head_dim", 128)), int(d.get("qk_rope_head_dim", 64))
    scale = (nope + rot) ** -0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return MlaSpec(kv_lora_rank=int(d.get("kv_lora_rank", 512)), qk_nope_head_dim=nope, qk_rope_head_dim=rot,
                   v_head_dim=int(d.get("v_head_dim", 128)), q_lora_rank=int(d.get("q_lora_rank") or 0),
                   rope_interleave=bool(d.get("rope_interleave", True)), softmax_scale=scale)


def mla_to_hf(m: MlaSpec) -> dict:
    """The config.json fields that give `m` back (its scale follows from them and the rope scaling)."""
    return {"kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank or None,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim, "rope_interleave": m.rope_interleave}


def mla_parameters(m: MlaSpec, hidden: int, heads: int, bias: bool = False) -> int:
    """Parameters of one latent attention layer (projections and its norms)."""
    q = hidden * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim if m.q_lora_rank \
        else hidden * heads * m.qk_head_dim
    kv = hidden * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    out = heads * m.v_head_dim * hidden
    biases = (m.q_lora_rank + m.latent_dim + hidden) if bias else 0
    return q + kv + out + biases


def mla_tensor_shapes(m: MlaSpec, prefix: str, hidden: int, heads: int, bias: bool = False) -> dict:
    """The checkpoint tensors of one latent attention layer (transformers' names) and their shapes."""
    p = prefix + "self_attn."
    shapes = {p + "kv_a_proj_with_mqa.weight": (m.latent_dim, hidden), p + "kv_a_layernorm.weight": (m.kv_lora_rank,),
              p + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
              p + "o_proj.weight": (hidden, heads * m.v_head_dim)}
    if m.q_lora_rank:
        shapes.update({p + "q_a_proj.weight": (m.q_lora_rank, hidden), p + "q_a_layernorm.weight": (m.q_lora_rank,),
                       p + "q_b_proj.weight": (heads * m.qk_head_dim, m.q_lora_rank)})
    else:
        shapes[p + "q_proj.weight"] = (heads * m.qk_head_dim, hidden)
    if bias:
        shapes.update({p + "kv_a_proj_with_mqa.bias": (m.latent_dim,), p + "o_proj.bias": (hidden,)})
        if m.q_lora_rank:
            shapes[p + "q_a_proj.bias"] = (m.q_lora_rank,)
    return shapes
