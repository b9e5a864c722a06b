"""CpuLinear: nn.Linear on the CPU's linear kernels (kernels/cpu/linear.py), picking between the GEMV, the
panel GEMM and oneDNN's prepacked GEMM by rows; model/transforms.py's use_cpu_linears swaps it in."""

from __future__ import annotations

import torch

from servescope.kernels.cpu.gemv_limits import gemv_rows
from servescope.kernels.cpu.linear import (PANEL_MAX_ROWS, gemv, onednn_linear, pack_for_onednn, pack_panels,
                                           panel_gemm, use_gemv)

_EMPTY = torch.empty(0)


class CpuLinear(torch.nn.Module):
    """nn.Linear on the CPU: small-M (decode) calls go to the GEMV kernel, float32 up to PANEL_MAX_ROWS
    rows to the panel GEMM, larger M to oneDNN's GEMM on prepacked weights (F.linear where none is
    available). The GEMV's row limit: measured for a bfloat16 weight's shape on this CPU (kernels/cpu/gemv_limits.py),
    linear.MAX_ROWS otherwise. float_output: return float32 from the GEMV without rounding to the activation dtype
    (the output head: logits are float32)."""

    def __init__(self, linear: torch.nn.Linear, float_output: bool = False):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.float_output = float_output
        self._bias_f32 = None if linear.bias is None else linear.bias.detach().float()
        self._packed = pack_for_onednn(linear.weight)
        self._panels = pack_panels(linear.weight)
        self.gemv_rows = gemv_rows(linear.weight, self._packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_gemv(x, self.weight, self.gemv_rows):
            y = gemv(x, self.weight, None, self._bias_f32)  # float32 [M, N]
            return y if self.float_output else y.to(x.dtype)
        if self._panels is not None and x.dim() == 2 and x.shape[0] <= PANEL_MAX_ROWS and x.dtype == torch.float32:
            return panel_gemm(x, self._panels, self.weight.shape[0], self._bias_f32)
        if self._packed is not None and x.dim() == 2 and x.dtype == self.weight.dtype:
            return onednn_linear(x, self._packed, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def plan_entry(self, dtype: torch.dtype) -> tuple:
        """What the C++ DecodePlan needs to issue this module's kernels itself, for the plan's activation
        dtype (the weight's, here): ([weight, int8 scale, float32 bias, oneDNN-packed weight, bias, panels],
        (the GEMV's row limit, the panel GEMM's), the most rows it serves)."""
        rows = self.gemv_rows
        panel_rows = 0 if self._panels is None else PANEL_MAX_ROWS
        served = max(rows, panel_rows) if self._packed is None else 1 << 30  # oneDNN serves any M once packed
        return ([self.weight.detach(), _EMPTY, _opt(self._bias_f32), _opt(self._packed), _opt(self.bias),
                 _opt(self._panels)], (rows, panel_rows), served)


def _opt(t):
    return _EMPTY if t is None else t.detach()
