"""Packed weights kept in the CPU kernels' panel layout (csrc/quant_kept.h; model/linears/packed.py's to_panels,
QuantLinear.keep_panels, model/quantize.keep_panels): the layout is the same bytes permuted (to_panels undone
gives them back), the kernel over it gives quant_gemm.h's re-laid panels' bits at every row count (and a row's
bits do not depend on the rows beside it), QuantLinear / QuantEmbedding over it give their row layout's results,
the model pass lays out what it may and leaves the rest, and what cannot read the layout refuses it clearly.
The kernel on every x86 path and its absence elsewhere: packed_check.cpp (tests/kernels/test_quant_gemv_isas.py)."""

import pytest
import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears import packed as ql
from servescope.quant import packed as qp
from servescope.quant.scheme import QuantScheme

G32 = [QuantScheme(b, 32, a) for b in (4, 8) for a in (False, True)]
GEMM = 5


def _panel():
    rows = ql.kept_panel()
    if not rows:
        pytest.skip("this CPU's kernels keep no panels (AMX, NEON, scalar, or no extension)")
    return cpu_ops.load(), rows


@pytest.mark.parametrize("scheme", G32, ids=str)
def test_panels_are_the_same_bytes_permuted(scheme):
    w = torch.randn(64, 96)
    q, s = qp.quantize(w, scheme)
    kq, ks = ql.to_panels(q, s, 16)
    assert kq.shape == (4, q.shape[1] // 4, 16, 4) and ks.shape[0] == 4 and ks.shape[-1] == 16
    assert sorted(kq.flatten().tolist()) == sorted(q.flatten().tolist())
    back = ql.from_panels(kq, ks)
    assert torch.equal(back[0], q) and torch.equal(back[1], s)
    # row 21 = panel 1, column 5: its dword run and scales
    assert torch.equal(kq[1, :, 5, :].reshape(-1), q[21])
    assert torch.equal(ks[1, :, 5] if s.dim() == 2 else ks[1, :, :, 5], s[21])


@pytest.mark.parametrize("scheme", G32, ids=str)
def test_kept_kernel_gives_the_relaid_gemms_bits_at_every_row_count(scheme):
    mod, rows = _panel()
    torch.manual_seed(1)
    n, k = 3 * rows, 200  # K not a whole number of blocks: padded
    q, s = qp.quantize(torch.randn(n, k), scheme)
    kq, ks = ql.to_panels(q, s, rows)
    bias = torch.randn(n)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(17, k).to(dtype)
        full = mod.quant_gemv(x, kq, ks, bias, 0)
        assert torch.equal(full, mod.quant_gemv(x, q, s, bias, GEMM))
        assert torch.equal(mod.quant_gemv(x, kq, ks, bias, GEMM), full)
        if dtype == torch.float32:  # the prefill entry reads them too
            assert torch.equal(mod.quant_gemm(x, kq, ks, bias), full)
        for m in (1, 2, 3, 4, 5, 8, 9):
            assert torch.equal(mod.quant_gemv(x[:m], kq, ks, bias, 0), full[:m]), (dtype, m)
        assert torch.equal(mod.quant_gemv(x[5:6], kq, ks, bias, 0), full[5:6])
        # and the values: the float64 product with the activations on their int8 grid
        ref = qp.gemv_activations(x.float(), scheme.padded_k(k), 32)[0] @ qp.dequantize(q, s, k, torch.float64).T
        assert torch.allclose(full.double(), ref + bias.double(), atol=1e-4, rtol=1e-5)


def test_what_cannot_read_kept_panels_refuses_them():
    mod, rows = _panel()
    q, s = qp.quantize(torch.randn(2 * rows, 64), QuantScheme(4, 32, False))
    kq, ks = ql.to_panels(q, s, rows)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="kept panels run the panel GEMM"):
        mod.quant_gemv(x, kq, ks, torch.empty(0), 1)
    with pytest.raises(RuntimeError, match="kept panels"):
        mod.quant_dequantize_into(kq, ks, 0, torch.empty(rows, 64))
    wrong = ql.to_panels(q, s, rows // 2)
    with pytest.raises(RuntimeError, match="this build's panel width"):
        mod.quant_gemv(x, *wrong, torch.empty(0), 0)


@pytest.mark.parametrize("scheme", G32, ids=str)
def test_quant_linear_keeps_panels_and_its_results(scheme):
    mod, rows = _panel()
    if scheme.bits == 8 and not ql.kept_int8():
        pytest.skip("int8 keeps its rows where the CPU has no int8 dot products")
    torch.manual_seed(2)
    lin = ql.QuantLinear.from_linear(torch.nn.Linear(96, 2 * rows, bias=True), scheme)
    q, s = lin.qweight.clone(), lin.scales.clone()
    x = torch.randn(7, 96)
    before = {m: lin(x[:m]) for m in (1, 3, 7)}
    before_prefill = lin._prefill(mod, x)
    assert lin.keep_panels(rows) and lin.panel == rows and lin.qweight.dim() == 4
    assert not lin.keep_panels(rows)  # once
    assert torch.equal(lin.plain_weights()[0], q) and torch.equal(lin.plain_weights(5, 40)[1], s[5:40])
    for m, y in before.items():  # 1-3 rows ran the VNNI orders before: float32 summation order apart
        assert torch.allclose(lin(x[:m]), y, atol=1e-5, rtol=1e-5), m
    assert torch.equal(lin(x[:7]), before[7])  # 7 rows took the panel GEMM before too: the same bits
    assert torch.equal(lin._prefill(mod, x), before_prefill)  # dequantise + GEMM reads the rows back
    assert lin.weight_bytes() == q.numel() + s.numel() * 2


def test_quant_linear_keeps_rows_it_cannot_lay_out(monkeypatch):
    _, rows = _panel()
    odd = ql.QuantLinear.from_linear(torch.nn.Linear(64, rows + 1), QuantScheme(4, 32, False))
    g64 = ql.QuantLinear.from_linear(torch.nn.Linear(128, rows), QuantScheme(4, 64, False))
    int8 = ql.QuantLinear.from_linear(torch.nn.Linear(64, rows), QuantScheme(8, 32, False))
    monkeypatch.setattr(ql, "kept_int8", lambda: False)  # a CPU without int8 dot products
    for lin in (odd, g64, int8):
        q = lin.qweight
        assert not lin.keep_panels(rows) and lin.panel == 0 and lin.qweight is q


def test_a_tied_embedding_reads_the_heads_panels():
    _, rows = _panel()
    if not ql.kept_int8():
        pytest.skip("int8 (the 4-bit modes' head) keeps its rows where the CPU has no int8 dot products")
    head = ql.QuantLinear.from_linear(torch.nn.Linear(64, 3 * rows, bias=False), QuantScheme(8, 32, False),
                                      float_output=True)
    emb = ql.QuantEmbedding(head.qweight, head.scales, 64, torch.float32)
    ids = torch.tensor([[0, rows - 1, rows, 3 * rows - 1], [7, 7, 2 * rows + 3, 1]])
    want = emb(ids)
    head.keep_panels(rows)
    emb.share_panels(head)
    assert emb.panel == rows and emb.qweight is head.qweight
    assert torch.equal(emb(ids), want)
