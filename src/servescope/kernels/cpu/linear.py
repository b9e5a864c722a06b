"""The CPU linear kernels' entry points (csrc/kernels.h, csrc/panel_gemm.h, bound in csrc/cpu_ops.cpp: the
CPU kernel extension, compiled on first use for the CPU's instruction set and cached), oneDNN's GEMM on
prepacked weights, and the row limits by which model/linears/cpu.py's CpuLinear picks between them.

`gemv(x, w, scale=None, bias=None)` -> float32 [M, N] for a few rows, weights float32, bfloat16
or int8 (per-row scale); `panel_gemm(x, pack_panels(w), N, bias)` for float32 at 2..256 rows.
`available()` is False where it cannot be built (no compiler, SERVESCOPE_CPU_KERNELS=0); callers then
use the eager PyTorch path, which tests compare against.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from servescope.kernels.cpu import ops as cpu_ops

logger = logging.getLogger(__name__)

# Up to how many rows (tokens) the GEMV beats oneDNN's GEMM on prepacked weights, by weight dtype,
# as measured over a model's layers by benchmarks/gemv_rows.py (docs/BENCHMARKS.md has the tables per
# CPU): the GEMV streams the weights close to a plain read, but its work grows with the rows while
# oneDNN's blocked kernel stays near the weight-read time for a few rows. bfloat16 stops at 2: on the
# Xeon oneDNN runs it on AMX tiles; on the Zen 4 (AVX-512 BF16 dot products) the GEMV is 1.18x oneDNN
# at 2 rows of the Llama-3.2-1B shape and 0.85x at 3 (SmolLM2-135M's narrower matrices: 1.42x at 3, level
# at 4; the real sizes decide: a bfloat16 weight beside a oneDNN copy has its own limit measured at its shape,
# kernels/cpu/gemv_limits.py, and this is its default). float32 at 1, since the panel GEMM below beats the GEMV
# from 2 rows on. int8 has no fast eager kernel for float32 activations.
MAX_ROWS = {torch.float32: 1, torch.bfloat16: 2, torch.int8: 16}
# float32 from MAX_ROWS + 1 up to this many rows: the GEMM on weights packed in column panels
# (csrc/panel_gemm.h), oneDNN above; measured the same way, on the AVX-512 and AVX2 paths, where the
# two were level at twice this.
PANEL_MAX_ROWS = 256
_EXT = cpu_ops._EXT
_EMPTY = torch.empty(0)
load = _EXT.load  # the compiled module, or None (see extension.py)
available = _EXT.available


def gemv(x: torch.Tensor, w: torch.Tensor, scale=None, bias=None) -> torch.Tensor:
    """x [M, K], w [N, K] (float32 | bfloat16 | int8 with scale [N] float32) -> float32 [M, N]."""
    return _EXT.mod.gemv(x, w, _EMPTY if scale is None else scale, _EMPTY if bias is None else bias)


def pack_panels(w: torch.Tensor):
    """A float32 weight as column panels for panel_gemm (one more copy of it in memory), or None: another
    dtype, not on the CPU, or the extension not loaded (the engine loads it before it builds CpuLinears)."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 or _EXT.mod is None:
        return None
    return _EXT.mod.pack_panels(w.detach())


def panel_gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias=None) -> torch.Tensor:
    """x [M, K] float32 times the packed weight [n, K] -> float32 [M, n] (csrc/panel_gemm.h)."""
    return _EXT.mod.panel_gemm(x, panels, n, _EMPTY if bias is None else bias)


def use_gemv(x: torch.Tensor, w: torch.Tensor, rows: Optional[int] = None) -> bool:
    """Whether x goes to the GEMV: up to `rows` rows (None: MAX_ROWS of w's dtype)."""
    limit = MAX_ROWS.get(w.dtype, 0) if rows is None else rows
    return x.device.type == "cpu" and _EXT.mod is not None and x.dim() == 2 and x.shape[0] <= limit


def pack_for_onednn(w: torch.Tensor):
    """The weight reordered into oneDNN's blocked layout, or None where that is unavailable.

    Measured here (2 threads, the decoder's four shapes over 30 layers): float32 runs at about
    200-220 GFLOP/s against 95-190 for torch's default BLAS path at M = 16..256, and the 49152-row
    output head at 2-3x the speed; bfloat16 beats F.linear at every M from 1 to 2048 (M = 16: 207 vs
    117 GFLOP/s; M = 2048: 412 vs 390, the probe's peak being 417). Costs a second copy of the
    weight in memory."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    if os.environ.get("SERVESCOPE_CPU_KERNELS", "1") == "0" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
    except (RuntimeError, AttributeError):
        return None


def onednn_linear(x: torch.Tensor, packed, bias=None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
