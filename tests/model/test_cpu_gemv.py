"""The decode GEMV (csrc/kernels.h), the float32 panel GEMM (csrc/panel_gemm.h) and CpuLinear's
dispatch against float64 matmuls: every weight dtype, row counts on both sides of each group of 4 and
of each tile, K with and without a tail (K % 64 != 0, K % 16 != 0), scale and bias."""

from __future__ import annotations

import pytest
import torch

from servescope.kernels.cpu import linear as cpu_linear
from servescope.model.linears.cpu import CpuLinear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="CPU GEMV extension not built here")


def _ref(x, w, scale=None, bias=None):
    y = x.double() @ w.double().t()
    if scale is not None:
        y = y * scale.double()
    if bias is not None:
        y = y + bias.double()
    return y.float()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 9])
@pytest.mark.parametrize("k", [64, 100, 576, 1536])
@pytest.mark.parametrize("n", [1, 7, 200])
def test_gemv_float32(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    torch.testing.assert_close(cpu_linear.gemv(x, w), _ref(x, w), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cpu_linear.gemv(x, w, None, bias), _ref(x, w, bias=bias), atol=1e-4, rtol=1e-4)


# bfloat16 rows of x on a bfloat16 weight: from 2 rows on, bfloat16 dot products where the CPU has them (AVX512-BF16:
# csrc/kernels.h gemv_rows_bf16_dot), the float32 path elsewhere and at 1 row: every block of 4 rows of x and its
# remainders (2..17), K with and without a 32-wide tail, a range's rows left after its quarters (n = 7, 33, 130)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 16, 17])
@pytest.mark.parametrize("k", [33, 64, 130, 576])
@pytest.mark.parametrize("n", [7, 33, 130])
def test_gemv_bfloat16_rows_of_bfloat16(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    tol = dict(atol=1e-5 * k ** 0.5, rtol=1e-5)  # the products exact, float32 sums
    torch.testing.assert_close(cpu_linear.gemv(x, w), _ref(x, w), **tol)
    torch.testing.assert_close(cpu_linear.gemv(x, w, None, bias), _ref(x, w, bias=bias), **tol)
    # the same values as float32 rows (the float32 path): the two agree to float32 sums
    torch.testing.assert_close(cpu_linear.gemv(x, w), cpu_linear.gemv(x.float(), w), **tol)


# rows: one tile and every remainder shape (the tiles of equal height), two row blocks (257, 300);
# K: 3, a K chunk and a half (300), several chunks (1536); N: inside one panel, one panel and a tail
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13, 64, 257])
@pytest.mark.parametrize("k", [3, 300, 1536])
@pytest.mark.parametrize("n", [1, 33, 200])
def test_panel_gemm_float32(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w, bias = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    panels = cpu_linear.pack_panels(w)
    tol = dict(atol=1e-4 * k ** 0.5, rtol=1e-4)
    torch.testing.assert_close(cpu_linear.panel_gemm(x, panels, n), _ref(x, w), **tol)
    torch.testing.assert_close(cpu_linear.panel_gemm(x, panels, n, bias), _ref(x, w, bias=bias), **tol)


def test_panel_gemm_rejects_what_it_cannot_run():
    """Bad panels, shapes or dtypes: a clear error, not a wrong answer or a crash."""
    w = torch.randn(40, 64)
    panels = cpu_linear.pack_panels(w)
    assert cpu_linear.pack_panels(w.bfloat16()) is None  # bfloat16 models keep oneDNN's bf16 GEMM
    with pytest.raises(RuntimeError, match="panel_gemm: panels"):
        cpu_linear.panel_gemm(torch.randn(2, 64), panels, 100)  # panels of another N
    with pytest.raises(RuntimeError, match="panel_gemm: panels"):
        cpu_linear.panel_gemm(torch.randn(2, 32), panels, 40)  # another K
    with pytest.raises(RuntimeError, match="panel_gemm: x"):
        cpu_linear.panel_gemm(torch.randn(2, 64).bfloat16(), panels, 40)
    with pytest.raises(RuntimeError, match="panel_gemm: bias"):
        cpu_linear.panel_gemm(torch.randn(2, 64), panels, 40, torch.randn(7))
    with pytest.raises(RuntimeError, match="panel_gemm: x"):
        cpu_linear.panel_gemm(torch.randn(2, 0), cpu_linear.pack_panels(torch.randn(40, 0)), 40)
    assert cpu_linear.panel_gemm(torch.randn(0, 64), panels, 40).shape == (0, 40)


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("k", [100, 576])
def test_gemv_bfloat16_weights_and_activations(m, k):
    g = torch.Generator().manual_seed(k + m)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(300, k, generator=g).bfloat16()
    # the kernel widens both to float32 exactly and accumulates in float32
    torch.testing.assert_close(cpu_linear.gemv(x, w), _ref(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("k", [80, 576])
def test_gemv_int8_with_scale(m, k):
    g = torch.Generator().manual_seed(k * 3 + m)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-127, 128, (130, k), generator=g, dtype=torch.int8)
    scale, bias = torch.rand(130, generator=g) / 100, torch.randn(130, generator=g)
    torch.testing.assert_close(cpu_linear.gemv(x, w, scale, bias), _ref(x, w, scale, bias), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 6, 7, 64, 300])
def test_cpu_linear_matches_f_linear(dtype, m):
    """Each path of CpuLinear: the GEMV up to MAX_ROWS, float32's panel GEMM up to PANEL_MAX_ROWS (300:
    above it), oneDNN (or F.linear) above."""
    torch.manual_seed(m)
    lin = torch.nn.Linear(576, 320, bias=True).to(dtype).requires_grad_(False)
    x = torch.randn(m, 576).to(dtype)
    cl = CpuLinear(lin)
    out = cl(x)
    assert out.dtype == dtype and out.shape == (m, 320)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), _ref(x.float(), lin.weight.float(), bias=lin.bias.float()), **tol)


def test_kernel_probe_rates_shape():
    """The probe's table (measure/kernel_rates.py): one [M, bytes/s] row per M, ascending, positive,
    and accepted by HardwareSpec."""
    from servescope.analysis.hardware import get_hardware
    from servescope.measure.kernel_rates import measure_linear_rates

    rates = measure_linear_rates("float32", rows=(1, 3, 16), num_matrices=2, size=128, runs=1)
    assert [m for m, _ in rates] == [1, 3, 16] and all(r > 0 for _, r in rates)
    spec = get_hardware("H100-SXM").replace(kind="cpu", linear_rates={"float32": rates})
    assert spec.linear_rate("float32", 2) > 0


def test_kernel_probe_decode_attention_rate():
    from servescope.kernels.cpu import ops as cpu_ops
    from servescope.measure.kernel_rates import measure_decode_attention_flops

    if not cpu_ops.available():
        pytest.skip("CPU op extension not built here")
    assert measure_decode_attention_flops("float32", batch=2, context=32, runs=1) > 1e6


def test_kernel_probe_packed_gemm_rate():
    from servescope.kernels.cpu import ops as cpu_ops
    from servescope.measure.kernel_rates import measure_packed_gemm_flops

    if not cpu_ops.available():
        pytest.skip("CPU op extension not built here")
    assert measure_packed_gemm_flops(rows=257, dim=64, runs=1) > 1e6  # past GROUP32_MAX_ROWS: the integer GEMM
    with pytest.raises(ValueError, match="MAX_ROWS"):
        measure_packed_gemm_flops(rows=256, dim=64)
