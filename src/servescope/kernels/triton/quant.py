"""A Triton GEMV over the packed 4- and 8-bit weights of quant/packed.py, for a GPU's decode steps.

Shape legend: M rows of activations (M <= MAX_M), K input width, Kp K padded to the group, N output
width (the weight's rows), G groups per row.

The packed form is the CPU's (quant/packed.py's docstring; GGUF Q4_0 / Q4_1 / Q8_0 bytes with their
scales moved out), so a model quantised once runs on either device:
  int4  uint8 [N, Kp/2]: in each block of 32, byte j = element j (low nibble) | element j + 16 (high)
  int8  int8  [N, Kp]
  scales float16 [N, G] (symmetric: d) | [N, G, 2] (asymmetric: d, m)
At batch 1 a decode step only reads weights, so 4-bit weights read a quarter of float16's bytes
(plus a scale per group). Each program owns BLOCK_N consecutive weight rows and one row of x, walks
K in tiles of BLOCK_K elements (whole blocks of 32, so a tile never splits a group's block),
dequantises the tile in registers and accumulates in float32; no split-K, so the result is
deterministic, and no host syncs, so it can be captured in a CUDA graph.

Tested on the CPU in Triton's interpreter (TRITON_INTERPRET=1, tests/kernels/test_triton_quant.py)
against the dequantise-then-float64 reference.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # triton missing or broken: QuantLinear uses the torch dequantisation
    triton = None
    tl = None

AVAILABLE: bool = triton is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")

MAX_M = 8  # rows this kernel serves; more go to dequantise + GEMM

if triton is not None:

    @triton.jit
    def _quant_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, KP, G, GROUP, stride_xm, stride_ym,
                           BITS: tl.constexpr, ASYM: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n, m = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        row_mask = rows < N
        rows64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if BITS == 4:
            i = tl.arange(0, BLOCK_K // 2)  # byte i of the tile: block i // 16, element i % 16 (and + 16)
            for k0 in range(0, KP, BLOCK_K):
                lo_k = k0 + (i // 16) * 32 + (i % 16)  # [BK/2] the low nibbles' columns
                b_mask = lo_k < KP
                wb = tl.load(w_ptr + rows64[:, None] * (KP // 2) + (k0 // 2 + i)[None, :],
                             mask=row_mask[:, None] & b_mask[None, :], other=0, eviction_policy="evict_first")
                u_lo = (wb & 15).to(tl.float32)  # [BN, BK/2]
                u_hi = (wb >> 4).to(tl.float32)
                x_lo = tl.load(x_ptr + m * stride_xm + lo_k, mask=lo_k < K, other=0.0).to(tl.float32)
                x_hi = tl.load(x_ptr + m * stride_xm + lo_k + 16, mask=lo_k + 16 < K, other=0.0).to(tl.float32)
                gi = rows64[:, None] * G + (lo_k // GROUP)[None, :]  # both nibbles share the block's group
                s_mask = row_mask[:, None] & b_mask[None, :]
                if ASYM:
                    d = tl.load(s_ptr + 2 * gi, mask=s_mask, other=0.0).to(tl.float32)
                    off = tl.load(s_ptr + 2 * gi + 1, mask=s_mask, other=0.0).to(tl.float32)
                    part = d * (u_lo * x_lo[None, :] + u_hi * x_hi[None, :]) + off * (x_lo + x_hi)[None, :]
                else:
                    d = tl.load(s_ptr + gi, mask=s_mask, other=0.0).to(tl.float32)
                    part = d * ((u_lo - 8.0) * x_lo[None, :] + (u_hi - 8.0) * x_hi[None, :])
                acc += tl.sum(part, axis=1)
        else:
            ks0 = tl.arange(0, BLOCK_K)
            for k0 in range(0, KP, BLOCK_K):
                ks = k0 + ks0
                k_mask = ks < KP
                q = tl.load(w_ptr + rows64[:, None] * KP + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                            other=0, eviction_policy="evict_first").to(tl.float32)  # [BN, BK]
                xk = tl.load(x_ptr + m * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
                gi = rows64[:, None] * G + (ks // GROUP)[None, :]
                s_mask = row_mask[:, None] & k_mask[None, :]
                if ASYM:
                    d = tl.load(s_ptr + 2 * gi, mask=s_mask, other=0.0).to(tl.float32)
                    off = tl.load(s_ptr + 2 * gi + 1, mask=s_mask, other=0.0).to(tl.float32)
                    part = (d * q + off) * xk[None, :]
                else:
                    d = tl.load(s_ptr + gi, mask=s_mask, other=0.0).to(tl.float32)
                    part = d * q * xk[None, :]
                acc += tl.sum(part, axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + rows, acc, mask=row_mask)


def quant_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, in_features: int,
               bias: torch.Tensor | None = None, block_n: int = 8, block_k: int = 256) -> torch.Tensor:
    """x [M, K] (M <= MAX_M) times the packed weight -> float32 [M, N] (the QuantLinear layout)."""
    if triton is None:
        raise RuntimeError("triton is not available")
    m, k = x.shape
    n = qweight.shape[0]
    bits = 4 if qweight.dtype == torch.uint8 else 8
    kp = qweight.shape[1] * (2 if bits == 4 else 1)
    groups = scales.shape[1]
    if not (1 <= m <= MAX_M) or k != in_features or kp < k or kp % groups or (kp // groups) % 32:
        raise ValueError(f"quant_gemv: x {tuple(x.shape)}, weight {tuple(qweight.shape)} {qweight.dtype}, "
                         f"scales {tuple(scales.shape)}, in_features {in_features} (M must be 1..{MAX_M})")
    if block_k % 32 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two and a multiple of 32, got {block_k}")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), m)
    _quant_gemv_kernel[grid](x, qweight, scales, bias if bias is not None else scales, y, n, k, kp, groups,
                             kp // groups, x.stride(0), y.stride(0), BITS=bits, ASYM=scales.dim() == 3,
                             HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
