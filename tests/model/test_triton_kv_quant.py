"""The Triton KV store and paged decode on a quantised cache (int8, fp8 e4m3) against the torch
reference (model/attention/kv_quant.py).

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here
before triton is imported), so shapes are kept small.
"""

import math

import pytest
import torch
from triton_interp import interpreted  # tests/model is on sys.path (tests/conftest.py)

triton_attention, _ = interpreted("servescope.kernels.triton.attention", "servescope.model.attention.triton_backend")
paged_decode, store_kv = triton_attention.paged_decode, triton_attention.store_kv

from servescope.model.attention import kv_quant  # noqa: E402
from servescope.model.attention.reference import TorchAttentionBackend  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.int8] + ([kv_quant.FP8] if kv_quant.FP8 is not None else [])


def _one_lsb(cache, rows_ref, d):
    """The largest difference between two stores' dequantised rows, in units of the row's scale."""
    rows = (cache.view(torch.uint8).view(-1, cache.shape[2], d + 4).cpu(),
            rows_ref.view(torch.uint8).view(-1, cache.shape[2], d + 4).cpu())
    a, b = (kv_quant.dequantize(r, cache.dtype, torch.float64) for r in rows)
    step = b.abs().amax(-1, keepdim=True) / kv_quant.QMAX[cache.dtype]
    return ((a - b).abs() / step.clamp_min(1e-30)).max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_quantises_like_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    n, s, hkv, d, t = 4, 16, 2, 16, 9
    k, v = (torch.randn(t, hkv, d, generator=gen).to(DEV) for _ in range(2))
    slots = torch.randperm(n * s, generator=gen)[:t].to(DEV)
    slots[3] = -1  # a padded graph row: nothing written
    if dtype != torch.int8 and not torch.cuda.is_available():
        # seen with triton 3.x: the interpreter's float32 -> e4m3 cast drops the carry of a rounded-up
        # mantissa into the exponent (a value just under 128 becomes 64), a fault of its emulation; the
        # decode below reads e4m3 fine there, and a GPU converts in hardware
        pytest.skip("Triton's interpreter rounds float32 -> e4m3 wrongly at binade edges; a GPU check")
    kc, vc, kr, vr = (kv_quant.allocate(n, s, hkv, d, dtype, DEV) for _ in range(4))
    store_kv(k, v, kc, vc, slots)
    keep = slots >= 0
    kv_quant.store(k[keep], v[keep], kr, vr, slots[keep])
    # the scales are the reference's (to a GPU division's rounding); values within one quantisation step
    # (a value at an exact half step may round the other way after a division rounded differently)
    for got, ref in ((kc, kr), (vc, vr)):
        assert _one_lsb(got, ref, d) <= (1.0 if dtype == torch.int8 else 32.0) + 1e-6  # e4m3's widest step: 32
        scales = [c.view(torch.uint8)[..., d:].contiguous().view(torch.float32) for c in (got, ref)]
        torch.testing.assert_close(scales[0], scales[1], rtol=1e-6, atol=0)
        assert scales[1].abs().sum() > 0 and (scales[0] == 0).sum() == (scales[1] == 0).sum()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_reads_the_quantised_cache(dtype, num_splits):
    gen = torch.Generator().manual_seed(1)
    n, s, hkv, h, d = 8, 16, 2, 4, 16
    lens = [1, 20, 37]
    kc, vc = (kv_quant.allocate(n, s, hkv, d, dtype, DEV) for _ in range(2))
    all_slots = torch.arange(n * s, device=DEV)
    kv_quant.store(torch.randn(n * s, hkv, d, generator=gen).to(DEV), torch.randn(n * s, hkv, d, generator=gen).to(DEV),
                   kc, vc, all_slots)
    tables = torch.tensor([[7, 0, 0], [2, 5, 0], [1, 6, 3]], dtype=torch.int32, device=DEV)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(3, h, d, generator=gen).to(DEV)
    scale = 1 / math.sqrt(d)
    got = paged_decode(q, kc, vc, tables, cl, scale, max_context_len=max(lens), num_splits=num_splits)
    want = TorchAttentionBackend._paged_decode(q, kc, vc, tables, cl, max(lens), scale)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
