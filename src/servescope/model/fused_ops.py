"""Small element-wise ops of a decoder layer, behind one dispatch point.

Each op has a torch reference (runs everywhere, numerically the Hugging Face order of operations)
and may have a fused kernel for a device (Triton on CUDA, see triton_fused.py): on a GPU the
eager versions cost several tiny kernel launches each, which at batch 1 adds up to as much time
as reading the weights.

Shape legend: T tokens, Dm model width, H/Hkv heads, D head dim, I MLP width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _fused():
    try:
        from servescope.model import triton_fused
    except ImportError:
        return None
    return triton_fused if triton_fused.AVAILABLE else None


def _use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and _FUSED is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [.., Dm] -> weight * x / rms(x), computed in float32 like Hugging Face."""
    if _use_fused(x):
        return _FUSED.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    """(rms_norm(x + residual), x + residual): the residual add fused into the next norm."""
    if _use_fused(x):
        return _FUSED.add_rms_norm(x, residual, weight, eps)
    h = x + residual
    return rms_norm(h, weight, eps), h


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """Rotate-half rotary embedding. q [T, H, D], k [T, Hkv, D]; cos, sin [T, 1, D/2] float32."""
    if _use_fused(q):
        return _FUSED.rotary(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # [T, h, D/2] each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)  # a no-op in float32


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up."""
    if _use_fused(gate_up):
        return _FUSED.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_FUSED = _fused()
