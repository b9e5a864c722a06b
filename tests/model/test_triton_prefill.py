"""The Triton paged prefill kernel (kernels/triton/prefill.py) and the Triton backend's prefill rows against
the torch reference (TorchAttentionBackend: SDPA, or scores.attend with soft-caps and sinks).

On a machine without CUDA the kernels run in Triton's interpreter, so shapes are tiny; every case is one
launch over several sequences: a fresh prompt (empty context), chunks continuing a cached context, a
one-token chunk, with a window that chunks cross.
"""

import pytest
import torch
from triton_interp import interpreted  # tests/model is on sys.path (tests/conftest.py)

_, prefill, triton_backend = interpreted("servescope.kernels.triton.attention", "servescope.kernels.triton.prefill",
                                         "servescope.model.attention.triton_backend")

from servescope.model.attention import kv_quant  # noqa: E402
from servescope.model.attention.backend import AttentionMetadata  # noqa: E402
from servescope.model.attention.reference import TorchAttentionBackend  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
S = 16
# (query_len, context_len after the step): an empty context, chunks over cached context crossing blocks, one token
SEQS = [(19, 19), (7, 40), (1, 23), (24, 57)]
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8] + (
    [kv_quant.FP8] if kv_quant.FP8 is not None else [])
# queries of a quantised cache in float32 (the reference dequantises to the queries' dtype)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _q_dtype(kv_dtype):
    return torch.float32 if kv_quant.is_quantized(kv_dtype) else kv_dtype


def _step(seqs, hkv, group, d, kv_dtype, seed, num_decode_seqs=0, q_scale=1.0, q_dtype=None):
    """A step's metadata, q, k, v, and caches whose context was written before (random) and whose new rows
    were just stored by the reference: [(qlen, ctx)] per sequence, decodes first."""
    gen = torch.Generator().manual_seed(seed)
    qd = q_dtype or _q_dtype(kv_dtype)
    n = sum(-(-c // S) for _, c in seqs) + 3
    kc, vc = (kv_quant.allocate(n, S, hkv, d, kv_dtype, DEV) for _ in range(2))
    perm = torch.randperm(n, generator=gen).tolist()
    m = max(-(-c // S) for _, c in seqs)
    rows, slots, qsl, at = [], [], [0], 0
    for ql, cl in seqs:
        need = -(-cl // S)
        rows.append(perm[at:at + need] + [0] * (m - need))
        at += need
        slots.extend(rows[-1][p // S] * S + p % S for p in range(cl - ql, cl))
        qsl.append(qsl[-1] + ql)
    tables = torch.tensor(rows, dtype=torch.int32, device=DEV)
    old = torch.tensor([r[p // S] * S + p % S for r, (ql, cl) in zip(rows, seqs) for p in range(cl - ql)],
                       dtype=torch.int64, device=DEV)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), block_tables=tables,
        context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        query_lens_cpu=[q for q, _ in seqs], context_lens_cpu=[c for _, c in seqs],
        max_query_len=max(q for q, _ in seqs), max_context_len=max(c for _, c in seqs),
        num_decode_seqs=num_decode_seqs)
    ref = TorchAttentionBackend()
    if len(old):  # the context written by earlier steps
        ctx_meta = AttentionMetadata(slot_mapping=old, block_tables=tables, context_lens=meta.context_lens,
                                     query_start_loc=meta.query_start_loc, query_lens_cpu=[], context_lens_cpu=[],
                                     max_query_len=0, max_context_len=0)
        ref.store_kv(*(torch.randn(len(old), hkv, d, generator=gen).to(qd).to(DEV) for _ in range(2)), kc, vc,
                     ctx_meta)
    t = qsl[-1]
    q = (torch.randn(t, hkv * group, d, generator=gen) * q_scale).to(qd).to(DEV)
    k, v = (torch.randn(t, hkv, d, generator=gen).to(qd).to(DEV) for _ in range(2))
    ref.store_kv(k, v, kc, vc, meta)
    return meta, q, k, v, kc, vc


def _kernel(meta, q, kc, vc, scale, **mods):
    return prefill.paged_prefill(q, kc, vc, meta.block_tables, meta.context_lens, meta.query_start_loc, scale,
                                 max_query_len=meta.max_query_len, **mods)


def _close(got, want, dtype, tol=None):
    tol = tol or TOL.get(dtype, 2e-5)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_prefill_matches_reference(kv_dtype, group, head_dim):
    """Several sequences in one launch: an empty context, chunks over cached context, one token; GQA; head
    dims a power of two and not; every KV dtype (a quantised cache read row by row with its scales)."""
    meta, q, k, v, kc, vc = _step(SEQS, 2, group, head_dim, kv_dtype, seed=group * 10 + head_dim)
    scale = head_dim ** -0.5
    want = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    got = _kernel(meta, q, kc, vc, scale)
    assert got.dtype == q.dtype
    _close(got, want, q.dtype)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_prefill_quantised_cache_with_16bit_queries(q_dtype):
    """A 16-bit model over an int8 cache: rows dequantised in float32, rounded to the queries' dtype, then
    16-bit products (on a GPU; bfloat16 goes through float32 in the interpreter)."""
    meta, q, k, v, kc, vc = _step(SEQS, 2, 2, 64, torch.int8, seed=4, q_dtype=q_dtype)
    want = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125, window=20)
    got = _kernel(meta, q, kc, vc, 0.125, window=20)
    assert got.dtype == q_dtype
    _close(got, want, q_dtype)


MODS = {
    "window": dict(window=20),  # SEQS' chunks of 7 and 24 cross the window's edge, the prompt of 19 does not
    "window_short": dict(window=5),  # shorter than a tile of queries and than a cache block
    "softcap": dict(softcap=4.0),
    "sinks": dict(sinks=True),
    "all": dict(window=20, softcap=4.0, sinks=True),
}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8], ids=str)
@pytest.mark.parametrize("mod", list(MODS))
def test_prefill_windows_softcaps_and_sinks_match_reference(kv_dtype, mod):
    """Each score modification alone and together (group 2), against scores.attend's and SDPA's masks; queries
    scaled so that the soft-cap bites, sinks from far below the scores to above them."""
    group, d = 2, 64
    meta, q, k, v, kc, vc = _step(SEQS, 2, group, d, kv_dtype, seed=len(mod), q_scale=3.0)
    mods = dict(MODS[mod])
    if mods.pop("sinks", False):
        mods["sinks"] = torch.linspace(-6.0, 6.0, 2 * group).to(DEV)
    scale = d ** -0.5
    want = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, scale, **mods)
    got = _kernel(meta, q, kc, vc, scale, **mods)
    # float16: scores.attend rounds the scores (here up to ~25) to float16 before its softmax, the kernel does not
    _close(got, want, q.dtype, tol=1e-2 if q.dtype == torch.float16 else None)
    plain = _kernel(meta, q, kc, vc, scale)
    assert (got.float() - plain.float()).abs().max() > 50 * TOL.get(q.dtype, 2e-5)  # the mods change the answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("tiles", [(4, 16), (16, 32), (8, 64)])
def test_prefill_tile_shapes_do_not_change_the_result(tiles, dtype):
    """Key tiles shorter and longer than a cache block, query tiles of 4 to 16 queries (group 4:
    BLOCK_Q * 4 rows), float32 products in one masked loop and 16-bit ones split into the window's edge, the
    unmasked tiles and the diagonal: the same answer, and rows of q outside every chunk are left as they were."""
    meta, q, k, v, kc, vc = _step(SEQS, 1, 4, 64, dtype, seed=5)
    want = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125, window=20)
    out = torch.full_like(q, 7.0)
    sub = slice(1, 3)  # sequences 1 and 2 only: their rows of the flat q
    qsl = meta.query_start_loc
    prefill.paged_prefill(q, kc, vc, meta.block_tables[sub], meta.context_lens[sub], qsl[1:4], 0.125,
                          max_query_len=7, out=out, window=20, tiles=tiles)
    rows = slice(int(qsl[1]), int(qsl[3]))
    _close(out[rows], want[rows], dtype)
    assert (out[:rows.start] == 7.0).all() and (out[rows.stop:] == 7.0).all()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_mixed_step_sends_prefills_to_the_kernel(kv_dtype, monkeypatch):
    """Decodes first, then prefills, in one step through the Triton backend: the reference's answer, with the
    prefill rows served by the kernel (the reference is not called)."""
    seqs = [(1, 21), (1, 48)] + SEQS
    meta, q, k, v, kc, vc = _step(seqs, 2, 3, 64, kv_dtype, seed=9, num_decode_seqs=2)
    mods = dict(window=20, softcap=4.0, sinks=torch.linspace(-2.0, 2.0, 6).to(DEV))
    want = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125, **mods)
    monkeypatch.setattr(TorchAttentionBackend, "forward", lambda *a, **kw: pytest.fail("the reference was called"))
    backend = triton_backend.TritonAttentionBackend()
    _close(backend.forward(q, k, v, kc, vc, meta, 0.125, **mods), want, q.dtype)
    prefill_only = _step(SEQS, 2, 3, 64, kv_dtype, seed=9)
    monkeypatch.undo()
    want = TorchAttentionBackend().forward(*prefill_only[1:], prefill_only[0], 0.125)
    monkeypatch.setattr(TorchAttentionBackend, "forward", lambda *a, **kw: pytest.fail("the reference was called"))
    meta, q, k, v, kc, vc = prefill_only
    _close(backend.forward(q, k, v, kc, vc, meta, 0.125), want, q.dtype)


def test_prefill_refuses_a_query_that_does_not_fit_the_cache():
    meta, q, k, v, kc, vc = _step(SEQS[:1], 2, 2, 64, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="does not fit"):
        _kernel(meta, q[..., :32].contiguous(), kc, vc, 0.125)
