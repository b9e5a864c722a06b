"""The fused MoE ops (kernels/cpu: one C++ call per sparse layer) over a layer's experts, built from their modules.

- packed group-32 experts (PackedExperts of QuantLinears: GGUF Q4_0 / Q4_1 / Q8_0, MXFP4, --quantization int4 /
  int8-g32): `moe_packed` (csrc/moe_experts.h), up to the modules' packed-GEMV row limit;
- float experts (Experts: float32 / bfloat16, what an HF checkpoint loads as; gpt-oss's ClampedExperts with their
  biases and clamped SwiGLU) and per-channel int8 ones
  (PackedExperts of Int8Linears: --quantization int8; gpt-oss's PackedClampedExperts of them with their biases and
  clamped SwiGLU): `moe_dense` (csrc/moe_dense.cpp), at any rows: each
  expert's rows take the kernel its module takes (`expert_linear` for Experts, Int8Linear.forward), so the op
  equals grouped_experts over the same modules bit for bit (float experts: the GEMV up to EXPERT_GEMV_ROWS).

On a GPU, float Experts run the Triton grouped GEMMs instead (`triton_op`: kernels/triton/moe.py).

A handle is built once per layer and again after the weights move (`cached_op`: the huge-page move replaces
the buffers). None where no op applies: grouped_experts runs then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servescope.kernels import fused_ops
from servescope.kernels.cpu import linear as cpu_linear
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears.int8 import Int8Linear
from servescope.model.linears.packed import QuantLinear

ANY_ROWS = 1 << 30  # the dense op's row limit: it takes the modules' own kernel at every row count
# Up to how many rows of one float expert the decode GEMV runs (above: F.linear). Not the dense projections'
# cpu_linear.MAX_ROWS: those hand larger M to the panel GEMM or oneDNN on prepacked copies of the weight, which
# experts do not get (a second copy of every expert is more memory than most MoEs can spare); against ATen's
# GEMM on the unpacked weight (which reorders a bfloat16 weight on every call) the GEMV, reading the weight
# once, stays ahead up to about these rows (benchmarks/moe_float_plan.py --expert-rows).
EXPERT_GEMV_ROWS = {torch.float32: 16, torch.bfloat16: 4}


def expert_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, K] times one float expert's matrix w [N, K] -> [n, N] in x's dtype: the decode GEMV up to
    EXPERT_GEMV_ROWS on the CPU, else F.linear (what the fused op issues for those rows)."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= EXPERT_GEMV_ROWS.get(w.dtype, 0)
            and cpu_linear.load() is not None):
        return cpu_linear.gemv(x, w).to(x.dtype)
    return F.linear(x, w)


def cached_op(module: nn.Module, key: tuple, build):
    """module's op for the weights `key` names (data pointers), built by build() on the first call or a new key."""
    cached = module.__dict__.get("_fused_op")
    if cached is None or cached[0] != key:
        cached = (key, build())
        module.__dict__["_fused_op"] = cached
    return cached[1]


def packed_experts_op(experts: nn.Module):
    """PackedExperts' op: MoeDense over Int8Linears, MoePacked over QuantLinears, None otherwise."""
    g, d = experts.gate_up[0], experts.down[-1]
    if type(g) is Int8Linear:
        key = (g.weight_int8.data_ptr(), getattr(d, "weight_int8", g.weight_int8).data_ptr(),
               *(b.data_ptr() for b in _stacked_biases(experts)))
        return cached_op(experts, key, lambda: int8_op(experts))
    if not isinstance(g, QuantLinear):
        return None
    key = (g.qweight.data_ptr(), getattr(d, "qweight", g.qweight).data_ptr())
    return cached_op(experts, key, lambda: packed_op(experts))


def packed_experts_rows(experts: nn.Module, dtype: torch.dtype) -> int:
    """Up to how many rows of `dtype` PackedExperts' op runs: any for Int8Linears of that activation dtype, the
    QuantLinears' packed-GEMV row limit (the same kernels as their modules), else 0."""
    g, d = experts.gate_up[0], experts.down[-1]
    if type(g) is Int8Linear:
        return ANY_ROWS if g.scale.dtype == dtype and packed_experts_op(experts) is not None else 0
    if not (isinstance(g, QuantLinear) and isinstance(d, QuantLinear)):
        return 0
    return min(g.row_limit(dtype), d.row_limit(dtype))


def float_op(experts: nn.Module):
    """moe_dense over Experts' stacked float weights (views, no copies), gpt-oss's ClampedExperts with their
    stacked biases and activation, or None (not on the CPU, no extension)."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if gate_up.device.type != "cpu" or gate_up.dtype not in (torch.float32, torch.bfloat16):
        return None
    clamped = {}
    if hasattr(experts, "gate_up_proj_bias"):  # (ClampedExperts: act 1)
        clamped = dict(biases=(experts.gate_up_proj_bias.detach(), experts.down_proj_bias.detach()),
                       act=experts.act, alpha=experts.alpha, limit=experts.limit)
    try:
        return cpu_ops.moe_dense(gate_up.unbind(0), down.unbind(0), EXPERT_GEMV_ROWS[gate_up.dtype], **clamped)
    except RuntimeError:  # the op's own checks (shapes, the biases' dtype): grouped_experts runs them
        return None


def _stacked_biases(experts: nn.Module) -> tuple:
    """gpt-oss's stacked expert biases (gate_up [E, 2I], down [E, H]; PackedClampedExperts), () where none."""
    if not hasattr(experts, "gate_up_proj_bias"):
        return ()
    return experts.gate_up_proj_bias.detach(), experts.down_proj_bias.detach()


def int8_op(experts: nn.Module):
    """moe_dense over PackedExperts of bias-free Int8Linears in one activation dtype on the CPU: silu, or gpt-oss's
    clamped SwiGLU with the stacked expert biases in that dtype (PackedClampedExperts: each bias added after its
    projection's rounding, as its `run` adds it), else None."""
    mods, biases = experts.linears(), _stacked_biases(experts)
    if not biases and (experts.act != 0 or any(experts.biases())):
        return None
    if not all(type(m) is Int8Linear and m.bias is None and m.weight_int8.device.type == "cpu" for m in mods):
        return None
    if len({m.scale.dtype for m in mods}) != 1:
        return None
    scales = [[m._scale_f32 for m in ms] for ms in (experts.gate_up, experts.down)]
    scales += [[m.scale for m in ms] for ms in (experts.gate_up, experts.down)]
    clamped = dict(biases=biases, act=experts.act, alpha=experts.alpha, limit=experts.limit) if biases else {}
    try:
        return cpu_ops.moe_dense([m.weight_int8 for m in experts.gate_up], [m.weight_int8 for m in experts.down],
                                 cpu_linear.MAX_ROWS[torch.int8], scales=scales, **clamped)
    except RuntimeError:  # the op's own checks (shapes, the biases' dtype): grouped_experts runs them
        return None


def packed_op(experts: nn.Module):
    """moe_packed over the experts' packed tensors, or None where it does not apply: a module other than a
    group-32 QuantLinear without bias on the CPU whose K is whole 32-blocks, mixed formats (MXFP4 included), no
    extension. The experts' own biases (`biases`) and activation (`act`, `alpha`, `limit`) go with them."""
    for m in experts.linears():
        if not (isinstance(m, QuantLinear) and m.group32 and not m.float_output
                and m.qweight.device.type == "cpu" and m.in_features % 32 == 0):
            return None
    if any(m.bias is not None for m in experts.linears()):
        return None
    gate_up_b, down_b = experts.biases()
    try:
        return cpu_ops.moe_packed([(m.qweight, m.scales) for m in experts.gate_up],
                                  [(m.qweight, m.scales) for m in experts.down], 0, gate_up_b, down_b,
                                  experts.act, experts.alpha, experts.limit)
    except RuntimeError:  # the op's own checks (formats, shapes): grouped_experts runs them
        return None


class TritonExperts:
    """Experts' op on a GPU: the two Triton grouped GEMMs over the stacked weights (kernels/triton/moe.py), no
    loop over the experts on the host."""

    def __init__(self, experts: nn.Module, kernels):
        self.experts, self.kernels = experts, kernels

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        e = self.experts
        out, counts = self.kernels.fused_experts(x, ids, weights, e.gate_up_proj, e.down_proj, fused_ops.silu_mul)
        return out, counts.cpu()  # (the blocks' routed_tokens are host counters)


def triton_op(experts: nn.Module):
    """TritonExperts over float Experts where Triton runs (a GPU), else None."""
    from servescope.kernels.triton import moe as triton_moe  # lazy: a CPU never needs triton's import time

    return TritonExperts(experts, triton_moe) if triton_moe.AVAILABLE else None
