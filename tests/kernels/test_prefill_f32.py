"""The float32 tiled causal prefill kernel (csrc/prefill_f32.h) through torch: against a float64 reference over
scattered blocks at every thread count, and as the CPU backend routes a float32 step (prompts of
TILED_F32_MIN_TOKENS or more to it, shorter ones and decodes elsewhere), against the torch reference (SDPA).
tests/kernels/kernels_check.cpp checks the kernel on every ISA path without torch (chunking invariance too)."""

from __future__ import annotations

import pytest
import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention import cpu as cpu_attention
from servescope.model.attention.backend import AttentionMetadata
from servescope.model.attention.cpu import CpuAttentionBackend
from servescope.model.attention.reference import TorchAttentionBackend

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ extension is not built here")


def _reference(q, kc, vc, table, ctx, scale):
    """float64 causal attention of q [T, H, D] (positions ctx - T ..) over the cache's first ctx positions."""
    t, h, d = q.shape
    s, hkv = kc.shape[1], kc.shape[2]
    nb = -(-ctx // s)
    keys = kc[table[:nb].long()].flatten(0, 1)[:ctx].double().repeat_interleave(h // hkv, 1)
    vals = vc[table[:nb].long()].flatten(0, 1)[:ctx].double().repeat_interleave(h // hkv, 1)
    sc = torch.einsum("thd,khd->htk", q.double(), keys) * scale
    qpos = torch.arange(ctx - t, ctx)
    sc.masked_fill_(~(torch.arange(ctx)[None, :] <= qpos[:, None])[None], float("-inf"))
    return torch.einsum("htk,khd->thd", torch.softmax(sc, -1), vals)


@pytest.mark.parametrize("d,hkv,group", [(64, 3, 3), (64, 8, 4), (128, 2, 3), (128, 1, 8), (64, 2, 1)])
@pytest.mark.parametrize("t,ctx,s", [(37, 37, 16), (100, 250, 16), (16, 16, 8), (70, 333, 32)])
def test_float32_prefill_matches_float64(d, hkv, group, t, ctx, s):
    assert cpu_ops.prefill_attention_supported(group, d, torch.float32)  # on every ISA path
    g = torch.Generator().manual_seed(t + ctx + d)
    nblocks = -(-ctx // s) + 3
    kc = 2 * torch.randn(nblocks, s, hkv, d, generator=g)
    vc = torch.randn(nblocks, s, hkv, d, generator=g)
    table = torch.randperm(nblocks, generator=g)[:-(-ctx // s) + 1].int()
    q = 2 * torch.randn(t, hkv * group, d, generator=g)
    ref = _reference(q, kc, vc, table, ctx, d ** -0.5)
    outs = []
    for threads in (1, 2, 3):  # items split by cost over the threads
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(cpu_ops.prefill_attention(q, kc, vc, table, ctx, d ** -0.5))
        finally:
            torch.set_num_threads(before)
        assert outs[-1].dtype == torch.float32 and outs[-1].shape == q.shape
        torch.testing.assert_close(outs[-1].double(), ref, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(o, outs[0]) for o in outs)  # a token's bits do not depend on the thread split


def _float32_step(seqs, block=16, hkv=2, grp=4, d=64, nblocks=160, seed=0):
    """A float32 step: seqs = [(new tokens, context after the step)], decodes first. q, k, v, caches, and a
    factory of its metadata."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(nblocks, block, hkv, d, generator=g), torch.randn(nblocks, block, hkv, d, generator=g)
    perm, used, tables, slots = torch.randperm(nblocks, generator=g), 0, [], []
    width = max(-(-c // block) for _, c in seqs)
    for n, c in seqs:
        row = perm[used:used + -(-c // block)].tolist()
        used += len(row)
        tables.append(row + [0] * (width - len(row)))
        slots += [row[p // block] * block + p % block for p in range(c - n, c)]
    t = sum(n for n, _ in seqs)
    q, k, v = (torch.randn(t, hkv * n, d, generator=g) for n in (grp, 1, 1))
    qlens, ctxs = [n for n, _ in seqs], [c for _, c in seqs]

    def meta():
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor(ctxs, dtype=torch.int32),
            query_start_loc=torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32),
            query_lens_cpu=qlens, context_lens_cpu=ctxs, max_query_len=max(qlens), max_context_len=max(ctxs),
            num_decode_seqs=sum(1 for n in qlens if n == 1))
    return q, k, v, kc, vc, meta


@pytest.mark.parametrize("isa", ["avx512", "avx2", "neon"])
def test_a_float32_step_sends_its_long_prefills_to_the_tiled_kernel(monkeypatch, isa):
    """Two decodes, a fresh 40-token prompt and a 50-token chunk after 130 cached tokens (tiled where the path
    routes them), a 9-token chunk and a 40-token one past AVX2's context limit (SDPA there); against the torch
    reference's SDPA for every token. The kernel itself is this build's (every ISA computes the same maths)."""
    monkeypatch.setattr(cpu_ops, "isa", lambda: isa)
    seqs = [(1, 30), (1, 7), (40, 40), (9, 60), (50, 180), (40, 1100)]
    q, k, v, kc, vc, meta = _float32_step(seqs)
    tiled = []
    real = cpu_ops.prefill_attention
    monkeypatch.setattr(cpu_ops, "prefill_attention", lambda *a: tiled.append((a[0].shape[0], a[4])) or real(*a))
    outs = []
    for backend in (CpuAttentionBackend(), TorchAttentionBackend()):
        kb, vb = kc.clone(), vc.clone()
        backend.store_kv(k, v, kb, vb, meta())
        outs.append(backend.forward(q, k, v, kb, vb, meta(), 64 ** -0.5))
    routed = {"avx512": [(40, 40), (50, 180), (40, 1100)], "avx2": [(40, 40), (50, 180)], "neon": []}
    assert tiled == routed[isa]
    assert cpu_attention.TILED_F32_MIN_TOKENS > 9
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
