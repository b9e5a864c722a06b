"""Int8Linear: the per-channel int8 form (quant/per_channel.py), model/quantize.py's `int8` mode.

Each linear weight W [N, K] becomes int8 Q [N, K] and a scale s [N] with W ~= s[:, None] * Q,
s = max|W[n, :]| / 127. Activations stay in the model dtype; the matmul dequantises on the fly
(torch's `_weight_int8pack_mm` kernel where it exists), so decode reads a quarter of the float32
bytes. On the CPU, decode-sized calls go to the GEMV of kernels/cpu/linear.py.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from servescope.kernels.cpu import linear as cpu_linear
from servescope.quant.per_channel import quantize_per_channel

logger = logging.getLogger(__name__)


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias, act_dtype: torch.dtype):
        super().__init__()
        q, scale = quantize_per_channel(weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(act_dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(act_dtype), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # torch's int8 kernel is only fast on GPUs; on the CPU large-M (prefill) calls dequantise and
        # use the BLAS GEMM (compute-bound anyway), small-M (decode) calls use the GEMV extension.
        self._use_kernel = q.device.type != "cpu" and _kernel_works(q.device, act_dtype)
        self._scale_f32 = scale.float()
        self._bias_f32 = None if bias is None else bias.detach().float()

    def plan_entry(self, dtype: torch.dtype) -> tuple:
        """What the C++ DecodePlan needs (see CpuLinear.plan_entry): the int8 GEMV only, so the plan
        serves this module up to the GEMV's row limit (its larger-M path is eager dequantisation)."""
        rows = cpu_linear.MAX_ROWS[torch.int8]
        empty = torch.empty(0)
        bias = empty if self._bias_f32 is None else self._bias_f32
        return [self.weight_int8, self._scale_f32, bias, empty, empty, empty], (rows, 0), rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [.., K] -> [M, K]
        if cpu_linear.use_gemv(x2, self.weight_int8):  # decode on the CPU: stream int8 once
            y = cpu_linear.gemv(x2, self.weight_int8, self._scale_f32, self._bias_f32).to(x.dtype)
            return y.reshape(*shape[:-1], self.out_features)
        if self._use_kernel:
            y = torch._weight_int8pack_mm(x2.contiguous(), self.weight_int8, self.scale)
        else:  # dequantise, then a normal matmul (correct everywhere, not the fast path)
            y = F.linear(x2, self.weight_int8.to(x.dtype)) * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


_KERNEL_OK: dict = {}


def _kernel_works(device: torch.device, dtype: torch.dtype) -> bool:
    key = (device.type, dtype)
    if key not in _KERNEL_OK:
        try:
            x = torch.randn(2, 64, device=device, dtype=dtype)
            w = torch.randint(-127, 127, (32, 64), device=device, dtype=torch.int8)
            s = torch.rand(32, device=device, dtype=dtype)
            ref = F.linear(x, w.to(dtype)) * s
            out = torch._weight_int8pack_mm(x, w, s)
            _KERNEL_OK[key] = bool(torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2))
        except (RuntimeError, AttributeError, NotImplementedError):
            _KERNEL_OK[key] = False
        logger.info("int8 weight-only kernel on %s/%s: %s", device.type, dtype, _KERNEL_OK[key])
    return _KERNEL_OK[key]
