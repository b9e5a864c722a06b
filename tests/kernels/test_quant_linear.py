"""Packed 4- and 8-bit weights (quant/packed.py, model/linears/packed.py, csrc/quant_dot.h,
csrc/quant_gemv.h): the quantiser's round trip and its scale search (against the plain rule it replaced;
edge groups; Q4_1 data back exactly), the C++ GEMV and dequantisation against a dequantise-then-float64
reference (odd shapes, K not a multiple of the group, bias; for group 32 with the activations rounded to
int8 per block as the kernel does, and within that rounding's bound of the exact product), and the
module's decode / prefill paths."""

import numpy as np
import pytest
import torch

from servescope.errors import InvalidParameterError
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears import packed as ql
from servescope.model.linears.huge_pages import HUGE_PAGE, move_to_huge_pages
from servescope.model.quantize import parse_mode
from servescope.quant import packed as qp
from servescope.quant.scheme import QuantScheme

SCHEMES = [QuantScheme(b, g, a) for b in (4, 8) for g in (32, 64, 128, None) for a in (False, True)]
SHAPES = [(7, 100, 1), (33, 96, 3), (64, 576, 5), (5, 31, 2), (9, 160, 8)]  # (N, K, M)


def _ext():
    mod = cpu_ops.load()
    if mod is None:
        pytest.skip("CPU extension not built here")
    return mod


def _grid_ends(scales, scheme, kp):
    """The smallest and largest value each element's group can store, [N, Kp] float64."""
    g = scheme.group or kp
    if scheme.asym:
        d, m = scales[..., 0].double(), scales[..., 1].double()
        lo, hi = (m, m + 15 * d) if scheme.bits == 4 else (m - 128 * d, m + 127 * d)
    else:
        d = scales.double()
        lo, hi = (-8 * d, 7 * d) if scheme.bits == 4 else (-127 * d, 127 * d)
        lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)
    return lo.repeat_interleave(g, dim=1), hi.repeat_interleave(g, dim=1)


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_round_trip_nearest_for_the_stored_scale(scheme):
    """Each weight comes back as the nearest value of its group's stored grid: within half a step of it
    where it lies inside the grid, the grid's end where the chosen scale clips it (the search may clip
    a few outliers for finer steps elsewhere)."""
    torch.manual_seed(0)
    w = torch.randn(24, 200) * torch.linspace(0.01, 3, 24)[:, None]
    packed, scales = qp.quantize(w, scheme)
    kp = scheme.padded_k(200)
    assert packed.shape == (24, kp // 2 if scheme.bits == 4 else kp)
    assert scales.dtype == torch.float16 and scales.shape[:2] == (24, kp // (scheme.group or kp))
    back = qp.dequantize(packed, scales, 200, torch.float64)
    d = scales[..., 0] if scheme.asym else scales
    step = d.double().abs().repeat_interleave(scheme.group or kp, dim=1)[:, :200]
    lo, hi = (t[:, :200] for t in _grid_ends(scales, scheme, kp))
    target = torch.minimum(torch.maximum(w.double(), lo), hi)
    assert torch.all((back - target).abs() <= step / 2 * (1 + 1e-6) + 1e-7)
    # the clipping is rare and small: at most a few steps, in a few percent of the weights
    clipped = (w.double() - target).abs() > 0
    assert clipped.float().mean() < 0.06
    assert torch.all((back - w.double()).abs() <= 3 * step + 1e-7)


def _plain_rule(w: torch.Tensor, scheme) -> torch.Tensor:
    """The dequantised weights of the rule before the search (the reference the search must beat):
    symmetric int4 maps the value of largest magnitude to -8 (Q4_0), int8 uses amax / 127, asymmetric
    min / max; float16 scales, the integers rounded against the float16 scale."""
    n, k = w.shape
    kp = scheme.padded_k(k)
    g = scheme.group or kp
    x = torch.nn.functional.pad(w.double(), (0, kp - k)).view(n, kp // g, g)
    if scheme.asym:
        levels = (1 << scheme.bits) - 1
        lo, hi = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
        d = ((hi - lo) / levels).half().double()
        q = torch.round((x - lo) / torch.where(d > 0, d, 1.0)).clamp(0, levels)
        back = q * d + lo.half().double()
    else:
        if scheme.bits == 4:
            top = x.gather(2, x.abs().argmax(dim=2, keepdim=True))
            d, qmin, qmax = (top / -8).half().double(), -8, 7
        else:
            d, qmin, qmax = (x.abs().amax(dim=2, keepdim=True) / 127).half().double(), -127, 127
        back = torch.round(x / torch.where(d != 0, d, 1.0)).clamp(qmin, qmax) * d
    return back.view(n, kp)[:, :k]


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32), QuantScheme(4, 128, True), QuantScheme(4, 64, True),
                                    QuantScheme(8, 32), QuantScheme(8, None), QuantScheme(8, 128, True)], ids=str)
@pytest.mark.parametrize("dist", ["gaussian", "student-t3"])
def test_search_beats_the_plain_rule(scheme, dist):
    """The searched scales give a lower squared error than the plain rule on seeded Gaussian and
    heavy-tailed (Student-t, 3 degrees of freedom) weights, K = 576 (SmolLM2's) and K = 200 (padded)."""
    gen = torch.Generator().manual_seed(7)
    # 4 bits: 7-19% less error; 8 bits: 4-11% less in groups of 32-128 (asymmetric: the plain rule's
    # integers refitted only), about 1-3% with one scale per row
    bound = 0.95 if scheme.bits == 4 else 0.99 if scheme.group else 0.999
    for k in (576, 200):
        w = torch.randn(64, k, generator=gen)
        if dist == "student-t3":  # t = z / sqrt(chi2_3 / 3)
            chi2 = torch.randn(64, k, 3, generator=gen).square().sum(dim=2)
            w = w / (chi2 / 3).sqrt()
        ours = qp.dequantize(*qp.quantize(w, scheme), k, torch.float64)
        err, err_plain = (ours - w.double()).square().sum(), (_plain_rule(w, scheme) - w.double()).square().sum()
        assert err < bound * err_plain, (k, (err / err_plain).item())


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32), QuantScheme(4, 32, True), QuantScheme(8, 32),
                                    QuantScheme(4, 128, True)], ids=str)
def test_importance_weighted_search_lowers_the_weighted_error(scheme):
    """With each input's mean squared activation (llama.cpp's imatrix, skewed like a transformer's: a few
    channels 10-100x the rest), the search lowers the error that reaches the output, sum over rows of
    importance * (w - q)^2, against the unweighted search, on K = 576 and K = 200 (padded); the packed
    form is the same."""
    gen = torch.Generator().manual_seed(11)
    for k in (576, 200):
        w = torch.randn(64, k, generator=gen)
        imp = torch.rand(k, generator=gen) ** 4
        imp[torch.randperm(k, generator=gen)[:6]] *= 100
        q, s = qp.quantize(w, scheme, importance=imp)
        q0, s0 = qp.quantize(w, scheme)
        assert q.shape == q0.shape and q.dtype == q0.dtype and s.shape == s0.shape and s.dtype == torch.float16
        err = ((qp.dequantize(q, s, k, torch.float64) - w.double()).square() * imp.double()).sum()
        err0 = ((qp.dequantize(q0, s0, k, torch.float64) - w.double()).square() * imp.double()).sum()
        assert err < 0.75 * err0, (k, (err / err0).item())  # measured 0.30-0.58


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_search_edge_groups(scheme):
    """Zero, constant and all-negative groups, and K not a multiple of the group (zero padding): finite
    scales, zeros back as zeros, a constant back as its float16 value (asymmetric) or within float16
    rounding of it, and never a larger error than the plain rule's (but for float16 rounding)."""
    k = 100  # pads every group size
    w = torch.randn(6, k)
    w[0] = 0
    w[1] = 0.37
    w[2] = -(w[2].abs() + 0.05)
    w[3, :40] = 0  # a zero group inside a row (the first 32 or more)
    w[4, 1::2] = -2.5  # two values only
    w[5] = torch.linspace(-1, 3, k)
    packed, scales = qp.quantize(w, scheme)
    assert torch.isfinite(scales.float()).all()
    back = qp.dequantize(packed, scales, k, torch.float64)
    assert torch.equal(back[0], torch.zeros(k, dtype=torch.float64))
    assert torch.allclose(back[1], torch.full((k,), 0.37, dtype=torch.float64), rtol=2e-3, atol=0)
    if scheme.asym:
        assert torch.equal(back[1], torch.full((k,), 0.37, dtype=torch.float16).double())
    if scheme.group == 32:
        assert torch.equal(back[3, :32], torch.zeros(32, dtype=torch.float64))
    assert torch.all(back[2] <= 1e-6)  # all negative stays non-positive
    err = (back - w.double()).square().sum(dim=1)
    err_plain = (_plain_rule(w, scheme) - w.double()).square().sum(dim=1)
    fp16 = 2.0 ** -22 * w.double().square().sum(dim=1)  # float16 rounding of the scale or offset alone
    assert torch.all(err <= err_plain * (1 + 1e-3) + fp16), (err, err_plain)


def test_q4_1_data_comes_back_exactly():
    """Weights already on a Q4_1 grid (a GGUF's blocks, dequantised by gguf-py) quantised again as
    int4-g32-asym give the very same values and the file's own blocks: the search keeps an exact fit."""
    gguf = pytest.importorskip("gguf")
    from servescope.loader import gguf_packed

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 576)) * rng.uniform(0.01, 2, (40, 1))).astype(np.float32)
    w[:, 64:96] += 3  # a group far from zero
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(40, 576)
    packed, scales = qp.quantize(torch.from_numpy(ref), QuantScheme(4, 32, True))
    assert torch.equal(qp.dequantize(packed, scales, 576), torch.from_numpy(ref))
    file_packed, file_scales = gguf_packed.split_blocks(raw, gguf.GGMLQuantizationType.Q4_1, 40, 576)
    assert torch.equal(packed, file_packed) and torch.equal(scales, file_scales)


def test_search_chunks_do_not_change_the_result(monkeypatch):
    """Rows go through the search in chunks of SEARCH_ELEMENTS weights; any chunking gives the same bytes."""
    torch.manual_seed(8)
    w = torch.randn(37, 200)
    for scheme in (QuantScheme(4, 32), QuantScheme(4, 128, True), QuantScheme(8, None)):
        whole = qp.quantize(w, scheme)
        monkeypatch.setattr(qp, "SEARCH_ELEMENTS", 3 * 256)  # 3 rows at a time, the last chunk shorter
        chunked = qp.quantize(w, scheme)
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_gemv_and_dequantize_match_float64_reference(scheme):
    mod = _ext()
    torch.manual_seed(1)
    for n, k, m in SHAPES:
        w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
        packed, scales = qp.quantize(w, scheme)
        kp = scheme.padded_k(k)
        ref_w = qp.dequantize(packed, scales, k, torch.float64)
        xa, step = qp.gemv_activations(x, kp, kp // scales.shape[1])
        ref = xa @ ref_w.T + b.double()
        y = mod.quant_gemv(x, packed, scales, b)
        assert y.shape == (m, n)
        assert torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-5), (n, k, m)
        # against the exact float product: within the activations' rounding (zero on the float path)
        bound = step @ ref_w.abs().T + 1e-4 * (1 + ref.abs())
        assert torch.all((y.double() - (x.double() @ ref_w.T + b.double())).abs() <= bound), (n, k, m)
        assert torch.allclose(mod.quant_dequantize(packed, scales, k).double(), ref_w, atol=1e-6)
        y0 = mod.quant_gemv(x, packed, scales, torch.empty(0))
        assert torch.allclose(y0.double(), ref - b.double(), atol=1e-4, rtol=1e-5)


def _one_hot_packed(bits: int, asym: bool, k: int) -> tuple:
    """The identity [k, k] in the packed group-32 form, scale 1 (offset 0), built from its integers."""
    eye = torch.eye(k, dtype=torch.int16)
    if bits == 4:
        packed = qp.pack_nibbles((eye if asym else eye + 8).to(torch.uint8))  # symmetric: d * (u - 8)
    else:
        packed = eye.to(torch.int8)
    scales = torch.ones(k, k // 32, *((2,) if asym else ()), dtype=torch.float16)
    if asym:
        scales[..., 1] = 0
    return packed, scales


@pytest.mark.parametrize("bits, asym", [(4, False), (4, True), (8, False), (8, True)])
def test_gemv_rounds_activation_ties_to_even(bits, asym):
    """One-hot weights make y the GEMV's int8 activations times their block scale: ties x / d = k + 1/2
    go to the even k (the rounding gemv_activations models), a zero block gives zeros, not NaN."""
    mod = _ext()
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 127.0])  # amax 127: d = 1 exactly
    x = torch.cat([ties.repeat(4), torch.zeros(32), 2 * ties.repeat(4)])[None]  # blocks: d = 1, zero, d = 2
    expect = torch.tensor([0.0, 2, 2, 0, -2, -2, 4, 127])
    expect = torch.cat([expect.repeat(4), torch.zeros(32), 2 * expect.repeat(4)])[None]
    packed, scales = _one_hot_packed(bits, asym, 96)
    assert torch.equal(qp.dequantize(packed, scales, 96), torch.eye(96))
    assert torch.equal(mod.quant_gemv(x, packed, scales, torch.empty(0)), expect)
    assert torch.equal(qp.gemv_activations(x, 96, 32)[0].float(), expect)  # the tests' reference agrees


G32 = [s for s in SCHEMES if s.group == 32]


@pytest.mark.parametrize("scheme", G32, ids=str)
def test_integer_gemm_matches_float64_reference_and_the_gemv(scheme):
    """The prefill GEMM of group-32 weights (csrc/quant_gemm.h): the dequantised weight times the
    activations rounded to int8 per block, as the GEMV computes them, for odd N (a partial panel of
    columns), K not a whole block, 1..70 rows (partial row tiles), with and without bias; and each row's
    result is the GEMV's for that row alone, up to float32 summation order."""
    mod = _ext()
    torch.manual_seed(11)
    for n, k, m in ((7, 100, 9), (33, 96, 13), (64, 576, 70), (5, 31, 2), (45, 160, 1), (100, 1536, 17)):
        w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
        packed, scales = qp.quantize(w, scheme)
        kp = scheme.padded_k(k)
        ref_w = qp.dequantize(packed, scales, k, torch.float64)
        xa, step = qp.gemv_activations(x, kp, 32)
        ref = xa @ ref_w.T + b.double()
        y = mod.quant_gemm(x, packed, scales, b)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-5), (n, k, m)
        bound = step @ ref_w.abs().T + 1e-4 * (1 + ref.abs())  # within the activations' rounding of exact
        assert torch.all((y.double() - (x.double() @ ref_w.T + b.double())).abs() <= bound), (n, k, m)
        y0 = mod.quant_gemm(x, packed, scales, torch.empty(0))
        assert torch.allclose(y0.double(), ref - b.double(), atol=1e-4, rtol=1e-5)
        gemv = torch.cat([mod.quant_gemv(x[i:i + 1], packed, scales, b) for i in range(m)])
        assert torch.allclose(y, gemv, atol=1e-4, rtol=1e-5)
        assert torch.equal(mod.quant_gemm(x, packed, scales, b), y)  # the reused buffers leave no trace


def test_integer_gemm_rejects_other_groups_and_shapes():
    mod = _ext()
    packed, scales = qp.quantize(torch.randn(8, 128), QuantScheme(4, 64))
    with pytest.raises(RuntimeError, match="group-32"):
        mod.quant_gemm(torch.randn(9, 128), packed, scales, torch.empty(0))
    packed, scales = qp.quantize(torch.randn(8, 64), QuantScheme(4, 32))
    with pytest.raises(RuntimeError, match="packed K"):
        mod.quant_gemm(torch.randn(9, 128), packed, scales, torch.empty(0))
    with pytest.raises(RuntimeError, match="bias"):
        mod.quant_gemm(torch.randn(9, 64), packed, scales, torch.randn(7))


@pytest.mark.parametrize("rows", [1, 4, ql.MAX_ROWS + 5])  # the GEMV, and the integer GEMM
def test_quant_linear_module_paths(rows):
    torch.manual_seed(2)
    lin = torch.nn.Linear(100, 40, bias=True)
    q = ql.QuantLinear.from_linear(lin, QuantScheme(4, 32, True))
    x = torch.randn(rows, 100)
    xa = qp.gemv_activations(x, 128, 32)[0]  # both round the activations to int8 per block
    ref = xa @ qp.dequantize(q.qweight, q.scales, 100, torch.float64).T + lin.bias.double()
    assert torch.allclose(q(x).double(), ref, atol=1e-4, rtol=1e-5)
    assert torch.allclose(q(x.view(1, rows, 100)).view(rows, 40).double(), ref, atol=1e-4, rtol=1e-5)
    assert q.weight_bytes() < lin.weight.numel()  # under one byte per weight


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_dequantize_into_rows_in_float32_and_bfloat16(scheme):
    """The prefill path's dequantisation: any run of rows, K not a whole block, written straight in
    float32 (exactly the reference's values) or bfloat16 (those values rounded once, as torch rounds)."""
    mod = _ext()
    torch.manual_seed(3)
    for n, k in ((7, 100), (40, 576), (5, 31), (33, 160)):
        packed, scales = qp.quantize(torch.randn(n, k), scheme)
        ref = qp.dequantize(packed, scales, k, torch.float64)
        for dtype in (torch.float32, torch.bfloat16):
            for r0, rows in ((0, n), (1, n - 1), (n // 2, 1)):
                out = torch.full((rows, k), 7.0, dtype=dtype)
                mod.quant_dequantize_into(packed, scales, r0, out)
                assert torch.equal(out, ref[r0:r0 + rows].float().to(dtype)), (n, k, dtype, r0)


def test_dequantize_into_rejects_bad_outputs():
    mod = _ext()
    packed, scales = qp.quantize(torch.randn(8, 64), QuantScheme(4, 32))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        mod.quant_dequantize_into(packed, scales, 0, torch.empty(8, 64, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="rows past"):
        mod.quant_dequantize_into(packed, scales, 4, torch.empty(5, 64))
    with pytest.raises(RuntimeError, match="packed K"):
        mod.quant_dequantize_into(packed, scales, 0, torch.empty(8, 20))
    with pytest.raises(RuntimeError, match="contiguous"):
        mod.quant_dequantize_into(packed, scales, 0, torch.empty(64, 8).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [None, 7 * 100, 40 * 100 + 1])  # one piece; row tiles, the last partial
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "F.linear"])
def test_prefill_path_tiles_dtypes_and_bias(dtype, tile, onednn, monkeypatch):
    """Above the module's GEMV rows (MAX_ROWS; GROUP32_MAX_ROWS for group 32): the weight dequantised in
    row tiles into the reused scratch buffer and multiplied in the activation dtype (bias included),
    against the float64 product of the same dequantised weights; bfloat16 within its rounding of the
    inputs and of the output."""
    _ext()
    if tile is not None:
        monkeypatch.setattr(ql, "TILE_ELEMENTS", tile)
    monkeypatch.setattr(ql, "_ONEDNN", {} if onednn else {torch.float32: False, torch.bfloat16: False})
    # (a CPU whose kernels run bfloat16 rows on the integer panel GEMM never takes this path: test_quant_rows.py)
    monkeypatch.setattr(ql, "panel_gemm_takes_rows", lambda: False)
    torch.manual_seed(4)
    lin = torch.nn.Linear(100, 45, bias=True).to(dtype)
    # (float32 group-32 weights take the integer GEMM instead: the test above)
    first = QuantScheme(4, 32) if dtype == torch.bfloat16 else QuantScheme(4, 64)
    for scheme in (first, QuantScheme(8, 64, True)):
        q = ql.QuantLinear.from_linear(lin, scheme)
        m = q.row_limit(dtype) // 3 + 1  # 3 * m rows: just past the GEMV's
        x = torch.randn(3, m, 100).to(dtype)
        w = qp.dequantize(q.qweight, q.scales, 100, torch.float64)
        if dtype == torch.bfloat16:
            w = w.to(dtype).double()
        ref = x.double() @ w.T + lin.bias.double()
        y = q(x)
        assert y.dtype == dtype and y.shape == (3, m, 45)
        tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
        assert torch.allclose(y.double(), ref, **tol)
        assert torch.equal(q(x), y)  # the reused buffer leaves no trace in the next call


def test_gemv_rejects_mismatched_shapes():
    mod = _ext()
    packed, scales = qp.quantize(torch.randn(8, 64), QuantScheme(4, 32))
    with pytest.raises(RuntimeError, match="quant_gemv"):
        mod.quant_gemv(torch.randn(1, 128), packed, scales, torch.empty(0))
    with pytest.raises(RuntimeError, match="scales"):
        mod.quant_gemv(torch.randn(1, 64), packed, scales.float(), torch.empty(0)[:0].half())


def test_quant_embedding_reads_packed_rows():
    w = torch.randn(50, 40)
    packed, scales = qp.quantize(w, QuantScheme(8, 32))
    emb = ql.QuantEmbedding(packed, scales, 40, torch.float32)
    ids = torch.tensor([[3, 0], [49, 3]])
    ref = qp.dequantize(packed, scales, 40)[ids]
    assert torch.equal(emb(ids), ref)


def test_mode_strings():
    assert parse_mode("int8") == "int8"
    assert parse_mode("int4") == QuantScheme(4, 32, False)
    assert parse_mode("int4-g128-asym") == QuantScheme(4, 128, True)
    assert parse_mode("int8-ch") == QuantScheme(8, None, False)
    for bad in ("int3", "int4-g48", "int4-asym-g32", "fp4", "int4-g32-sym-x"):
        with pytest.raises(InvalidParameterError, match="unknown quantization"):
            parse_mode(bad)


def _thp_eligible(ptr: int):
    """THPeligible of the mapping holding address ptr (/proc/self/smaps), None where the kernel does not say."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


def test_move_to_huge_pages_keeps_values_order_and_sharing():
    torch.manual_seed(5)
    lins = [ql.QuantLinear.from_linear(torch.nn.Linear(k, n), QuantScheme(b, 32)) for n, k, b in
            ((40, 100, 4), (7, 64, 8), (33, 96, 4))]
    emb = ql.QuantEmbedding(lins[2].qweight, lins[2].scales, 96, torch.float32)  # tied to the last one
    x, ids = torch.randn(ql.MAX_ROWS + 3, 100), torch.tensor([0, 32, 5])
    before = [lins[0](x[:1]), lins[0](x), emb(ids)]
    old = [(m.qweight.clone(), m.scales.clone()) for m in lins]
    moved = move_to_huge_pages(lins + [emb])
    if moved == 0:
        pytest.skip("no MADV_HUGEPAGE here")
    for m, (w, s) in zip(lins, old):
        assert torch.equal(m.qweight, w) and torch.equal(m.scales, s)
    assert emb.qweight is lins[2].qweight and emb.scales is lins[2].scales
    ptrs = [t.data_ptr() for m in lins for t in (m.qweight, m.scales)]
    assert ptrs == sorted(ptrs) and ptrs[0] % HUGE_PAGE == 0  # in read order, from a huge-page boundary
    assert len({m.qweight.untyped_storage().data_ptr() for m in lins}) == 1  # one mapping
    assert moved >= sum(m.weight_bytes() for m in lins)
    assert [torch.equal(a, b) for a, b in zip(before, [lins[0](x[:1]), lins[0](x), emb(ids)])] == [True] * 3
    thp_mode = "/sys/kernel/mm/transparent_hugepage/enabled"
    if _thp_eligible(ptrs[0]) is not None and "[never]" not in open(thp_mode).read():
        assert _thp_eligible(ptrs[0])


def test_move_to_huge_pages_leaves_nothing_to_move_alone():
    assert move_to_huge_pages([]) == 0
