"""The quantised KV cache (model/attention/kv_quant.py): rows quantised on store with their error bound,
the C++ and torch stores writing the same bytes, and every CPU attention path reading the cache as it
is: against a float64 reference over the dequantised values (rounding only), and against float64
attention over the unquantised keys and values within the bound the quantisation error allows."""

from __future__ import annotations

import math

import pytest
import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention import kv_quant
from servescope.model.attention.backend import AttentionMetadata
from servescope.model.attention.reference import TorchAttentionBackend

DTYPES = [torch.int8] + ([kv_quant.FP8] if kv_quant.FP8 is not None else [])
needs_ext = pytest.mark.skipif(not cpu_ops.available(), reason="CPU op extension not built here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_round_trip_within_their_quantisation_error(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 64, generator=g) * torch.rand(37, 3, 1, generator=g) * 4
    x[5, 1] = 0  # an all-zero row: scale 0, values 0, no NaN
    cache = kv_quant.allocate(4, 16, 3, 64, dtype, torch.device("cpu"))
    assert cache.shape == (4, 16, 3, 68) and cache.dtype == dtype
    slots = torch.randperm(64, generator=g)[:37]
    kv_quant.store(x, x, cache, cache.clone(), slots)
    back = kv_quant.dequantize(cache.view(torch.uint8).view(64, 3, 68)[slots], dtype, torch.float64)
    amax = x.abs().amax(-1, keepdim=True).double()
    if dtype == torch.int8:  # round to nearest: half a step of absmax / 127
        bound = amax / 127 / 2
    else:  # e4m3: 3 mantissa bits, a relative 2^-4, and e4m3's smallest step (2^-9) near zero
        bound = x.abs().double() * 2.0 ** -4 + amax / 448 * 2.0 ** -10
    assert ((back - x.double()).abs() <= bound * (1 + 1e-6) + 1e-12).all()
    assert back[5, 1].abs().max() == 0 and torch.isfinite(back).all()
    # the row's largest value is represented exactly (it sets the scale)
    i = x.abs().argmax(-1, keepdim=True)
    assert torch.allclose(back.gather(-1, i), x.double().gather(-1, i), rtol=1e-6)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16], ids=str)
def test_cpp_store_writes_the_torch_stores_bytes(dtype, src):
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(23, 2, 16, generator=g).to(src) for _ in range(2))
    slots = torch.randperm(48, generator=g)[:23]
    caches = [kv_quant.allocate(3, 16, 2, 16, dtype, torch.device("cpu")) for _ in range(4)]
    cpu_ops.store_kv(k, v, caches[0], caches[1], slots)
    kv_quant.store(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


def _attention_f64(q, keys, values, lens, scale):
    """q [B, H, D], keys / values [B, L, Hkv, D] float64 -> [B, H, D]: softmax(scale q.k) v per sequence."""
    b, h, d = q.shape
    g = h // keys.shape[2]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        kk = keys[i, :lens[i]].repeat_interleave(g, dim=1)  # [L, H, D]
        vv = values[i, :lens[i]].repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), kk) * scale, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", p, vv)
    return out


def _paged_case(dtype, head_dim, b=3, h=6, hkv=2, S=16, seed=2):
    """Random K/V for b sequences of different lengths stored in scattered blocks of a quantised cache."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 17, 40][:b] if b <= 3 else [(7 * i) % 50 + 1 for i in range(b)]
    per_seq = -(-max(lens) // S)
    nblk = b * per_seq + 1
    tables = (nblk - 1 - torch.arange(b * per_seq)).view(b, per_seq).to(torch.int32)  # scattered, never block 0
    k_full = torch.randn(b, per_seq * S, hkv, head_dim, generator=g) * 2
    v_full = torch.randn(b, per_seq * S, hkv, head_dim, generator=g)
    kc, vc = (kv_quant.allocate(nblk, S, hkv, head_dim, dtype, torch.device("cpu")) for _ in range(2))
    for i in range(b):
        pos = torch.arange(lens[i])
        slots = (tables[i, pos // S].long() * S + pos % S)
        kv_quant.store(k_full[i, :lens[i]], v_full[i, :lens[i]], kc, vc, slots)
    q = torch.randn(b, h, head_dim, generator=g)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), k_full, v_full


def _dequantised(cache, tables):
    """[B, M*S, Hkv, D] float64 of the cache's rows for each sequence's blocks."""
    return kv_quant.gather(cache, tables.long(), torch.float64).flatten(1, 2)


def _decode_meta(tables, lens):
    return AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.int64), block_tables=tables,
                             context_lens=lens, query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                             query_lens_cpu=[1] * len(lens), context_lens_cpu=lens.tolist(), max_query_len=1,
                             max_context_len=int(lens.max()), num_decode_seqs=len(lens))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 16], ids=["d64-tiled", "d16-generic"])
@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_paged_decode_reads_the_quantised_cache(dtype, head_dim, path):
    if path == "cpp" and not cpu_ops.available():
        pytest.skip("CPU op extension not built here")
    q, kc, vc, tables, lens, k_full, v_full = _paged_case(dtype, head_dim)
    scale = 1 / math.sqrt(head_dim)
    if path == "cpp":
        got = cpu_ops.paged_decode(q, kc, vc, tables, lens, scale)
    else:  # the torch reference's own decode (gathers and dequantises the blocks it reads)
        got = TorchAttentionBackend().forward(q, None, None, kc, vc, _decode_meta(tables, lens), scale)
    # (1) over the dequantised values: float32 rounding only
    want = _attention_f64(q, _dequantised(kc, tables), _dequantised(vc, tables), lens.tolist(), scale)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    # (2) over the unquantised values: within the quantisation error's bound. With every score off by
    # at most e, each probability moves by a factor within exp(+-2e), so
    # |o' - o| <= max |dv| + (exp(2e) - 1) max |v|, e = scale * max_l sum_d |q_d| |dk_ld|
    exact = _attention_f64(q, k_full.double(), v_full.double(), lens.tolist(), scale)
    dk = (_dequantised(kc, tables) - k_full.double()).abs()
    dv = (_dequantised(vc, tables) - v_full.double()).abs()
    g = q.shape[1] // kc.shape[2]
    for i, n in enumerate(lens.tolist()):
        for hh in range(q.shape[1]):
            e = scale * (q[i, hh].double().abs() * dk[i, :n, hh // g]).sum(-1).max()
            bound = dv[i, :n, hh // g].max() + (math.exp(2 * e) - 1) * v_full[i, :n, hh // g].abs().max()
            assert (got[i, hh].double() - exact[i, hh]).abs().max() <= bound + 1e-5
    # and the bound is not vacuous: the quantised result is close to the exact one
    assert (got.double() - exact).abs().max() < (0.05 if dtype == torch.int8 else 0.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_reads_its_own_keys_from_the_quantised_cache(dtype):
    """A prompt in one step attends over the same quantised keys as the same prompt in two chunks."""
    g = torch.Generator().manual_seed(3)
    n, hkv, h, d, S = 20, 2, 4, 16, 16
    q = torch.randn(n, h, d, generator=g)
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    table = torch.tensor([[2, 1]], dtype=torch.int32)
    slots = (table[0, torch.arange(n) // S].long() * S + torch.arange(n) % S)
    be = TorchAttentionBackend()

    def run(chunks):
        kc, vc = (kv_quant.allocate(3, S, hkv, d, dtype, torch.device("cpu")) for _ in range(2))
        outs, done = [], 0
        for c in chunks:
            sl = slice(done, done + c)
            meta = AttentionMetadata(slot_mapping=slots[sl], block_tables=table,
                                     context_lens=torch.tensor([done + c], dtype=torch.int32),
                                     query_start_loc=torch.tensor([0, c], dtype=torch.int32), query_lens_cpu=[c],
                                     context_lens_cpu=[done + c], max_query_len=c, max_context_len=done + c)
            be.store_kv(k[sl], v[sl], kc, vc, meta)
            outs.append(be.forward(q[sl], k[sl], v[sl], kc, vc, meta, 0.25))
            done += c
        return torch.cat(outs)

    whole, chunked = run([n]), run([7, 13])
    torch.testing.assert_close(whole, chunked, rtol=1e-5, atol=1e-6)
