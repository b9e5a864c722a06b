"""Triton KV store and paged decode against the torch reference (the oracle).

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
here before triton is imported), so shapes are kept small.
"""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

if not torch.cuda.is_available() and "servescope.kernels.triton.attention" in sys.modules:
    # triton.jit picks the interpreter when a kernel is defined: re-define them if an earlier
    # import (another test) happened before TRITON_INTERPRET was set
    importlib.reload(sys.modules["servescope.kernels.triton.attention"])
    if "servescope.model.attention.triton_backend" in sys.modules:
        importlib.reload(sys.modules["servescope.model.attention.triton_backend"])

from servescope.model.attention.backend import AttentionMetadata  # noqa: E402
from servescope.model.attention.reference import TorchAttentionBackend  # noqa: E402
from servescope.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from servescope.kernels.triton.attention import paged_decode, store_kv  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _caches(n, s, hkv, d, dtype, gen):
    k = torch.randn(n, s, hkv, d, generator=gen).to(dtype).to(DEV)
    v = torch.randn(n, s, hkv, d, generator=gen).to(dtype).to(DEV)
    return k, v


def _tables(lens, s, n, gen):
    """Random distinct blocks per sequence, rows padded with 0 -> [B, M] int32."""
    m = max((length + s - 1) // s for length in lens)
    rows = []
    for length in lens:
        need = (length + s - 1) // s
        blocks = torch.randperm(n, generator=gen)[:need].tolist()
        rows.append(blocks + [0] * (m - need))
    return torch.tensor(rows, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_copy(dtype):
    gen = torch.Generator().manual_seed(0)
    n, s, hkv, d, t = 6, 16, 2, 64, 7
    k = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEV)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEV)
    slots = torch.randperm(n * s, generator=gen)[:t].to(DEV)
    kc, vc = torch.zeros(n, s, hkv, d, dtype=dtype, device=DEV), torch.zeros(n, s, hkv, d, dtype=dtype, device=DEV)
    store_kv(k, v, kc, vc, slots)
    rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
    rk.view(n * s, hkv, d).index_copy_(0, slots, k)
    rv.view(n * s, hkv, d).index_copy_(0, slots, v)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)


def test_store_kv_skips_negative_slots_and_reads_strided_input():
    gen = torch.Generator().manual_seed(1)
    n, s, hkv, d = 4, 16, 2, 64
    # k, v as views of a fused projection output: [T, (Hkv + Hkv) * D] split on the last dim
    kv = torch.randn(3, 2 * hkv * d, generator=gen).to(DEV)
    k, v = (x.view(3, hkv, d) for x in kv.split([hkv * d, hkv * d], dim=-1))
    slots = torch.tensor([5, -1, 40], dtype=torch.int64, device=DEV)
    kc, vc = torch.zeros(n, s, hkv, d, device=DEV), torch.zeros(n, s, hkv, d, device=DEV)
    store_kv(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(n * s, hkv, d), vc.view(n * s, hkv, d)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[40], k[2])
    assert torch.equal(flat_v[5], v[0]) and torch.equal(flat_v[40], v[2])
    assert int((flat_k.abs().sum((1, 2)) != 0).sum()) == 2  # the -1 row wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_paged_decode_matches_reference(dtype, group, block_size, head_dim):
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    hkv = 2
    h = hkv * group
    s, d, n = block_size, head_dim, 24
    lens = [1, s, 3 * s, 2 * s + 5, 37]  # one token, block multiples, odd lengths
    kc, vc = _caches(n, s, hkv, d, dtype, gen)
    tables = _tables(lens, s, n, gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), h, d, generator=gen).to(dtype).to(DEV)
    scale = d ** -0.5
    ref = TorchAttentionBackend._paged_decode(q, kc, vc, tables, ctx, max(lens), scale)
    out = paged_decode(q, kc, vc, tables, ctx, scale, max_context_len=max(lens), num_splits=1)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_matches_single_pass(num_splits):
    """Flash-decoding partitions (some of them empty for short contexts) reduce to the same output."""
    gen = torch.Generator().manual_seed(7)
    s, hkv, group, d, n = 16, 2, 4, 64, 40
    lens = [1, 150, 64, 290]
    kc, vc = _caches(n, s, hkv, d, torch.float32, gen)
    tables = _tables(lens, s, n, gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(DEV)
    ref = TorchAttentionBackend._paged_decode(q, kc, vc, tables, ctx, max(lens), d ** -0.5)
    out = paged_decode(q, kc, vc, tables, ctx, d ** -0.5, max_context_len=max(lens), num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_context_row_is_zero(num_splits):
    """A padded CUDA-graph row has context length 0: its output is zeros, never NaN."""
    gen = torch.Generator().manual_seed(3)
    s, hkv, d, n = 16, 1, 64, 4
    kc, vc = _caches(n, s, hkv, d, torch.float32, gen)
    tables = torch.tensor([[2, 1], [0, 0]], dtype=torch.int32, device=DEV)
    ctx = torch.tensor([20, 0], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 2, d, generator=gen).to(DEV)
    out = paged_decode(q, kc, vc, tables, ctx, d ** -0.5, max_context_len=512, num_splits=num_splits)
    ref = TorchAttentionBackend._paged_decode(q[:1], kc, vc, tables[:1], ctx[:1], 20, d ** -0.5)
    torch.testing.assert_close(out[:1], ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_mixed_decode_and_prefill_matches_torch_backend(dtype):
    """Two decodes, then a fresh prompt and a chunk continuing a cached prefix, in one flat step."""
    gen = torch.Generator().manual_seed(11)
    s, hkv, h, d, n = 16, 2, 6, 64, 32
    # (query_len, context_len after the step) per sequence; decodes first
    seqs = [(1, 21), (1, 48), (9, 9), (7, 40)]
    base_k, base_v = _caches(n, s, hkv, d, dtype, gen)
    tables = _tables([c for _, c in seqs], s, n, gen)
    slots, qsl = [], [0]
    for i, (ql, cl) in enumerate(seqs):
        row = tables[i].tolist()
        slots.extend(row[p // s] * s + p % s for p in range(cl - ql, cl))
        qsl.append(qsl[-1] + ql)
    t = qsl[-1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), block_tables=tables,
        context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        query_lens_cpu=[q for q, _ in seqs], context_lens_cpu=[c for _, c in seqs],
        max_query_len=9, max_context_len=48, num_decode_seqs=2)
    q = torch.randn(t, h, d, generator=gen).to(dtype).to(DEV)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEV)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEV)
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        kc, vc = base_k.clone(), base_v.clone()
        backend.store_kv(k, v, kc, vc, meta)
        outs.append(backend.forward(q, k, v, kc, vc, meta, d ** -0.5))
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("softcap,with_sinks,window", [(5.0, False, 0), (0.0, True, 0), (3.0, True, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_softcap_and_sinks_match_reference(num_splits, softcap, with_sinks, window, dtype):
    """Gemma 2's soft-capped scores and gpt-oss's sinks (one more logit per head, no value) against the
    reference's scores.attend; with a window, split-K partitions, and an empty (padded) row."""
    gen = torch.Generator().manual_seed(int(softcap * 10) + 3 * with_sinks + window)
    s, hkv, group, d, n = 16, 2, 3, 64, 48
    lens = [1, 37, 150, 96]
    kc, vc = _caches(n, s, hkv, d, dtype, gen)
    # scaled keys so the soft-cap bites (raw scores ~ +-8 against caps of 3 and 5)
    kc, vc = kc * 3, vc
    tables = _tables(lens, s, n, gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype).to(DEV)
    # sinks from far below the scores to above them: the denominator's extra term from nothing to most of it
    sinks = (torch.linspace(-6.0, 6.0, hkv * group) if with_sinks else None)
    sinks = sinks.to(DEV) if sinks is not None else None
    scale = d ** -0.5
    ref = TorchAttentionBackend._paged_decode(q, kc, vc, tables, ctx, max(lens), scale, window=window,
                                              softcap=softcap, sinks=sinks)
    out = paged_decode(q, kc, vc, tables, ctx, scale, max_context_len=max(lens), num_splits=num_splits,
                       window=window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    plain = paged_decode(q, kc, vc, tables, ctx, scale, max_context_len=max(lens), num_splits=num_splits,
                         window=window)
    assert (out.float() - plain.float()).abs().max() > 50 * TOL[dtype]  # the mods change the answer
    empty = paged_decode(q[:1], kc, vc, tables[:1], torch.zeros(1, dtype=torch.int32, device=DEV), scale,
                         max_context_len=512, num_splits=num_splits, softcap=softcap, sinks=sinks)
    assert torch.equal(empty, torch.zeros_like(empty))  # a padded graph row: zeros, never NaN


def test_backend_mixed_step_with_softcap_and_sinks_matches_torch_backend():
    """Decode rows through the Triton decode kernel, prefill rows through its prefill kernel, in one flat step."""
    gen = torch.Generator().manual_seed(12)
    s, hkv, h, d, n = 16, 2, 6, 64, 32
    seqs = [(1, 21), (1, 48), (9, 9), (7, 40)]
    kc, vc = _caches(n, s, hkv, d, torch.float32, gen)
    tables = _tables([c for _, c in seqs], s, n, gen)
    slots, qsl = [], [0]
    for i, (ql, cl) in enumerate(seqs):
        row = tables[i].tolist()
        slots.extend(row[p // s] * s + p % s for p in range(cl - ql, cl))
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), block_tables=tables,
        context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        query_lens_cpu=[q for q, _ in seqs], context_lens_cpu=[c for _, c in seqs],
        max_query_len=9, max_context_len=48, num_decode_seqs=2)
    q = torch.randn(qsl[-1], h, d, generator=gen).to(DEV) * 3
    k = torch.randn(qsl[-1], hkv, d, generator=gen).to(DEV)
    v = torch.randn(qsl[-1], hkv, d, generator=gen).to(DEV)
    sinks = torch.linspace(-2.0, 2.0, h).to(DEV)
    mods = dict(window=24, softcap=4.0, sinks=sinks)
    TorchAttentionBackend().store_kv(k, v, kc, vc, meta)  # a step stores its keys before attention (backend.py)
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, d ** -0.5, **mods)
    out = TritonAttentionBackend().forward(q, k, v, kc, vc, meta, d ** -0.5, **mods)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
