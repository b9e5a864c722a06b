"""Small element-wise ops of a decoder layer, behind one dispatch point.

Each op has a torch reference (runs everywhere, numerically the Hugging Face order of operations)
and may have a fused kernel for a device (Triton on CUDA, see triton/fused.py; C++ on the CPU,
see cpu/ops.py): on a GPU the eager versions cost several tiny kernel launches each, on the CPU
several ops of dispatch overhead each, which at batch 1 adds up to as much time as reading the
weights. The references stay as the fallback (SERVESCOPE_CPU_KERNELS=0, no compiler) and oracle.

Shape legend: T tokens, Dm model width, H/Hkv heads, D head dim, I MLP width.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from servescope.kernels.cpu import ops as cpu_ops


@functools.cache
def _fused():
    """The Triton kernels, looked for at the first CUDA tensor (None: no triton, or it cannot run)."""
    try:
        # lazy and optional: triton may be missing, and importing it is start-up time a CPU never needs
        from servescope.kernels.triton import fused as triton_fused
    except ImportError:
        return None
    return triton_fused if triton_fused.AVAILABLE else None


def _use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and _fused() is not None


def _use_cpu(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None) -> bool:
    """CPU tensors of one dtype (float32 | bfloat16), no autograd, and the extension built (first call builds)."""
    if x.device.type != "cpu" or x.dtype not in cpu_ops.DTYPES or cpu_ops.load() is None:
        return False
    if a.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return False
    if torch.is_grad_enabled():
        return not (x.requires_grad or a.requires_grad or (b is not None and b.requires_grad))
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [.., Dm] -> weight * x / rms(x), computed in float32 like Hugging Face."""
    if _use_fused(x):
        return _fused().rms_norm(x, weight, eps)
    if _use_cpu(x, weight):
        return cpu_ops.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    """(rms_norm(x + residual), x + residual): the residual add fused into the next norm."""
    if _use_fused(x):
        return _fused().add_rms_norm(x, residual, weight, eps)
    if _use_cpu(x, residual, weight) and x.shape == residual.shape:
        return cpu_ops.add_rms_norm(x, residual, weight, eps)
    h = x + residual
    return rms_norm(h, weight, eps), h


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """Rotate-half rotary embedding. q [T, H, D], k [T, Hkv, D]; cos, sin [T, 1, D/2] float32."""
    if _use_fused(q):
        return _fused().rotary(q, k, cos, sin)
    if (_use_cpu(q, k) and q.dim() == 3 and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and 2 * cos.numel() == q.shape[0] * q.shape[2] == 2 * sin.numel()):
        return cpu_ops.rotary(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # [T, h, D/2] each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)  # a no-op in float32


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: gelu(gate, tanh approximation) * up (Gemma's MLP; plain torch on every device)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation of [n, 2I] (gate | up) -> [n, I]: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g),
    g = min(gate, limit). On the CPU the C++ kernel (one rounding at the end; the fused expert ops call the same
    one, so the per-expert modules and the fused op agree bit for bit), else transformers' torch ops."""
    if gate_up.dim() == 2 and _use_cpu(gate_up, gate_up):
        return cpu_ops.clamped_swiglu(gate_up, limit, alpha)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up."""
    if _use_fused(gate_up):
        return _fused().silu_mul(gate_up)
    if _use_cpu(gate_up, gate_up):
        return cpu_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

