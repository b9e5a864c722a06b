"""Building blocks shared by the model families: RMSNorm, rotary embedding, gated MLP.

Shape legend: T tokens, Dm model width, H query heads, Hkv KV heads, D head dim, I MLP width.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from servescope.config import LayerSpec, ModelConfig, RopeScaling
from servescope.kernels import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in float32 like Hugging Face, then cast back before the weight multiply
        return fused_ops.rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) (kind "dense"), act silu or GELU's tanh approximation (Gemma)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, width: Optional[int] = None):
        super().__init__()
        width = width or cfg.intermediate_size  # a shared expert's own width (model/moe.py)
        self.act_mul = fused_ops.silu_mul if spec.mlp.activation == "silu" else fused_ops.gelu_tanh_mul
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=False)  # gate | up
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def projections(self) -> list:
        return [(self, "gate_up_proj", self.gate_up_proj), (self, "down_proj", self.down_proj)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, Dm]


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> torch.Tensor:
    """Inverse frequencies [D/2], with Llama-3 ("llama3") or linear scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv.float()
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).float()
    if scaling.rope_type == "longrope":  # the short factors; rotary_tables switches to the long ones
        return _longrope_inv_freq(head_dim, theta, scaling.short_factor)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled).float()


def _yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies in transformers' float32 order (_compute_yarn_parameters): the original ones for
    the fast-rotating dimensions, divided by `factor` for the slow ones, a linear ramp between the
    dimensions that rotate beta_fast and beta_slow times over the original context."""
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    orig = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (scaling.factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation


def _longrope_inv_freq(head_dim: int, theta: float, factors) -> torch.Tensor:
    """LongRoPE's frequencies in transformers' order of float32 operations."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape)


def longrope_attention_factor(scaling: RopeScaling, max_positions: int) -> float:
    """cos and sin are scaled by this (LongRoPE's paper: keeps the attention entropy over the longer
    context); derived from how far max_position_embeddings extends the original context unless given."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = max_positions / scaling.original_max_position_embeddings
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position_embeddings))


def rotary_tables(head_dim: int, max_positions: int, theta: float, scaling: Optional[RopeScaling],
                  context: Optional[int] = None) -> tuple:
    """float32 cos, sin [P, D/2] for positions 0..P-1. LongRoPE: the short factors below the original
    context, the long ones from there on (a sequence that grows past it keeps its earlier keys, as
    transformers' cache does; a prompt longer than the original context in one forward is where the two
    differ: transformers then rotates all of it with the long factors). context: the model's
    max_position_embeddings (LongRoPE's attention factor), max_positions when None."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(head_dim, theta, scaling))  # [P, D/2]
    if scaling is not None and scaling.rope_type == "yarn":
        scale = scaling.yarn_attention_factor
        return freqs.cos() * scale, freqs.sin() * scale
    if scaling is None or scaling.rope_type != "longrope":
        return freqs.cos(), freqs.sin()
    lo = min(scaling.original_max_position_embeddings, max_positions)
    long = torch.outer(t[lo:], _longrope_inv_freq(head_dim, theta, scaling.long_factor))
    freqs = torch.cat([freqs[:lo], long])
    scale = longrope_attention_factor(scaling, context or max_positions)
    return freqs.cos() * scale, freqs.sin() * scale


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding, as Hugging Face Llama applies it."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[RopeScaling],
                 context: Optional[int] = None):
        super().__init__()
        cos, sin = rotary_tables(head_dim, max_positions, theta, scaling, context)
        # float32 tables; persistent=False keeps them out of the state dict (not checkpoint keys)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def table(self, positions: torch.Tensor) -> tuple:
        """cos, sin [T, 1, D/2] for the step's positions: looked up once per step, used by every layer."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def apply(cos_sin: tuple, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D]; k [T, Hkv, D] -> rotated q, k (same shapes and dtype)."""
        return fused_ops.rotary(q, k, *cos_sin)
