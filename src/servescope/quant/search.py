"""The scale search of quant/packed.py's `quantize` and of GPTQ's groups: for each group of weights, the
scale (and offset) of least squared error among a few candidates, as llama.cpp's quantisers choose
theirs; with calibration data, the error weighted by each input's importance (llama.cpp's imatrix).
Shapes: x [R, G, g], R rows of G groups of g weights, float32, zero-padded past K."""

from __future__ import annotations

import torch

from servescope.quant.scheme import QuantScheme

# The candidate inverse scales, by bits: (levels + STEP) / range, STEP in steps of the grid (llama.cpp's
# make_qx_quants tries 0.1 * (-9..9), make_qkx2_quants -1 + 0.1 * (0..20); these few keep quantising
# at load close to the plain rule's time). Asymmetric 8 bits: the plain
# rule's integers only, refitted (their errors are too close for float32 sums to rank candidates).
# Without calibration data the error is unweighted: weighted by x^2 (llama.cpp's rmse_type 1) it gave a
# higher KL, and the full llama.cpp sets gained little over these (docs/BENCHMARKS.md, "The scale search").
# With each input's importance the weighting is what pays: it cuts int4-g32-asym's KL several-fold on
# SmolLM2's float stand-in (docs/BENCHMARKS.md, the importance-matrix search).
SYM_STEPS = {4: (-0.6, -0.3, 0.0, 0.3, 0.6), 8: (-0.6, -0.3, 0.0, 0.3, 0.6)}
ASYM_STEPS = {4: (-0.5, 0.0, 0.5), 8: (0.0,)}
# With calibrated importance (servescope quantize, offline: seconds more are fine) llama.cpp's full sets:
# make_qx_quants' 0.1 * (-9..9) for Q4_0, make_qkx3_quants' -0.9 + 0.05 * (0..36) for Q4_1 (ggml-quants.c)
WEIGHTED_SYM_STEPS = {4: tuple(0.1 * i for i in range(-9, 10)), 8: SYM_STEPS[8]}
WEIGHTED_ASYM_STEPS = {4: tuple(-0.9 + 0.05 * i for i in range(37)), 8: (0.0,)}


def importance_weights(x: torch.Tensor, k: int, importance: torch.Tensor, sigma2=None) -> torch.Tensor:
    """Each weight's share of the layer's output error, llama.cpp's imatrix rule (quantize_row_q4_*_impl):
    its input's mean squared activation (`importance` [G * g], zero past k) times sqrt(sigma^2 + w^2),
    sigma^2 the row's mean squared weight (over x's rows [R, G, g], or given: [R]). -> [R, G, g]."""
    sigma2 = x.square().sum(dim=(1, 2), keepdim=True) / k if sigma2 is None else sigma2.view(-1, 1, 1)
    return importance.view(1, x.shape[1], x.shape[2]) * torch.sqrt(sigma2 + x.square())


def quantize_group_rows(x: torch.Tensor, k: int, scheme: QuantScheme, importance=None, sigma2=None) -> tuple:
    """x [R, G, g] float32 (zero-padded past k) -> (integers as stored [R, G, g], float16 scales).
    importance: None (every weight's error counts alike), or each input's mean squared activation on
    calibration data, float32 [G * g] zero-padded past k (the error weighted by importance_weights, and
    the thorough candidate sets); sigma2: each row's mean squared weight [R] where x holds part of a row."""
    padded = x.shape[1] * x.shape[2] > k
    steps = (WEIGHTED_SYM_STEPS, WEIGHTED_ASYM_STEPS) if importance is not None else (SYM_STEPS, ASYM_STEPS)
    sym_steps, asym_steps = (s[scheme.bits] for s in steps)
    if importance is not None:  # (zero past k: the padding counts in no error)
        wt = importance_weights(x, k, importance, sigma2)
    elif padded and scheme.asym:  # the padding counts in no error (symmetric: a zero is exact anyway)
        wt = torch.ones(x.shape[1] * x.shape[2])
        wt[k:] = 0
        wt = wt.view(1, x.shape[1], x.shape[2]).expand_as(x).contiguous()
    else:
        wt = None
    lo, hi = x.amin(dim=2), x.amax(dim=2)
    if not scheme.asym:
        if scheme.bits == 4:  # GGUF Q4_0's rule: the value of largest magnitude maps to -8
            ref, qmin, qmax = torch.where(hi >= -lo, hi, lo) / -8.0, -8, 7
        else:
            ref, qmin, qmax = torch.maximum(hi, -lo) / 127.0, -127, 127
        d16 = _sym_search(x, wt, ref, qmin, qmax, sym_steps).half()
        q, _ = _nearest(x, None, d16, None, qmin, qmax)
        return (q.add_(8) if scheme.bits == 4 else q), d16
    levels = (1 << scheme.bits) - 1
    if padded:  # the range of the last group's weights, the padding left out (it is clipped as it may)
        real = k - (x.shape[1] - 1) * x.shape[2]
        lo[:, -1], hi[:, -1] = x[:, -1, :real].amin(dim=1), x[:, -1, :real].amax(dim=1)
    d, m = _asym_search(x, wt, lo, hi, levels, asym_steps)
    qmin, qmax, shift = (0, levels, 0) if scheme.bits == 4 else (-128, 127, 128)  # int8: stored q - 128
    old_d16, new_d16 = ((hi - lo) / levels).half(), d.half()
    # the offset stored absorbs the 128 steps of int8 (computed from the float16 scale, rounded once)
    old_m16 = (lo.double() + shift * old_d16.double()).half()
    new_m16 = (m.double() + shift * new_d16.double()).half()
    q, err = _nearest(x, wt, old_d16, old_m16, qmin, qmax)
    q_new, err_new = _nearest(x, wt, new_d16, new_m16, qmin, qmax)
    better = err_new < err  # ties keep the plain rule: data on its grid stays exact
    q[better] = q_new[better]
    scales = torch.stack([torch.where(better, new_d16, old_d16), torch.where(better, new_m16, old_m16)], dim=-1)
    return q, scales


def _group_sum(t: torch.Tensor) -> torch.Tensor:
    """[R, G, g] -> [R, G], the sum over each group (the same sums however the rows are chunked)."""
    return t.sum(dim=2)


def _nearest(x, wt, d16, m16, qmin, qmax) -> tuple:
    """The integers nearest to x [R, G, g] for the float16 scale d16 [R, G] (and offset m16), and each
    group's (weighted) squared error (asymmetric only). A zero scale gives integer 0: the offset (or 0)
    everywhere."""
    d = d16.float()[..., None]
    xm = x if m16 is None else x - m16.float()[..., None]
    q = torch.mul(xm, torch.where(d != 0, 1.0 / d, 0.0)).round_().clamp_(qmin, qmax)
    if m16 is None:
        return q, None
    r = torch.addcmul(xm, q, d, value=-1).square_()
    return q, _group_sum(r if wt is None else r.mul_(wt))


def _sym_search(x, wt, ref, qmin, qmax, steps) -> torch.Tensor:
    """The scale d [R, G] float32 of least error sum wt (x - d q)^2 over the candidates' integers q, each
    with its least-squares d = sum wt x q / sum wt q^2 (the error is then sum wt x^2 - d sum wt x q),
    then refitted on the best d's own nearest integers. wt None: every weight alike."""
    nmax = -qmin  # the plain rule maps ref * nmax to -nmax (int4: -8) or amax to 127 (int8)
    inv = torch.where(ref != 0, 1.0 / ref, 0.0)[..., None]
    y = x * inv  # x in steps of the plain rule
    wx = x if wt is None else wt * x
    best, best_d = torch.full_like(ref, -1.0), ref.clone()
    q, t = torch.empty_like(x), torch.empty_like(x)

    def fit():
        nonlocal best, best_d
        sumqx = _group_sum(torch.mul(q, wx, out=t))
        sumq2 = _group_sum(q.square_() if wt is None else q.square_().mul_(wt))
        d = sumqx / sumq2.clamp_min(1e-30)  # (a zero group: 0)
        score = d * sumqx
        best_d = torch.where(score > best, d, best_d)
        best = torch.maximum(score, best)

    for step in steps:
        torch.mul(y, (nmax + step) / nmax, out=q).round_().clamp_(qmin, qmax)
        fit()
    torch.mul(x, torch.where(best_d != 0, 1.0 / best_d, 0.0)[..., None], out=q).round_().clamp_(qmin, qmax)
    fit()
    return best_d


def _asym_search(x, wt, lo, hi, levels, steps) -> tuple:
    """(d, m) [R, G] float32 of least error sum wt (x - d q - m)^2: for each candidate's integers q
    (from the min / max start) the least-squares (d, m), then one refit on the best one's nearest
    integers. The sums are float64 from x - min (less cancellation)."""
    span = hi - lo
    xs = x - lo[..., None]
    y = xs * torch.where(span > 0, 1.0 / span, 0.0)[..., None]  # in [0, 1] (the padding may fall outside)
    wxs = xs if wt is None else wt * xs
    sw = torch.full_like(lo, x.shape[2], dtype=torch.float64) if wt is None else _group_sum(wt).double()
    sx, sxx = _group_sum(wxs).double(), _group_sum(wxs * xs).double()
    best = torch.full_like(sw, float("inf"))
    best_d, best_m = span / levels, torch.zeros_like(lo)
    q, t = torch.empty_like(x), torch.empty_like(x)

    def fit():
        nonlocal best, best_d, best_m
        sxq = _group_sum(torch.mul(q, wxs, out=t)).double()
        if wt is None:
            sq, sqq = _group_sum(q).double(), _group_sum(q.square_()).double()
        else:
            sq = _group_sum(torch.mul(q, wt, out=t)).double()
            sqq = _group_sum(t.mul_(q)).double()
        det = sw * sqq - sq * sq
        ok = det > 1e-9 * sw * sqq
        det = torch.where(ok, det, 1.0)
        d, m = (sw * sxq - sx * sq) / det, (sqq * sx - sq * sxq) / det
        err = sxx - d * sxq - m * sx  # (the least-squares residual is orthogonal to q and 1)
        take = ok & (err < best)
        best = torch.where(take, err, best)
        best_d, best_m = torch.where(take, d.float(), best_d), torch.where(take, m.float(), best_m)

    for step in steps:
        torch.mul(y, levels + step, out=q).round_().clamp_(0, levels)
        fit()
    torch.mul(xs - best_m[..., None], torch.where(best_d > 0, 1.0 / best_d, 0.0)[..., None], out=q)
    q.round_().clamp_(0, levels)
    fit()
    return best_d, best_m + lo
