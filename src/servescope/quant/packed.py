"""Weight-only 4- and 8-bit weights in their packed form: quantize, pack, unpack, dequantize.

The packed form (kernels/cpu/csrc/quant_gemv.h says it byte by byte): along K the weight is cut into blocks
of 32, a group of 32, 64, 128 or all of K shares one float16 scale d (and an offset m when asymmetric):
  int4  uint8 [N, Kp/2], byte j of a block = element j (low nibble) | element j + 16 (high nibble);
        symmetric d * (u - 8) (GGUF Q4_0), asymmetric d * u + m (GGUF Q4_1)
  int8  int8 [N, Kp]; symmetric d * q (GGUF Q8_0), asymmetric d * q + m
  scales float16 [N, G] (symmetric) | [N, G, 2] (asymmetric: d, m)
Kp is K rounded up to the group (the padding is zeros). GGUF's Q4_0 / Q4_1 / Q8_0 blocks are these very
bytes with their scales moved out (loader/gguf_packed.py), so a GGUF runs from its own blocks. The modules
that multiply by them are model/linears/packed.py's QuantLinear and QuantEmbedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servescope.quant import mxfp4
from servescope.quant import search as quant_search
from servescope.quant.scheme import BLOCK, QuantScheme


def quantize(w: torch.Tensor, scheme: QuantScheme, importance=None) -> tuple:
    """w [N, K] float -> (packed weight, float16 scales) in the form above. importance: None, or each
    input's mean squared activation on calibration data [K] (servescope quantize --method imatrix): the
    search then weighs each weight's error by it, as llama.cpp's imatrix quantisation does
    (quant/search.py importance_weights), over its fuller candidate sets.

    Each group's scale (and offset) is searched for, as llama.cpp's quantisers do (ggml-quants.c
    make_qx_quants, make_qkx2_quants): for a few candidate scales around the plain rule (symmetric int4:
    the value of largest magnitude maps to -8, GGUF Q4_0's; int8: amax / 127; asymmetric: min / max),
    the integers, then the least-squares scale (and offset) for those integers; the candidate of least
    squared error is kept and refitted once on its own nearest integers. The integers stored are the
    nearest for the float16 scale and offset stored. An asymmetric group keeps the plain rule where that
    is no worse, so a group already on a 4-bit asymmetric grid (Q4_1 data) comes back exactly. Rows go
    in chunks of SEARCH_ELEMENTS weights (the temporaries: a few MiB)."""
    n, k = w.shape
    kp = scheme.padded_k(k)
    g = scheme.group or kp
    w = w.detach()
    rows = max(1, SEARCH_ELEMENTS // kp)
    if importance is not None:
        importance = F.pad(importance.detach().float().reshape(k), (0, kp - k))
    q = torch.empty(n, kp, dtype=torch.uint8 if scheme.bits == 4 else torch.int8)
    scales = torch.empty(n, kp // g, *((2,) if scheme.asym else ()), dtype=torch.float16)
    for r0 in range(0, n, rows):
        part = w[r0:r0 + rows]
        x = F.pad(part.float(), (0, kp - k)).view(part.shape[0], kp // g, g)
        qi, scales[r0:r0 + rows] = quant_search.quantize_group_rows(x, k, scheme, importance)
        q[r0:r0 + rows] = qi.view(part.shape[0], kp)
    packed = pack_nibbles(q) if scheme.bits == 4 else q
    return packed.contiguous(), scales.contiguous()



SEARCH_ELEMENTS = 1 << 18  # weights per chunk of rows: 1 MiB of float32 per temporary, cache-sized


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    n, kp = u.shape
    b = u.view(n, kp // BLOCK, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, kp // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The stored integers [N, Kp] (int4: 0..15) as int16."""
    if packed.dtype == torch.int8:
        return packed.to(torch.int16)
    n = packed.shape[0]
    b = packed.view(n, -1, 16).to(torch.int16)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(n, -1)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, k: int, dtype=torch.float32) -> torch.Tensor:
    """The packed matrix as [N, k] floats (torch only: the reference, and the path off the CPU); MXFP4's
    E8M0-scaled blocks too (quant/mxfp4.py)."""
    if mxfp4.is_mxfp4(scales):
        return mxfp4.dequantize(packed, scales, k, dtype)
    q = unpack(packed).to(dtype)
    n, kp = q.shape
    groups = scales.shape[1]
    q = q.view(n, groups, kp // groups)
    if scales.dim() == 3:
        w = q * scales[..., 0, None].to(dtype) + scales[..., 1, None].to(dtype)
    elif packed.dtype == torch.uint8:
        w = (q - 8) * scales[..., None].to(dtype)
    else:
        w = q * scales[..., None].to(dtype)
    return w.reshape(n, kp)[:, :k]


def gemv_activations(x: torch.Tensor, kp: int, group: int) -> tuple:
    """What the C++ GEMV multiplies x [M, K] with, in float64, and each element's rounding bound: with
    group-32 scales, x rounded per 32-block to int8 as kernels/cpu/csrc/quant_dot.h does (float32
    d = amax / 127, q = x / d rounded half to even); with other groups x itself (quant_gemv.h). The tests' reference."""
    if group != BLOCK:
        return x.double(), torch.zeros_like(x, dtype=torch.float64)
    m, k = x.shape
    xb = F.pad(x.float(), (0, kp - k)).view(m, kp // BLOCK, BLOCK)
    d = xb.abs().amax(dim=2, keepdim=True) / 127.0
    q = torch.round(xb * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))).clamp(-127, 127)
    xa = (q.double() * d.double()).view(m, kp)[:, :k]
    return xa, (d.double() / 2).expand_as(xb).reshape(m, kp)[:, :k]
