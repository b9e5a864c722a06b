"""The CPU op extension (csrc/cpu_ops.cpp) against the torch references in fused_ops.py and
attention/reference.py: float32 tight, bfloat16 loose; and the engine's greedy tokens with and
without it."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from servescope.kernels import fused_ops
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention.cpu import CpuAttentionBackend
from servescope.model.attention.reference import TorchAttentionBackend

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="CPU op extension not built here")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _ref_rms_norm(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _ref_rotate(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@contextlib.contextmanager
def _torch_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _close(a, b, dtype):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("dm", [64, 576, 100])
def test_rms_norm(dtype, t, dm):
    g = torch.Generator().manual_seed(t * dm)
    x = torch.randn(t, dm, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(dm, generator=g)).to(dtype)
    _close(cpu_ops.rms_norm(x, w, 1e-5), _ref_rms_norm(x, w, 1e-5), dtype)
    # through the dispatch point
    _close(fused_ops.rms_norm(x, w, 1e-5), _ref_rms_norm(x, w, 1e-5), dtype)
    # a strided [T, H, D] view (q of a fused qkv, as qk-norm sees it)
    qkv = torch.randn(t, 3 * dm, generator=g).to(dtype)
    q = qkv[:, :dm].view(t, 4, dm // 4) if dm % 4 == 0 else qkv[:, :dm].view(t, 1, dm)
    wq = w[: q.shape[-1]].contiguous()
    _close(cpu_ops.rms_norm(q, wq, 1e-6), _ref_rms_norm(q, wq, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 5])
def test_add_rms_norm(dtype, t):
    g = torch.Generator().manual_seed(t)
    x, r = (torch.randn(t, 576, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    y, h = cpu_ops.add_rms_norm(x, r, w, 1e-5)
    href = x + r
    assert torch.equal(h, href)  # the residual stream is exact in its dtype
    _close(y, _ref_rms_norm(href, w, 1e-5), dtype)
    y2, h2 = fused_ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(y2, y) and torch.equal(h2, h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 4, 16), (6, 2, 40)])
def test_rotary_strided_from_fused_qkv(dtype, t, h, hkv, d):
    g = torch.Generator().manual_seed(h * d + t)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, h, d), k.view(t, hkv, d)
    assert t == 1 or (not q.is_contiguous() and not k.is_contiguous())
    pos = torch.randint(0, 500, (t,), generator=g).float()
    freqs = torch.outer(pos, 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    qo, ko = cpu_ops.rotary(q, k, cos, sin)
    qr, kr = _ref_rotate(q, cos, sin), _ref_rotate(k, cos, sin)
    if dtype == torch.float32:  # same operations in the same order: bit-exact
        assert torch.equal(qo, qr) and torch.equal(ko, kr)
    _close(qo, qr, dtype)
    _close(ko, kr, dtype)
    qo2, ko2 = fused_ops.rotary(q, k, cos, sin)
    assert torch.equal(qo2, qo) and torch.equal(ko2, ko)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("inner", [1536, 40])
def test_silu_mul(dtype, t, inner):
    g = torch.Generator().manual_seed(inner + t)
    gu = (3 * torch.randn(t, 2 * inner, generator=g)).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0]).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    _close(cpu_ops.silu_mul(gu), ref, dtype)
    _close(fused_ops.silu_mul(gu), ref, dtype)


def _paged_setup(dtype, b, h, hkv, d, ctx_lens, s=16, nblocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(nblocks, s, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(nblocks, s, hkv, d, generator=g).to(dtype)
    m = max((c + s - 1) // s for c in ctx_lens) + 1  # one padding column
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.zeros(b, m, dtype=torch.int32)
    used = 0
    for i, c in enumerate(ctx_lens):
        nb = (c + s - 1) // s
        tables[i, :nb] = perm[used:used + nb].int()
        used += nb
    q = torch.randn(b, h, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(ctx_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("ctx_lens", [[1], [16], [17], [100], [1, 16, 17, 100, 5]])
def test_paged_decode(dtype, group, ctx_lens):
    hkv, d = 3, 64
    h = hkv * group
    q, kc, vc, tables, lens = _paged_setup(dtype, len(ctx_lens), h, hkv, d, ctx_lens, seed=len(ctx_lens) + group)
    ref = TorchAttentionBackend._paged_decode(q, kc, vc, tables, lens, max(ctx_lens), d ** -0.5)
    out = cpu_ops.paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    _close(out, ref, dtype)
    # into a preallocated (strided) output, from a strided q
    qkv = torch.zeros(len(ctx_lens), h + 2 * hkv, d, dtype=dtype)
    qkv[:, :h] = q
    buf = torch.zeros(len(ctx_lens), h, d, dtype=dtype)
    cpu_ops.paged_decode(qkv[:, :h], kc, vc, tables, lens, d ** -0.5, out=buf)
    assert torch.equal(buf, out)


@pytest.mark.parametrize("d,hkv,group", [(64, 2, 5), (64, 1, 8), (128, 2, 4), (128, 1, 3)])
@pytest.mark.parametrize("s", [8, 16, 32])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.bfloat16)])
def test_paged_decode_register_tiled_path(d, hkv, group, s, q_dtype, cache_dtype):
    """Head dims 64 and 128 take the register-tiled kernel: head groups that do not fill a tile,
    keys split by blocks of 8 / 16 / 32 and by context lengths that end mid-block."""
    ctx_lens = [1, 15, 16, 33, 200, 47]
    q, kc, vc, tables, lens = _paged_setup(cache_dtype, len(ctx_lens), hkv * group, hkv, d, ctx_lens, s=s,
                                           nblocks=128, seed=d + s + group)
    q = q.to(q_dtype)
    ref = TorchAttentionBackend._paged_decode(q, kc, vc, tables, lens, max(ctx_lens), d ** -0.5)
    _close(cpu_ops.paged_decode(q, kc, vc, tables, lens, d ** -0.5), ref, q_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("ctx_lens,s", [([300], 16), ([5, 250], 16), ([40, 1, 130], 32), ([7], 8)])
def test_paged_decode_context_split_into_parts(dtype, threads, ctx_lens, s):
    """Fewer than two sequences per thread: each sequence's context is cut into parts (on 16-position
    boundaries, some empty) whose partial softmax sums are merged; against the reference at several
    thread counts (which change the number of parts)."""
    hkv, group, d = 3, 3, 64
    q, kc, vc, tables, lens = _paged_setup(dtype, len(ctx_lens), hkv * group, hkv, d, ctx_lens, s=s, nblocks=64,
                                           seed=threads + len(ctx_lens))
    ref = TorchAttentionBackend._paged_decode(q, kc, vc, tables, lens, max(ctx_lens), d ** -0.5)
    with _torch_threads(threads):
        out = cpu_ops.paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    _close(out, ref, dtype)


@pytest.mark.parametrize("d", [16, 40])
def test_paged_decode_other_head_dims_and_block_size(d):
    q, kc, vc, tables, lens = _paged_setup(torch.float32, 2, 4, 2, d, [70, 3], s=64, seed=d)
    ref = TorchAttentionBackend._paged_decode(q, kc, vc, tables, lens, 70, 0.3)
    _close(cpu_ops.paged_decode(q, kc, vc, tables, lens, 0.3), ref, torch.float32)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("t", [1, 5])
def test_store_kv_strided(dtype, cache_dtype, t):
    g = torch.Generator().manual_seed(t)
    hkv, d, h = 3, 64, 9
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    _, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    k, v = k.view(t, hkv, d), v.view(t, hkv, d)
    kc, vc = torch.zeros(8, 16, hkv, d, dtype=cache_dtype), torch.zeros(8, 16, hkv, d, dtype=cache_dtype)
    slots = torch.randperm(8 * 16, generator=g)[:t]
    cpu_ops.store_kv(k, v, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    kr.view(-1, hkv, d).index_copy_(0, slots, k.to(cache_dtype))
    vr.view(-1, hkv, d).index_copy_(0, slots, v.to(cache_dtype))
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_engine_greedy_tokens_match_torch_reference(tmp_path, monkeypatch):
    from servescope import LLM, SamplingParams
    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import make_tiny_hf_model


    path = make_tiny_hf_model(tmp_path, "llama", vocab_size=512, with_tokenizer=False)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run():
        # a 120-token prompt prefilled in chunks of 32 while the short ones decode: mixed steps
        llm = LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=256,
                  max_num_batched_tokens=32)
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [(i * 7) % 500 + 3 for i in range(120)]]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]

    calls = {}
    for name in ("rms_norm", "add_rms_norm", "rotary", "silu_mul", "store_kv", "paged_decode"):
        def spy(*a, _f=getattr(cpu_ops, name), _n=name, **kw):
            calls[_n] = calls.get(_n, 0) + 1
            if kw.get("out") is not None:
                calls["mixed"] = calls.get("mixed", 0) + 1
            return _f(*a, **kw)
        monkeypatch.setattr(cpu_ops, name, spy)
    with_kernels = run()
    assert set(calls) == {"rms_norm", "add_rms_norm", "rotary", "silu_mul", "store_kv", "paged_decode", "mixed"}, calls
    monkeypatch.setattr(cpu_ops._EXT, "mod", None)  # load() -> None: the torch references everywhere
    assert run() == with_kernels


def _mixed_bf16_step(seqs, block, seed, hkv=3, grp=3, d=64, nblocks=64):
    """A bfloat16 step over a paged cache: seqs = [(new tokens, context after the step)], decodes
    first. Returns q, k, v of the step's tokens, the cache and a factory of its AttentionMetadata."""
    from servescope.model.attention.backend import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    h = hkv * grp
    kc = torch.randn(nblocks, block, hkv, d, generator=g).bfloat16()
    vc = torch.randn(nblocks, block, hkv, d, generator=g).bfloat16()
    perm, used, tables, slots = torch.randperm(nblocks, generator=g), 0, [], []
    m = max(-(-c // block) for _, c in seqs)
    for n, c in seqs:
        nb = -(-c // block)
        row = perm[used:used + nb].tolist()
        used += nb
        tables.append(row + [0] * (m - nb))
        slots += [row[p // block] * block + p % block for p in range(c - n, c)]
    t = sum(n for n, _ in seqs)
    q = torch.randn(t, h, d, generator=g).bfloat16()
    k = torch.randn(t, hkv, d, generator=g).bfloat16()
    v = torch.randn(t, hkv, d, generator=g).bfloat16()

    def meta():
        qsl = [0]
        for n, _ in seqs:
            qsl.append(qsl[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_lens_cpu=[n for n, _ in seqs],
            context_lens_cpu=[c for _, c in seqs], max_query_len=max(n for n, _ in seqs),
            max_context_len=max(c for _, c in seqs), num_decode_seqs=sum(1 for n, _ in seqs if n == 1))
    return q, k, v, kc, vc, meta


def _against_sdpa(q, k, v, kc, vc, meta, d=64):
    """The step through the CPU backend (its C++ kernels), then through the torch reference (SDPA per
    prefill sequence): both outputs."""
    outs = []
    for be in (CpuAttentionBackend(), TorchAttentionBackend()):
        kb, vb = kc.clone(), vc.clone()
        be.store_kv(k, v, kb, vb, meta())
        outs.append(be.forward(q, k, v, kb, vb, meta(), d ** -0.5))
    return tuple(outs)


@pytest.mark.parametrize("block", [8, 16])
def test_bf16_prefill_tokens_through_paged_kernel_match_sdpa(monkeypatch, block):
    """bfloat16 steps with prefill tokens: every token is a query of the paged kernel (each sees its
    own sequence's keys up to its position). Against the torch path (SDPA, gathered cache) on a
    mixed step: two decodes, a fresh 37-token prompt and a 20-token chunk after 45 cached tokens."""
    seqs = [(1, 30), (1, 7), (37, 37), (20, 65)]
    q, k, v, kc, vc, meta = _mixed_bf16_step(seqs, block, seed=block)
    calls = []
    real = cpu_ops.paged_decode
    monkeypatch.setattr(cpu_ops, "paged_decode", lambda *a, **kw: calls.append(a[3].shape) or real(*a, **kw))
    ours, ref = _against_sdpa(q, k, v, kc, vc, meta)
    assert calls == [(q.shape[0], meta().block_tables.shape[1])]  # one call for every token of the step
    _close(ours, ref, torch.bfloat16)


def _causal_ref(q, kc, vc, table, ctx, scale):
    """float64 causal attention of T queries at positions ctx - T .. ctx - 1 over keys 0 .. ctx - 1."""
    t, h, d = q.shape
    s, hkv = kc.shape[1], kc.shape[2]
    nb = -(-ctx // s)
    keys = kc[table[:nb].long()].flatten(0, 1)[:ctx].double().repeat_interleave(h // hkv, 1)  # [ctx, H, D]
    vals = vc[table[:nb].long()].flatten(0, 1)[:ctx].double().repeat_interleave(h // hkv, 1)
    sc = torch.einsum("thd,khd->htk", q.double(), keys) * scale
    qpos = torch.arange(ctx - t, ctx)
    sc.masked_fill_(~(torch.arange(ctx)[None, :] <= qpos[:, None])[None], float("-inf"))
    return torch.einsum("htk,khd->thd", torch.softmax(sc, -1), vals)


@pytest.mark.skipif(not cpu_ops.prefill_attention_supported(3, 64), reason="no AVX-512 BF16 here")
@pytest.mark.parametrize("d,hkv,group", [(64, 3, 3), (64, 2, 1), (128, 2, 4), (64, 1, 2), (128, 1, 7), (64, 1, 8)])
@pytest.mark.parametrize("t,ctx,s", [(37, 37, 16), (128, 128, 16), (100, 250, 16), (16, 16, 8), (200, 333, 32)])
def test_prefill_attention_matches_float64(d, hkv, group, t, ctx, s):
    g = torch.Generator().manual_seed(t + ctx + d)
    h = hkv * group
    nblocks = -(-ctx // s) + 5
    kc = (2 * torch.randn(nblocks, s, hkv, d, generator=g)).bfloat16()  # scores of a few units: a peaked softmax
    vc = torch.randn(nblocks, s, hkv, d, generator=g).bfloat16()
    table = torch.randperm(nblocks, generator=g)[:-(-ctx // s) + 1].int()  # scattered blocks, one spare entry
    q = (2 * torch.randn(t, h, d, generator=g)).bfloat16()
    ref = _causal_ref(q, kc, vc, table, ctx, d ** -0.5)
    for threads in (1, 2, 3):  # items split by cost over the threads
        with _torch_threads(threads):
            out = cpu_ops.prefill_attention(q, kc, vc, table, ctx, d ** -0.5)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        # bfloat16 output and probabilities: SDPA's bfloat16 kernel is off by as much
        assert (out.double() - ref).abs().max().item() < 3e-2


@pytest.mark.skipif(not cpu_ops.prefill_attention_supported(3, 64), reason="no AVX-512 BF16 here")
def test_prefill_attention_rejects_what_it_cannot_do():
    kc = torch.zeros(4, 16, 1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="unsupported group"):
        cpu_ops.prefill_attention(torch.zeros(3, 9, 64).bfloat16(), kc, kc, torch.arange(4).int(), 3, 0.1)
    with pytest.raises(RuntimeError, match="block_table"):  # the table does not cover ctx
        cpu_ops.prefill_attention(torch.zeros(3, 2, 64).bfloat16(), kc, kc, torch.arange(1).int(), 20, 0.1)
    with pytest.raises(RuntimeError, match="q's dtype"):  # float32 q over a bfloat16 cache
        cpu_ops.prefill_attention(torch.zeros(3, 2, 64), kc, kc, torch.arange(4).int(), 3, 0.1)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        cpu_ops.prefill_attention(torch.zeros(3, 2, 64).half(), kc.half(), kc.half(), torch.arange(4).int(), 3, 0.1)
    assert not cpu_ops.prefill_attention_supported(9, 64) and not cpu_ops.prefill_attention_supported(2, 80)


@pytest.mark.skipif(not cpu_ops.prefill_attention_supported(3, 64), reason="no AVX-512 BF16 here")
def test_bf16_step_with_long_prefills_uses_tiled_kernel_and_matches_sdpa(monkeypatch):
    """A mixed bfloat16 step: two decodes, a 150-token prompt and a 130-token chunk after 170 cached
    tokens (tiled kernel), a 20-token chunk (per-token kernel). Against the torch path (SDPA)."""
    q, k, v, kc, vc, meta = _mixed_bf16_step([(1, 30), (1, 7), (150, 150), (20, 65), (130, 300)], 16, seed=7)
    tiled, per_token = [], []
    real_p, real_d = cpu_ops.prefill_attention, cpu_ops.paged_decode
    monkeypatch.setattr(cpu_ops, "prefill_attention", lambda *a: tiled.append(a[0].shape[0]) or real_p(*a))
    monkeypatch.setattr(cpu_ops, "paged_decode", lambda *a, **kw: per_token.append(a[0].shape[0]) or real_d(*a, **kw))
    ours, ref = _against_sdpa(q, k, v, kc, vc, meta)
    assert tiled == [150, 130] and per_token == [1 + 1 + 20]
    _close(ours, ref, torch.bfloat16)
