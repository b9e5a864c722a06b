"""Fused Triton kernels for the element-wise ops of fused_ops.py: one launch per op.

At batch 1 each eager element-wise op is its own tiny kernel launch (an RMSNorm is ~7 of them,
rotary ~12), which over a whole model costs as much as reading the weights. These kernels do
each op in one launch, with the same numerics as the torch references in fused_ops.py (the
Hugging Face order of operations, including its intermediate roundings to the input dtype).

Shape legend: T tokens, Dm model width, H/Hkv heads, D head dim, I MLP width.

All wrappers are safe under CUDA graph capture: no host syncs, outputs allocated from the input
shapes only, grids depending only on shapes. T == 0 returns empty outputs without a launch.

Written for Triton 3.x; tested on CPU with the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # triton missing or broken: fused_ops falls back to the torch references
    triton = None
    tl = None

AVAILABLE: bool = triton is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")

# Widest row the norm kernels hold in registers at once; wider rows take the two-pass loop.
_MAX_NORM_BLOCK = 16384
# Elements of one silu_mul program (per row).
_SILU_BLOCK = 1024
# Rotary: about this many (head, d < D/2) pairs per program.
_ROTARY_TILE = 1024


def _norm_warps(block: int) -> int:
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


if triton is not None:

    # ----------------------------------------------------------------------------------------
    # RMSNorm: rows of x [A, B, Dm] (strides sa, sb, 1) -> out [A * B, Dm] contiguous
    # ----------------------------------------------------------------------------------------

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, w_ptr, out_ptr, stride_a, stride_b, B, N, eps,
        BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + (row // B) * stride_a + (row % B) * stride_b
        out_row = out_ptr + row * N
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            mask = cols < N
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
            # cast back to x's dtype before the weight multiply (Hugging Face order)
            xn = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, (xn * w).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
                acc += x * x
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < N
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                xn = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(out_row + cols, (xn * w).to(out_ptr.dtype.element_ty), mask=mask)

    # ----------------------------------------------------------------------------------------
    # Residual add + RMSNorm: h = x + r (stored), out = rms_norm(h)
    # ----------------------------------------------------------------------------------------

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, stride_x, stride_r, N, eps,
        BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        r_row = r_ptr + row * stride_r
        h_row = h_ptr + row * N
        out_row = out_ptr + row * N
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            mask = cols < N
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(h_ptr.dtype.element_ty)  # the add rounds to the dtype, as in torch
            tl.store(h_row + cols, h, mask=mask)
            hf = h.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
            hn = (hf * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, (hn * w).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # pass 1: store h and accumulate its squares; pass 2 recomputes h from the inputs
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < N
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
                h = (x + r).to(h_ptr.dtype.element_ty)
                tl.store(h_row + cols, h, mask=mask)
                hf = h.to(tl.float32)
                acc += hf * hf
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < N
                # recomputed rather than re-read from h_ptr: no store-to-load ordering needed
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
                hf = (x + r).to(h_ptr.dtype.element_ty).to(tl.float32)
                hn = (hf * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(out_row + cols, (hn * w).to(out_ptr.dtype.element_ty), mask=mask)

    # ----------------------------------------------------------------------------------------
    # Rotary (rotate-half): q [T, H, D], k [T, Hkv, D] -> contiguous outputs, one launch
    # ----------------------------------------------------------------------------------------

    @triton.jit
    def _rotate_heads(
        src_ptr, dst_ptr, stride_t, stride_h, t, h0, num_heads, c, s, d, d_mask,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & d_mask[None, :]
        src = src_ptr + t * stride_t + heads[:, None] * stride_h + d[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c[None, :] - x2 * s[None, :]
        o2 = x2 * c[None, :] + x1 * s[None, :]
        dst = dst_ptr + t * (num_heads * 2 * HALF) + heads[:, None] * (2 * HALF) + d[None, :]
        tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, o2.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh,
        stride_ct, stride_cd, stride_st, stride_sd,
        H, HKV, Q_GROUPS,
        HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HALF
        c = tl.load(cos_ptr + t * stride_ct + d * stride_cd, mask=d_mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_st + d * stride_sd, mask=d_mask, other=0.0).to(tl.float32)
        if g < Q_GROUPS:
            _rotate_heads(q_ptr, qo_ptr, stride_qt, stride_qh, t, g * BLOCK_H, H, c, s, d, d_mask,
                          HALF, BLOCK_H)
        else:
            _rotate_heads(k_ptr, ko_ptr, stride_kt, stride_kh, t, (g - Q_GROUPS) * BLOCK_H, HKV,
                          c, s, d, d_mask, HALF, BLOCK_H)

    # ----------------------------------------------------------------------------------------
    # silu(gate) * up: gate_up [T, 2I] -> [T, I]
    # ----------------------------------------------------------------------------------------

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        x_row = x_ptr + row * stride_x
        g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + N + cols, mask=mask, other=0.0).to(tl.float32)
        # torch: F.silu(gate) rounded to the input dtype, then the product rounded again
        a = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * N + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Wrappers (same signatures and results as fused_ops' torch references)
# --------------------------------------------------------------------------------------------


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _norm_block(n: int) -> tuple:
    block = triton.next_power_of_2(max(n, 1))
    if block <= _MAX_NORM_BLOCK:
        return block, True
    return _MAX_NORM_BLOCK, False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [.., Dm] -> weight * (x / rms(x)).to(x.dtype), computed in float32 like Hugging Face."""
    n = x.shape[-1]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = _last_dim_contiguous(x)
    weight = weight.contiguous()
    # rows as [A, B] with two strides: a [T, H, D] view of a fused qkv output (qk-norm) needs no copy
    if x.dim() == 1:
        x3 = x.view(1, 1, n)
    elif x.dim() == 2:
        x3 = x.unsqueeze(1)
    elif x.dim() == 3:
        x3 = x
    else:
        x3 = x.reshape(-1, x.shape[-2], n)
    a, b = x3.shape[0], x3.shape[1]
    block, one_pass = _norm_block(n)
    _rms_norm_kernel[(a * b,)](
        x3, weight, out, x3.stride(0), x3.stride(1), b, n, float(eps),
        BLOCK=block, ONE_PASS=one_pass, num_warps=_norm_warps(block),
    )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    """(rms_norm(x + residual), x + residual) in one kernel and one pass over the row."""
    assert x.shape == residual.shape, "x and residual must have the same shape"
    n = x.shape[-1]
    h_dtype = torch.promote_types(x.dtype, residual.dtype)
    h = torch.empty(x.shape, dtype=h_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(h_dtype, weight.dtype), device=x.device)
    if h.numel() == 0:
        return out, h
    x2 = _last_dim_contiguous(x).reshape(-1, n)
    r2 = _last_dim_contiguous(residual).reshape(-1, n)
    weight = weight.contiguous()
    block, one_pass = _norm_block(n)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, h, x2.stride(0), r2.stride(0), n, float(eps),
        BLOCK=block, ONE_PASS=one_pass, num_warps=_norm_warps(block),
    )
    return out, h


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """Rotate-half rotary embedding. q [T, H, D], k [T, Hkv, D] (any row and head strides);
    cos, sin [T, 1, D/2] float32. Returns new contiguous q, k in their own dtypes."""
    t, h, d = q.shape
    hkv = k.shape[1]
    assert k.shape[0] == t and k.shape[2] == d and d % 2 == 0
    half = d // 2
    assert cos.shape[-1] == half and sin.shape[-1] == half
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    q = _last_dim_contiguous(q)
    k = _last_dim_contiguous(k)
    # a table with one row broadcasts over the tokens, as in the reference
    stride_ct = 0 if cos.shape[0] == 1 else cos.stride(0)
    stride_st = 0 if sin.shape[0] == 1 else sin.stride(0)
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(h, hkv, 1)), _ROTARY_TILE // block_d))
    q_groups = triton.cdiv(h, block_h)
    k_groups = triton.cdiv(hkv, block_h)
    _rotary_kernel[(t, q_groups + k_groups)](
        q, k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        stride_ct, cos.stride(-1), stride_st, sin.stride(-1),
        h, hkv, q_groups,
        HALF=half, BLOCK_D=block_d, BLOCK_H=block_h, num_warps=4,
    )
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up with gate, up the two halves of the last dim."""
    two_i = gate_up.shape[-1]
    assert two_i % 2 == 0
    i = two_i // 2
    out = torch.empty((*gate_up.shape[:-1], i), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    x2 = _last_dim_contiguous(gate_up).reshape(-1, two_i)
    block = min(_SILU_BLOCK, triton.next_power_of_2(i))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](
        x2, out, x2.stride(0), i, BLOCK=block, num_warps=4,
    )
    return out
