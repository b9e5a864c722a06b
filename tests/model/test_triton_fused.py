"""Fused Triton element-wise kernels against the torch references of fused_ops (the oracle).

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
here before triton is imported), so shapes are kept small. The references are called on CPU
tensors, where fused_ops always takes its torch path.
"""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

if not torch.cuda.is_available() and "servescope.kernels.triton.fused" in sys.modules:
    # triton.jit picks the interpreter when a kernel is defined (and AVAILABLE is computed at
    # import): re-define them if an earlier import happened before TRITON_INTERPRET was set
    importlib.reload(sys.modules["servescope.kernels.triton.fused"])

from servescope.kernels import fused_ops  # noqa: E402
from servescope.kernels.triton import fused as tf  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ref(fn, *args):
    """The torch reference on CPU (fused_ops dispatches to Triton only for CUDA tensors)."""
    out = fn(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    return out


def _close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _h_close(h, rh, dtype):
    """h = x + r is one rounding in both. Triton's interpreter rounds float32 -> bfloat16 toward
    zero (the GPU rounds to nearest even, like torch), so there bfloat16 is within one ulp."""
    if dtype == torch.bfloat16 and DEV.type == "cpu":
        _close(h, rh, dtype)
    else:
        assert torch.equal(h.cpu(), rh)


def test_available():
    assert tf.AVAILABLE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("dm", [64, 96, 320])
def test_rms_norm_matches_reference(dtype, t, dm):
    gen = torch.Generator().manual_seed(t * 1000 + dm)
    x = (torch.randn(t, dm, generator=gen) * 3).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(dm, generator=gen)).to(dtype).to(DEV)
    _close(tf.rms_norm(x, w, 1e-6), _ref(fused_ops.rms_norm, x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_strided_heads_and_fp32_weight(dtype):
    """qk-norm: a [T, H, D] view of a fused qkv output (row stride != H * D); and a float32
    weight with a 16-bit x promotes the output to float32, as in torch."""
    gen = torch.Generator().manual_seed(5)
    t, h, hkv, d = 3, 4, 2, 64
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(dtype).to(DEV)
    q = qkv.split([h * d, hkv * d, hkv * d], dim=-1)[0].view(t, h, d)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype).to(DEV)
    _close(tf.rms_norm(q, w, 1e-5), _ref(fused_ops.rms_norm, q, w, 1e-5), dtype)
    w32 = w.float()
    _close(tf.rms_norm(q, w32, 1e-5), _ref(fused_ops.rms_norm, q, w32, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("dm", [64, 200])
def test_add_rms_norm_matches_reference(dtype, t, dm):
    gen = torch.Generator().manual_seed(t * 100 + dm)
    x = torch.randn(t, dm, generator=gen).to(dtype).to(DEV)
    r = (torch.randn(t, dm, generator=gen) * 4).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(dm, generator=gen)).to(dtype).to(DEV)
    y, h = tf.add_rms_norm(x, r, w, 1e-6)
    ry, rh = _ref(fused_ops.add_rms_norm, x, r, w, 1e-6)
    _h_close(h, rh, dtype)
    _close(y, ry, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_wide_rows_take_the_loop(dtype, monkeypatch):
    """Rows wider than the one-pass block (8192+ on a GPU) loop over chunks: force it small."""
    monkeypatch.setattr(tf, "_MAX_NORM_BLOCK", 32)
    gen = torch.Generator().manual_seed(9)
    t, dm = 2, 100  # 4 chunks, the last one partial
    x = torch.randn(t, dm, generator=gen).to(dtype).to(DEV)
    r = torch.randn(t, dm, generator=gen).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(dm, generator=gen)).to(dtype).to(DEV)
    _close(tf.rms_norm(x, w, 1e-6), _ref(fused_ops.rms_norm, x, w, 1e-6), dtype)
    y, h = tf.add_rms_norm(x, r, w, 1e-6)
    ry, rh = _ref(fused_ops.add_rms_norm, x, r, w, 1e-6)
    _h_close(h, rh, dtype)
    _close(y, ry, dtype)


def _tables(t, d, gen):
    pos = torch.randint(0, 4096, (t,), generator=gen)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(pos.float(), inv)  # [T, D/2]
    return freqs.cos()[:, None, :].to(DEV), freqs.sin()[:, None, :].to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("h,hkv,d", [(4, 2, 64), (6, 2, 128), (3, 3, 64)])
def test_rotary_matches_reference_on_fused_qkv_views(dtype, t, h, hkv, d):
    gen = torch.Generator().manual_seed(t * 10 + h + d)
    # q, k as views of a fused projection output: [T, (H + 2 Hkv) D] split on the last dim
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(dtype).to(DEV)
    q, k, _ = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, h, d), k.view(t, hkv, d)
    cos, sin = _tables(t, d, gen)
    before = qkv.clone()
    qo, ko = tf.rotary(q, k, cos, sin)
    rq, rk = _ref(fused_ops.rotary, q, k, cos, sin)
    _close(qo, rq, dtype)
    _close(ko, rk, dtype)
    assert torch.equal(qkv, before)  # inputs untouched


def test_rotary_contiguous_inputs_and_more_heads_than_a_tile(monkeypatch):
    """Heads split over several programs per token (q and k groups) with contiguous q, k."""
    monkeypatch.setattr(tf, "_ROTARY_TILE", 64)  # 2 heads per program at D = 64
    gen = torch.Generator().manual_seed(4)
    t, h, hkv, d = 3, 5, 3, 64
    q = torch.randn(t, h, d, generator=gen).to(DEV)
    k = torch.randn(t, hkv, d, generator=gen).to(DEV)
    cos, sin = _tables(t, d, gen)
    qo, ko = tf.rotary(q, k, cos, sin)
    rq, rk = _ref(fused_ops.rotary, q, k, cos, sin)
    _close(qo, rq, torch.float32)
    _close(ko, rk, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("i", [64, 176, 1536])
def test_silu_mul_matches_reference(dtype, t, i):
    gen = torch.Generator().manual_seed(t + i)
    gate_up = (torch.randn(t, 2 * i, generator=gen) * 3).to(dtype).to(DEV)
    _close(tf.silu_mul(gate_up), _ref(fused_ops.silu_mul, gate_up), dtype)


def test_silu_mul_strided_rows():
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(5, 300, generator=gen).to(DEV)
    gate_up = big[:, :256]  # row stride 300
    _close(tf.silu_mul(gate_up), _ref(fused_ops.silu_mul, gate_up), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_batch_returns_empty(dtype):
    dm, h, hkv, d = 64, 4, 2, 64
    x = torch.empty(0, dm, dtype=dtype, device=DEV)
    w = torch.ones(dm, dtype=dtype, device=DEV)
    assert tf.rms_norm(x, w, 1e-6).shape == (0, dm)
    y, hs = tf.add_rms_norm(x, x, w, 1e-6)
    assert y.shape == (0, dm) and hs.shape == (0, dm) and y.dtype == dtype
    q = torch.empty(0, h, d, dtype=dtype, device=DEV)
    k = torch.empty(0, hkv, d, dtype=dtype, device=DEV)
    cs = torch.empty(0, 1, d // 2, device=DEV)
    qo, ko = tf.rotary(q, k, cs, cs)
    assert qo.shape == (0, h, d) and ko.shape == (0, hkv, d)
    assert tf.silu_mul(torch.empty(0, 2 * dm, dtype=dtype, device=DEV)).shape == (0, dm)
