"""GPTQ (quant/gptq.py) against plain rounding: the same packed form; identical to it where the
calibration inputs are uncorrelated; a smaller layer output error where they are correlated."""

import pytest
import torch

from servescope.quant.packed import dequantize, quantize
from servescope.quant.scheme import QuantScheme
from servescope.quant.gptq import gptq_quantize

SCHEMES = [QuantScheme(4, 32, False), QuantScheme(4, 32, True), QuantScheme(8, 32, False),
           QuantScheme(4, 128, True), QuantScheme(8, None, False), QuantScheme(8, 64, True)]


def _correlated_inputs(k: int, tokens: int = 512, seed: int = 0) -> torch.Tensor:
    """Activations like a transformer's: a few large directions, columns mixed, some outlier channels."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, k, generator=g) * torch.logspace(0, -2, k)
    x = z @ torch.randn(k, k, generator=g) / k ** 0.5
    x[:, :3] *= 8
    return x


def _output_error(w, wq, x):
    return ((x @ (w - wq).T).square().sum() / (x @ w.T).square().sum()).item()


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.bits}-{s.group}-{'a' if s.asym else 's'}")
@pytest.mark.parametrize("k", [256, 80])  # 80: the last group of 32 is partial; per-channel pads to 96
def test_gptq_lowers_the_output_error_in_the_same_packed_form(scheme, k):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, k, generator=g) * 0.05
    x = _correlated_inputs(k)
    q_rtn, s_rtn = quantize(w, scheme)
    q, s = gptq_quantize(w, x.double().T @ x.double(), scheme)
    assert q.dtype == q_rtn.dtype and q.shape == q_rtn.shape and s.dtype == torch.float16 and s.shape == s_rtn.shape
    if scheme.bits == 4:
        assert int(q.max()) <= 255  # (two nibbles per byte)
    else:
        assert int(q.min()) >= (-128 if scheme.asym else -127)
    err = _output_error(w, dequantize(q, s, k), x)
    err_rtn = _output_error(w, dequantize(q_rtn, s_rtn, k), x)
    assert err < 0.8 * err_rtn, (err, err_rtn)


@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=["q4_0", "q4_1"])
def test_weighted_scales_lower_the_output_error_further(scheme):
    """The group scales searched with diag(H) as each input's importance (the outlier channels count for
    what they do to the output) leave less output error than the unweighted scales, GPTQ either way."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g) * 0.05
    x = _correlated_inputs(256)
    x[:, 100:104] *= 20  # outlier channels inside one group
    h = x.double().T @ x.double()
    err = _output_error(w, dequantize(*gptq_quantize(w, h, scheme, weighted_scales=True), 256), x)
    err_plain = _output_error(w, dequantize(*gptq_quantize(w, h, scheme), 256), x)
    assert err < 0.85 * err_plain, (err, err_plain)  # measured 0.76 (q4_0), 0.49 (q4_1)


@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=["q4_0", "q4_1", "q8_0"])
def test_uncorrelated_inputs_give_plain_rounding_bit_for_bit(scheme):
    """With H diagonal no error is carried to later columns: each weight is rounded to the nearest
    point of its group's searched grid, which is what quantize does."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(2)) * 0.1
    q, s = gptq_quantize(w, torch.diag(torch.rand(96, dtype=torch.float64) + 0.5), scheme)
    q_rtn, s_rtn = quantize(w, scheme)
    assert torch.equal(s, s_rtn) and torch.equal(q, q_rtn)


def test_dead_inputs_and_bad_hessians():
    w = torch.randn(16, 64) * 0.1
    x = _correlated_inputs(64, tokens=200)
    x[:, 5] = 0  # an input channel that never fires
    q, s = gptq_quantize(w, x.double().T @ x.double(), QuantScheme(4, 32, True))
    assert torch.isfinite(dequantize(q, s, 64)).all()
    with pytest.raises(ValueError, match=r"hessian must be \[64, 64\]"):
        gptq_quantize(w, torch.eye(32), QuantScheme(4, 32, False))
