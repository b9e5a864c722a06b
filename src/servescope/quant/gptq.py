"""GPTQ (Frantar et al., 2022): weight quantisation that minimises each layer's output error on
calibration activations, not each weight's own error.

For a linear y = x W^T over calibration inputs X, rounding W to the grid costs ||X (W - Q)^T||^2 =
sum over rows of (w - q) H (w - q)^T, H = X^T X. GPTQ quantises the columns of W one at a time and
spreads each column's rounding error over the columns not yet quantised, in proportion to H^-1 (the
optimal update for a quadratic error), so later columns absorb what earlier ones lost. The scales of
a group are fixed when its first column is reached, from the weights as updated so far, by the same
least-squares search as plain quantisation (quant/search.py); the integers stored are then
the grid points nearest each updated weight, so the result is the same packed form, bytes and kernels
as `quant/packed.quantize`, with different rounding.

`gptq_quantize(w, hessian, scheme)` -> (packed, float16 scales), as `quantize`. Damping: H + damp *
mean(diag H) * I (GPTQ's 1%), raised tenfold while the Cholesky factorisation fails. Inputs whose
column never saw a nonzero activation (diag H = 0) quantise those weights to zero's grid point: they
never reach the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servescope.quant import search as quant_search
from servescope.quant.packed import pack_nibbles
from servescope.quant.scheme import QuantScheme

BLOCK = 128  # columns per lazy-update block (a multiple of every group size)
# GPTQ's paper damps with 1% of the mean diagonal. H from ~8k calibration tokens is a noisy estimate for K
# up to 1536: on SmolLM2's float stand-in (64 x 128 of its own tokens, importance-weighted scales, int4
# group 32) 30% left KL 0.077 on the shipped texts against 0.091 at 10% (docs/BENCHMARKS.md)
DAMP = 0.3


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, scheme: QuantScheme, damp: float = DAMP,
                  weighted_scales: bool = False) -> tuple:
    """w [N, K] float, hessian [K, K] (X^T X of the calibration inputs, any positive scale) ->
    (packed weight, float16 scales) in quant/packed.py's form for `scheme`. weighted_scales: each
    group's scale search weighs its weights' errors by diag(H), as --method imatrix does."""
    n, k = w.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a weight of {k} inputs, got {list(hessian.shape)}")
    w = w.detach().float().clone()
    hdiag = torch.diag(hessian)
    importance = hdiag.float() / hdiag.mean().clamp_min(1e-30) if weighted_scales else None
    # each row's mean squared weight before any update (the importance weights' sigma^2; unweighted: unused)
    sigma2 = w.square().mean(dim=1) if weighted_scales else None
    hinv = _inverse_factor(hessian.double(), w, damp)
    kp, g = scheme.padded_k(k), scheme.group or scheme.padded_k(k)
    zero, lo, hi = _stored_range(scheme)
    stored = torch.empty(n, kp, dtype=torch.int16)
    stored[:, k:] = zero  # the padding: the grid's zero (its weight is never multiplied by anything)
    scales = torch.empty(n, kp // g, *((2,) if scheme.asym else ()), dtype=torch.float16)
    wt = w.T.contiguous()  # [K, N]: a column of W is a contiguous row here (the loop reads and updates them)
    st = torch.empty(k, n)  # the stored integers, by column
    inv_d = d = m = None
    step = BLOCK if scheme.group else k
    for b0 in range(0, k, step):
        b1 = min(k, b0 + step)
        wb, err = wt[b0:b1], torch.empty(b1 - b0, n)
        hb = hinv[b0:b1, b0:b1]
        pivots = torch.diag(hb).tolist()
        for i in range(b1 - b0):
            col = b0 + i
            if col % g == 0:  # this group's scales, from its weights as updated so far
                d, m = _group_scales(wb[i:i + g].T if scheme.group else wt.T, scheme, scales, col // g,
                                     None if importance is None else importance[col:col + g], sigma2)
                inv_d = torch.where(d != 0, 1.0 / d, 0.0)
            x = wb[i]
            q = torch.mul(x if m is None else x - m, inv_d).round_().add_(zero).clamp_(lo, hi)
            st[col] = q
            e = err[i]
            torch.sub(q, zero, out=e).mul_(d)
            if m is not None:
                e.add_(m)
            e.sub_(x).mul_(-1.0 / pivots[i])  # (x - dequantised) / pivot
            if i + 1 < b1 - b0:
                wb[i + 1:].addr_(hb[i, i + 1:], e, alpha=-1)
        wt[b1:] -= hinv[b0:b1, b1:].T @ err
    stored[:, :k] = st.T.to(torch.int16)
    if scheme.bits == 4:
        return pack_nibbles(stored.to(torch.uint8)).contiguous(), scales
    return stored.to(torch.int8).contiguous(), scales


def _inverse_factor(h: torch.Tensor, w: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damping)^-1, float32 [K, K]; dead inputs zeroed in w."""
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    mean_diag = torch.diag(h).mean()
    for _ in range(4):
        chol, info = torch.linalg.cholesky_ex(h + damp * mean_diag * eye)
        if int(info) == 0:
            inv = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(inv, upper=True).float()
        damp *= 10
    raise ValueError("the calibration Hessian is not positive definite even with 10x damping; "
                     "use more calibration tokens")


def _stored_range(scheme: QuantScheme) -> tuple:
    """(the stored integer of grid zero, smallest, largest stored integer) as quant_search stores them."""
    if scheme.bits == 4:
        return (8, 0, 15) if not scheme.asym else (0, 0, 15)
    return (0, -127, 127) if not scheme.asym else (0, -128, 127)


def _group_scales(cols: torch.Tensor, scheme: QuantScheme, scales: torch.Tensor, gi: int, importance=None,
                  sigma2=None) -> tuple:
    """The searched float16 scale (and offset) of one group [N, <=g] of columns, stored at group gi;
    returned as float32 (d [N], m [N] or None). importance: its columns' [<=g], or None; sigma2: each row's
    mean squared weight [N]."""
    g = scheme.group or cols.shape[1]
    real = cols.shape[1]
    width = g if scheme.group else scheme.padded_k(real)
    x = F.pad(cols.contiguous(), (0, width - real)).view(cols.shape[0], 1, width)  # (row-major: the same sums)
    if importance is not None:
        importance = F.pad(importance, (0, width - real))
    _, sc = quant_search.quantize_group_rows(x, real, scheme, importance, sigma2)
    scales[:, gi] = sc[:, 0]
    sc = sc[:, 0].float()
    return (sc[:, 0], sc[:, 1]) if scheme.asym else (sc, None)
