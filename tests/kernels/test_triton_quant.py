"""The Triton GEMV over packed 4- and 8-bit weights (kernels/triton_quant.py) against the
dequantise-then-float64 reference: every scheme (bits, group, symmetric or not), K not a multiple of
the group, N not a multiple of the row block, bias, M = 1..8, and its bad input. Without CUDA it runs
in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), so shapes are small."""

import pytest
import torch
from triton_interp import interpreted  # tests/model is on sys.path (tests/conftest.py)

(tq,) = interpreted("servescope.kernels.triton.quant")

from servescope.quant.packed import dequantize, quantize  # noqa: E402
from servescope.quant.scheme import QuantScheme  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCHEMES = [QuantScheme(4, 32), QuantScheme(4, 64, asym=True), QuantScheme(4, 128), QuantScheme(4, None, asym=True),
           QuantScheme(8, 32), QuantScheme(8, 128, asym=True), QuantScheme(8, None)]


@pytest.mark.parametrize("scheme", SCHEMES,
                         ids=lambda s: f"int{s.bits}-g{s.group or 'ch'}-{'asym' if s.asym else 'sym'}")
@pytest.mark.parametrize("m", [1, 3])
def test_packed_gemv_matches_the_dequantised_float64(scheme, m):
    g = torch.Generator().manual_seed(m * 10 + scheme.bits)
    n, k = 37, 200  # K not a multiple of 64 / 128, N not a multiple of the row block
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g)
    packed, scales = quantize(w, scheme)
    ref_w = dequantize(packed, scales, k, torch.float64)
    for bias in (None, b):
        y = tq.quant_gemv(x.to(DEV), packed.to(DEV), scales.to(DEV), k,
                          None if bias is None else bias.to(DEV), block_n=8, block_k=64)
        ref = x.double() @ ref_w.T + (0 if bias is None else bias.double())
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert (y.cpu().double() - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_bad_input_is_refused():
    packed, scales = quantize(torch.randn(8, 64), QuantScheme(4, 32))
    with pytest.raises(ValueError, match="M must be"):
        tq.quant_gemv(torch.randn(9, 64), packed, scales, 64)
    with pytest.raises(ValueError, match="in_features"):
        tq.quant_gemv(torch.randn(1, 60), packed, scales, 64)
    with pytest.raises(ValueError, match="block_k"):
        tq.quant_gemv(torch.randn(1, 64), packed, scales, 64, block_k=48)
