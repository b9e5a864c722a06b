"""The packed group-32 kernels for a batched decode step (csrc/quant_dot.h's streaming and weight-stationary
VNNI orders, csrc/quant_gemm.h's panel GEMM, csrc/quant_amx.h's AMX-INT8 tiles and csrc/quant_amx_bf16.h's
AMX-BF16 tiles where the CPU has them), each forced through quant_gemv's `order`: the integer ones against a
dequantise-then-float64 reference with the activations rounded to int8 per block, the AMX-BF16 one with weights
and activations rounded to bfloat16 (and within those roundings of the exact product), for every group-32 format
(int4 / int8, symmetric / asymmetric: Q4_0, Q8_0, Q4_1 and the K-quants as loaded), K not a multiple of 32 or of
any chunk, 1..256 rows (partial tiles of every kernel), float32 and bfloat16 activations; batching invariance (a
row's bits do not depend on how many rows share the call) within each kernel; the default order, and
QuantLinear, up to GROUP32_MAX_ROWS rows without dequantising."""

import pytest
import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears import packed as ql
from servescope.quant import packed as qp
from servescope.quant.scheme import QuantScheme

G32 = [QuantScheme(b, 32, a) for b in (4, 8) for a in (False, True)]
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 256)
STREAM, TILED, AMX, AMX_BF16, GEMM = 1, 2, 3, 4, 5


def _ext():
    mod = cpu_ops.load()
    if mod is None:
        pytest.skip("CPU extension not built here")
    return mod


def _orders(mod) -> list:
    return [STREAM, TILED, GEMM] + ([AMX] if mod.isa().get("amx_int8") == "1" else [])


def _has_amx_bf16(mod) -> bool:
    return mod.isa().get("amx_bf16") == "1"


@pytest.mark.parametrize("scheme", G32, ids=str)
@pytest.mark.parametrize("n, k", [(37, 100), (20, 1000), (9, 31), (70, 600)])
def test_every_kernel_matches_float64_reference_at_every_row_count(scheme, n, k):
    mod = _ext()
    torch.manual_seed(3)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(max(ROWS), k)
    packed, scales = qp.quantize(w, scheme)
    kp = scheme.padded_k(k)
    ref_w = qp.dequantize(packed, scales, k, torch.float64)
    for order in _orders(mod):
        for dtype in (torch.float32, torch.bfloat16):
            xs = x.to(dtype)
            full = mod.quant_gemv(xs, packed, scales, b, order)
            xa, step = qp.gemv_activations(xs.float(), kp, 32)
            ref = xa @ ref_w.T + b.double()
            assert full.dtype == torch.float32 and full.shape == (len(x), n)
            assert torch.allclose(full.double(), ref, atol=1e-4, rtol=1e-5), (order, dtype)
            bound = step @ ref_w.abs().T + 1e-4 * (1 + ref.abs())  # within the activations' rounding
            assert torch.all((full.double() - (xs.double() @ ref_w.T + b.double())).abs() <= bound)
            for m in ROWS:  # the first m rows alone: the same bits (batching invariance), every tile remainder
                assert torch.equal(mod.quant_gemv(xs[:m], packed, scales, b, order), full[:m]), (order, m)


@pytest.mark.parametrize("scheme", G32, ids=str)
def test_bfloat16_activations_are_their_float32_values(scheme):
    """bfloat16 rows are rounded to int8 straight from bfloat16: the same bits as their float32 widening (12 rows:
    below the AMX-BF16 kernel's crossover, which order 0 takes for bfloat16 rows only; forced, it rounds float32
    rows to bfloat16, so it gives the same bits too)."""
    mod = _ext()
    torch.manual_seed(4)
    packed, scales = qp.quantize(torch.randn(40, 200), scheme)
    x = torch.randn(12, 200).bfloat16()
    for order in [0] + _orders(mod) + ([AMX_BF16] if _has_amx_bf16(mod) else []):
        assert torch.equal(mod.quant_gemv(x, packed, scales, torch.empty(0), order),
                           mod.quant_gemv(x.float(), packed, scales, torch.empty(0), order))


@pytest.mark.parametrize("scheme", G32, ids=str)
@pytest.mark.parametrize("n, k", [(37, 100), (20, 1000), (9, 31), (70, 600)])
def test_amx_bf16_kernel_is_bfloat16_weights_times_bfloat16_rows(scheme, n, k):
    """AMX-BF16: the dequantised weights rounded to bfloat16 (quant_dequantize_into's bits) times the rows
    rounded to bfloat16, summed in float32; within both roundings of the exact float64 product; each row's bits
    independent of the rows beside it (partial tiles, odd tile counts, K chunks and their remainders)."""
    mod = _ext()
    if not _has_amx_bf16(mod):
        pytest.skip("no AMX-BF16 here")
    torch.manual_seed(8)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(max(ROWS), k).bfloat16()
    packed, scales = qp.quantize(w, scheme)
    wb = torch.empty(n, k, dtype=torch.bfloat16)
    mod.quant_dequantize_into(packed, scales, 0, wb)
    full = mod.quant_gemv(x, packed, scales, b, AMX_BF16)
    ref = x.double() @ wb.double().T + b.double()
    assert torch.allclose(full.double(), ref, atol=1e-4, rtol=1e-5)
    exact_w = qp.dequantize(packed, scales, k, torch.float64)
    bound = (x.double().abs() @ exact_w.abs().T) / 2**8 + 1e-4
    assert torch.all((full.double() - (x.double() @ exact_w.T + b.double())).abs() <= bound)
    for m in ROWS:
        assert torch.equal(mod.quant_gemv(x[:m], packed, scales, b, AMX_BF16), full[:m]), m


def test_default_order_takes_amx_bf16_for_bfloat16_rows_from_its_crossover():
    """order 0 with bfloat16 rows: 4-bit weights on the integer kernels below the AMX-BF16 crossover and on
    AMX-BF16 from it; int8 weights (no crossover measured) and float32 rows never take it."""
    mod = _ext()
    if not _has_amx_bf16(mod):
        pytest.skip("no AMX-BF16 here")
    torch.manual_seed(9)
    for scheme in (QuantScheme(4, 32), QuantScheme(4, 32, True), QuantScheme(8, 32)):
        packed, scales = qp.quantize(torch.randn(48, 128), scheme)
        x = torch.randn(80, 128).bfloat16()
        bf16_bits = [torch.equal(mod.quant_gemv(x[:m], packed, scales, torch.empty(0)),
                                 mod.quant_gemv(x[:m], packed, scales, torch.empty(0), AMX_BF16))
                     for m in range(1, len(x) + 1)]
        if scheme.bits == 8:
            assert not any(bf16_bits), scheme
            continue
        first = bf16_bits.index(True) + 1
        assert 1 < first <= 64 and all(bf16_bits[first - 1:]), (scheme, first)
        xf = x.float()
        assert not torch.equal(mod.quant_gemv(xf, packed, scales, torch.empty(0)),
                               mod.quant_gemv(xf, packed, scales, torch.empty(0), AMX_BF16))


def test_the_streaming_and_tiled_orders_give_the_same_bits():
    """The two VNNI orders do the same arithmetic per (row, weight row) in the same order."""
    mod = _ext()
    torch.manual_seed(5)
    for scheme in G32:
        packed, scales = qp.quantize(torch.randn(70, 300), scheme)
        x = torch.randn(13, 300)
        assert torch.equal(mod.quant_gemv(x, packed, scales, torch.empty(0), STREAM),
                           mod.quant_gemv(x, packed, scales, torch.empty(0), TILED))


def test_default_order_agrees_with_each_row_alone():
    """order 0 picks a kernel by rows: across kernels a row's result agrees to float32 summation order."""
    mod = _ext()
    torch.manual_seed(6)
    packed, scales = qp.quantize(torch.randn(50, 256), QuantScheme(4, 32))
    x = torch.randn(40, 256)
    alone = torch.cat([mod.quant_gemv(x[i:i + 1], packed, scales, torch.empty(0)) for i in range(len(x))])
    for m in (2, 8, 16, 40):
        y = mod.quant_gemv(x[:m], packed, scales, torch.empty(0))
        assert torch.allclose(y, alone[:m], atol=1e-4, rtol=1e-5)


def test_default_order_takes_the_panel_gemm_from_its_crossover():
    """Where no AMX runs, order 0 gives the VNNI orders' bits below the panel GEMM's crossover (isa()'s qgemm_rows,
    int4 / int8) and the GEMM's from it; a build without a crossover ("-") never takes it."""
    mod = _ext()
    info = mod.isa()
    if info.get("amx_int8") == "1":
        pytest.skip("AMX-INT8 takes these rows here")
    torch.manual_seed(10)
    crossover = dict(zip((4, 8), map(int, info["qgemm_rows"].split("/")))) if info["qgemm_rows"] != "-" else {}
    for scheme in (QuantScheme(4, 32), QuantScheme(4, 32, True), QuantScheme(8, 32)):
        packed, scales = qp.quantize(torch.randn(70, 160), scheme)
        x = torch.randn(12, 160)
        for m in range(1, len(x) + 1):
            takes_gemm = scheme.bits in crossover and m >= crossover[scheme.bits]
            expected = GEMM if takes_gemm else TILED if m > 1 else STREAM
            auto = mod.quant_gemv(x[:m], packed, scales, torch.empty(0))
            assert torch.equal(auto, mod.quant_gemv(x[:m], packed, scales, torch.empty(0), expected)), (scheme, m)
            if takes_gemm:  # the kernels' float sums differ in order: the switch is seen in the bits
                assert not torch.equal(auto, mod.quant_gemv(x[:m], packed, scales, torch.empty(0), TILED))


@pytest.mark.parametrize("asym", [False, True])
def test_panel_gemm_full_panels_match_the_vnni_order(asym):
    """The panel GEMM's vector re-layout (whole panels of 32 columns; K in 64-byte chunks and 16-block scale
    chunks, with their partial last ones) against the weight-stationary VNNI order, int4 and int8, at the 1B
    shape's widths and odd ones."""
    mod = _ext()
    torch.manual_seed(11)
    for bits in (4, 8):
        for n, k in ((64, 2048), (96, 1000), (128, 608)):
            packed, scales = qp.quantize(torch.randn(n, k), QuantScheme(bits, 32, asym))
            x = torch.randn(9, k)
            a = mod.quant_gemv(x, packed, scales, torch.empty(0), GEMM)
            b = mod.quant_gemv(x, packed, scales, torch.empty(0), TILED)
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (bits, n, k)


def test_bad_orders_are_refused():
    mod = _ext()
    packed, scales = qp.quantize(torch.randn(8, 64), QuantScheme(4, 32))
    with pytest.raises(RuntimeError, match="order"):
        mod.quant_gemv(torch.randn(2, 64), packed, scales, torch.empty(0), 6)
    g64 = qp.quantize(torch.randn(8, 128), QuantScheme(4, 64))
    with pytest.raises(RuntimeError, match="panel GEMM"):
        mod.quant_gemv(torch.randn(2, 128), *g64, torch.empty(0), GEMM)
    with pytest.raises(RuntimeError, match="AMX"):
        mod.quant_gemv(torch.randn(2, 128), *g64, torch.empty(0), AMX)
    with pytest.raises(RuntimeError, match="AMX-BF16"):
        mod.quant_gemv(torch.randn(2, 128), *g64, torch.empty(0), AMX_BF16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_keeps_group32_batches_on_the_integer_kernels(dtype, monkeypatch):
    """Up to group32_max_rows(dtype) rows (300 where that is unlimited) QuantLinear calls quant_gemv (never the
    dequantising path) and the plan is told the same limit; other groups stop at MAX_ROWS."""
    _ext()
    torch.manual_seed(7)
    lin = torch.nn.Linear(96, 24, bias=True)
    q = ql.QuantLinear.from_linear(lin, QuantScheme(4, 32))
    limit = ql.group32_max_rows(dtype)
    assert q.row_limit(dtype) == limit and q.plan_entry(dtype)[1:] == ((limit, 0), limit)
    assert ql.QuantLinear.from_linear(lin, QuantScheme(4, 64)).row_limit(dtype) == ql.MAX_ROWS
    monkeypatch.setattr(ql.QuantLinear, "_prefill", lambda *a: pytest.fail("dequantised a decode batch"))
    x = torch.randn(min(limit, 300), 96).to(dtype)
    xa = qp.gemv_activations(x.float(), 96, 32)[0]
    ref = xa @ qp.dequantize(q.qweight, q.scales, 96, torch.float64).T + lin.bias.double()
    y = q(x)
    assert y.dtype == dtype
    assert torch.allclose(y.double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)


@pytest.mark.parametrize("amx_bf16, panel_gemm", [(True, False), (False, False), (False, True)])
def test_group32_row_limit_by_dtype_and_cpu(amx_bf16, panel_gemm, monkeypatch):
    """bfloat16 activations on a CPU whose bfloat16 GEMM runs on AMX tiles leave quant_gemv past
    GROUP32_MAX_ROWS_BF16_AMX rows (dequantise + oneDNN measured faster there); where the kernels take their integer
    panel GEMM instead they never leave it (a prefill chunk included); float32 activations, and bfloat16
    elsewhere, stay on it up to GROUP32_MAX_ROWS; a module's fixed gemv_rows overrides all."""
    _ext()
    monkeypatch.setattr(ql, "_BF16_ON_AMX", amx_bf16)
    monkeypatch.setattr(ql, "panel_gemm_takes_rows", lambda: panel_gemm)
    if panel_gemm:
        assert ql.group32_max_rows(torch.bfloat16) == ql.GROUP32_MAX_ROWS_GEMM
        assert ql.group32_max_rows(torch.float32) == ql.GROUP32_MAX_ROWS
        return
    bf16_limit = ql.GROUP32_MAX_ROWS_BF16_AMX if amx_bf16 else ql.GROUP32_MAX_ROWS
    assert ql.group32_max_rows(torch.bfloat16) == bf16_limit
    assert ql.group32_max_rows(torch.float32) == ql.GROUP32_MAX_ROWS
    torch.manual_seed(3)
    q = ql.QuantLinear.from_linear(torch.nn.Linear(64, 16, bias=False), QuantScheme(4, 32))
    calls = []
    monkeypatch.setattr(ql.QuantLinear, "_prefill",
                        lambda self, m, x: calls.append(len(x)) or torch.zeros(len(x), 16))
    for rows in (bf16_limit, bf16_limit + 1):
        calls.clear()
        q(torch.randn(rows, 64).bfloat16())
        assert calls == ([] if rows <= bf16_limit else [rows]), (rows, calls)
    q.gemv_rows = 10**9
    calls.clear()
    q(torch.randn(bf16_limit + 1, 64).bfloat16())
    assert calls == [] and q.plan_entry(torch.bfloat16)[2] == 10**9
