"""MXFP4 packed weights (quant/mxfp4.py) and gpt-oss's packed experts (model/moe_clamped.py).

The torch side: quantize / dequantize agree with transformers' own MXFP4 conversion and llama.cpp's rule, the
checkpoint's nibble order round-trips. A QuantLinear over MXFP4 blocks (E8M0 scales): the C++ GEMV, the prefill
GEMM and the dequantisation equal a float64 product over the dequantised weight with the activations rounded as
the kernels round them (quant_dot.h), at odd widths and many row counts; without the extension, the torch
fallback equals the dequantised float product. The fused MoE op over MXFP4 experts with gpt-oss's biases and
clamped SwiGLU against PackedClampedExperts' own per-expert reference and a float64 sum. (The kernels on every
ISA path, torch-free: tests/kernels/test_quant_gemv_isas.py.)"""

import pytest
import torch
import torch.nn.functional as F

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears.packed import QuantLinear
from servescope.model.moe import grouped_experts
from servescope.model.moe_clamped import PackedClampedExperts
from servescope.quant import mxfp4
from servescope.quant.packed import gemv_activations

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="needs the CPU kernel extension")
H, WIDTH, E, LIMIT, ALPHA = 96, 64, 6, 0.8, 1.702


def test_quantize_matches_transformers_and_llama_cpp_rule():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(7, 160, generator=torch.Generator().manual_seed(0))
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (7, 80) and scales.shape == (7, 5) and scales.dtype == torch.uint8
    deq = mxfp4.dequantize(blocks, scales, 160)
    hf = convert_moe_packed_tensors(mxfp4.to_hf_blocks(blocks)[None], scales[None], dtype=torch.float32)[0].t()
    assert torch.equal(deq, hf)
    assert torch.equal(mxfp4.from_hf_blocks(mxfp4.to_hf_blocks(blocks)), blocks)
    # llama.cpp's rule: the scale 2^(floor(log2 amax) - 2), each value to its nearest grid point
    amax = w.view(7, 5, 32).abs().amax(-1)
    assert torch.equal(scales.long(), (torch.floor(torch.log2(amax)) - 2 + 127).long())
    grid = torch.tensor(mxfp4.VALUES).unique()
    step = torch.ldexp(torch.ones(7, 5, 1), scales.long()[..., None] - 127)
    best = ((w.view(7, 5, 32, 1) / step[..., None] - grid).abs().min(-1).values * step)
    assert torch.allclose((deq - w).abs().view(7, 5, 32), best, atol=1e-6)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        mxfp4.quantize(torch.randn(2, 40))


def _linear(n, k, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, generator=g) if bias else None
    return QuantLinear(*mxfp4.quantize(torch.randn(n, k, generator=g) * 0.1), k, b)


@needs_kernels
@pytest.mark.parametrize("n,k", [(7, 128), (37, 288), (13, 96), (64, 32)])
@pytest.mark.parametrize("rows", [1, 3, 5, 17, 300])
def test_kernels_equal_the_dequantised_product(n, k, rows):
    """GEMV (1..256 rows: the streaming, weight-stationary and AMX orders) and the prefill GEMM (300 rows)."""
    lin = _linear(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    w = mxfp4.dequantize(lin.qweight, lin.scales, k, torch.float64)
    xa, bound = gemv_activations(x, k, 32)
    ref = xa @ w.t() + lin.bias.double()
    y = lin(x)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4), (y.double() - ref).abs().max()
    exact = x.double() @ w.t() + lin.bias.double()
    assert ((y.double() - exact).abs() <= bound.abs() @ w.abs().t() + 1e-4).all()
    if rows < 17:  # bfloat16 rows below the AMX-BF16 crossover: the same integer kernels
        yb = lin(x.bfloat16()).double()
        assert torch.allclose(yb, lin(x.bfloat16().float()).double().bfloat16().double(), rtol=1e-2, atol=1e-2)
    out = torch.empty(n, k)
    cpu_ops.load().quant_dequantize_into(lin.qweight, lin.scales, 0, out)
    assert torch.equal(out, w.float())


def test_torch_fallback_is_the_float_product(monkeypatch):
    monkeypatch.setattr(cpu_ops._EXT, "mod", None)  # load() -> None: no extension
    lin = _linear(13, 96)
    x = torch.randn(4, 96)
    w = mxfp4.dequantize(lin.qweight, lin.scales, 96)
    assert torch.allclose(lin(x), F.linear(x, w, lin.bias), atol=1e-6)
    assert lin.weight_bytes() == 13 * 96 // 2 + 13 * 3  # 4.25 bits per weight
    assert lin.bits == 4 and lin.mxfp4


def _experts(seed=0) -> PackedClampedExperts:
    g = torch.Generator().manual_seed(seed)
    gate_up = [QuantLinear(*mxfp4.quantize(torch.randn(2 * WIDTH, H, generator=g) * 0.1), H) for _ in range(E)]
    down = [QuantLinear(*mxfp4.quantize(torch.randn(H, WIDTH, generator=g) * 0.1), WIDTH) for _ in range(E)]
    ex = PackedClampedExperts(gate_up, down, LIMIT, ALPHA)
    with torch.no_grad():
        ex.gate_up_proj_bias.copy_(torch.randn(E, 2 * WIDTH, generator=g) * 0.1)
        ex.down_proj_bias.copy_(torch.randn(E, H, generator=g) * 0.1)
    return ex


def _exact(ex, x, ids, weights) -> torch.Tensor:
    """float64 over the dequantised experts: sum_j w * (down(clamped_swiglu(gate_up x + b)) + b)."""
    deq = lambda m: mxfp4.dequantize(m.qweight, m.scales, m.in_features, torch.float64)  # noqa: E731
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (deq(ex.gate_up[e]) @ x[t].double() + ex.gate_up_proj_bias[e].double()).chunk(2)
            gate = gate.clamp(max=LIMIT)
            h = (up.clamp(-LIMIT, LIMIT) + 1) * gate * torch.sigmoid(ALPHA * gate)
            out[t] += float(weights[t, j]) * (deq(ex.down[e]) @ h + ex.down_proj_bias[e].double())
    return out


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t,k", [(1, 1), (1, 4), (3, 2), (17, 4)])
def test_fused_op_with_biases_and_clamped_swiglu(t, k, dtype):
    ex = _experts()
    g = torch.Generator().manual_seed(t * 10 + k)
    x = torch.randn(t, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
    assert ex._fused(x) is not None
    out, counts = ex.grouped(x, ids, weights)
    ex.fused = False
    ref, ref_counts = grouped_experts(x, ids, weights, ex)
    assert torch.equal(counts, ref_counts) and torch.equal(counts, torch.bincount(ids.flatten(), minlength=E))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol), (out.float() - ref.float()).abs().max()
    exact = _exact(ex, x, ids, weights)
    err = (out.double() - exact).abs().max() / exact.abs().max()
    assert err < (0.05 if dtype == torch.float32 else 0.1), f"relative error {err:.3f}"


@needs_kernels
def test_biases_and_activation_matter():
    """The fused op really adds both biases and clamps: each set aside moves the result."""
    ex = _experts()
    x, ids, w = torch.randn(3, H), torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.full((3, 2), 0.5)
    base = ex.grouped(x, ids, w)[0]
    for change in ("gate_up_proj_bias", "down_proj_bias", "limit"):
        other = _experts()
        if change == "limit":
            other.limit = 100.0
        else:
            getattr(other, change).data.zero_()
        assert (other.grouped(x, ids, w)[0] - base).abs().max() > 1e-3, change
