"""Sliding-window attention (AttentionSpec kind "sliding") in every attention path against float64: the torch
reference (decode and prefill chunks), the CPU C++ paged kernel, the Triton decode kernel (interpreted
without CUDA). The blocks wholly before a sequence's window are pointed at a block of NaN, as if freed and
reused: any path that read them would return NaN."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from servescope.kernels.cpu import ops as cpu_ops  # noqa: E402
from servescope.model.attention.backend import AttentionMetadata  # noqa: E402
from servescope.model.attention.reference import TorchAttentionBackend  # noqa: E402

S, HKV, G, D = 16, 2, 3, 64
H = HKV * G
LENS = [1, 5, 16, 17, 40, 70]
WINDOWS = [5, 16, 23, 100]


def _setup(lens, window, dtype=torch.float32, seed=0):
    """q [B, H, D], caches [N, S, Hkv, D] with block N - 1 all NaN, block tables [B, M] int32 whose entries
    before each sequence's window point at the NaN block, context lens [B] int32."""
    gen = torch.Generator().manual_seed(seed)
    m = max(-(-n // S) for n in lens)
    n_blocks = len(lens) * m + 1
    kc = torch.randn(n_blocks, S, HKV, D, generator=gen)
    vc = torch.randn(n_blocks, S, HKV, D, generator=gen)
    kc[-1] = vc[-1] = float("nan")
    order = torch.randperm(n_blocks - 1, generator=gen).tolist()
    tables = []
    for i, n in enumerate(lens):
        lo = max(0, n - window)
        row = [order[i * m + j] if (j + 1) * S > lo else n_blocks - 1 for j in range(m)]
        tables.append(row)
    q = torch.randn(len(lens), H, D, generator=gen)
    return (q.to(dtype), kc.to(dtype), vc.to(dtype), torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32))


def _float64_decode(q, kc, vc, tables, lens, window, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window), n)
        rows = tables[b, pos // S].long() * S + pos % S
        k = kc.double().flatten(0, 1)[rows]  # [L, Hkv, D]
        v = vc.double().flatten(0, 1)[rows]
        for h in range(H):
            p = torch.softmax(k[:, h // G] @ q[b, h].double() * scale, 0)
            out[b, h] = p @ v[:, h // G]
    return out


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_decode_reads_only_the_window(window):
    q, kc, vc, tables, lens = _setup(LENS, window)
    want = _float64_decode(q, kc, vc, tables, lens, window, D ** -0.5)
    got = TorchAttentionBackend._paged_decode(q, kc, vc, tables, lens, max(LENS), D ** -0.5, window=window)
    assert (got.double() - want).abs().max() < 2e-5


@pytest.mark.parametrize("window", [5, 16, 23])
@pytest.mark.parametrize("chunk", [7, 16, 40])
def test_reference_prefill_chunks_attend_over_the_window(window, chunk):
    """A 70-token prompt in chunks over the paged cache (every chunk's keys already stored) equals causal
    attention with the window band, in float64."""
    n = 70
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(n, HKV, D, generator=gen)
    v = torch.randn(n, HKV, D, generator=gen)
    q = torch.randn(n, H, D, generator=gen)
    nb = -(-n // S)
    blocks = torch.randperm(nb, generator=gen)
    kc = torch.zeros(nb, S, HKV, D)
    vc = torch.zeros(nb, S, HKV, D)
    slots = blocks.repeat_interleave(S)[:n] * S + torch.arange(n) % S
    kc.view(-1, HKV, D)[slots] = k
    vc.view(-1, HKV, D)[slots] = v
    pos = torch.arange(n)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [q, k]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(G, 1)) * D ** -0.5
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~band, -math.inf).softmax(-1),
                        v.double().repeat_interleave(G, 1))
    got = torch.empty_like(q)
    for start in range(0, n, chunk):
        qlen = min(chunk, n - start)
        meta = AttentionMetadata(
            slot_mapping=slots[start:start + qlen], block_tables=blocks[None].int(),
            context_lens=torch.tensor([start + qlen], dtype=torch.int32),
            query_start_loc=torch.tensor([0, qlen]), query_lens_cpu=[qlen], context_lens_cpu=[start + qlen],
            max_query_len=qlen, max_context_len=start + qlen, num_decode_seqs=0)
        got[start:start + qlen] = TorchAttentionBackend().forward(
            q[start:start + qlen], k[start:start + qlen], v[start:start + qlen], kc, vc, meta, D ** -0.5, window)
    assert (got.double() - want).abs().max() < 2e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_kernel_decode_reads_only_the_window(dtype, tol, window):
    if cpu_ops.load() is None:
        pytest.skip("the CPU extension is not built here")
    q, kc, vc, tables, lens = _setup(LENS, window, dtype)
    want = _float64_decode(q, kc, vc, tables, lens, window, D ** -0.5)
    got = cpu_ops.paged_decode(q, kc, vc, tables, lens, D ** -0.5, window=window)
    assert ((got.double() - want).abs() <= tol * (1 + want.abs())).all()
    # one sequence: its window is split into context parts across the threads (flash-decoding)
    got1 = cpu_ops.paged_decode(q[-1:], kc, vc, tables[-1:], lens[-1:], D ** -0.5, window=window)
    assert ((got1.double() - want[-1:]).abs() <= tol * (1 + want[-1:].abs())).all()


@pytest.mark.parametrize("window", [5, 16, 23])
def test_triton_decode_reads_only_the_window(window):
    from triton_interp import interpreted

    (attention,) = interpreted("servescope.kernels.triton.attention")
    q, kc, vc, tables, lens = _setup(LENS, window)
    want = _float64_decode(q, kc, vc, tables, lens, window, D ** -0.5)
    for splits in (1, 3):  # one partition, and split-K over the window
        got = attention.paged_decode(q, kc, vc, tables, lens, D ** -0.5, max_context_len=max(LENS),
                                     num_splits=splits, window=window)
        assert (got.double() - want).abs().max() < 2e-5, splits
