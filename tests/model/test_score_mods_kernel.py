"""The CPU paged decode kernel with soft-capped scores (Gemma 2) and learned sinks (gpt-oss) against float64
(model/attention/scores.attend's maths), on both kernel paths (head dims 64 and 128: the register-tiled one;
48: the general one), float32 and bfloat16, an int8 cache, with and without a window, and at one sequence
(whose context is split across the threads and merged: the sinks join only the merged softmax)."""

import pytest
import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention import kv_quant

S, HKV, G = 16, 2, 4
H = HKV * G
LENS = [1, 9, 16, 33, 70, 130]

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU extension is not built here")


def _setup(d: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    m = max(-(-n // S) for n in LENS)
    n_blocks = len(LENS) * m
    kc = torch.randn(n_blocks, S, HKV, d, generator=gen) * 2  # scores of a few units: the cap bites
    vc = torch.randn(n_blocks, S, HKV, d, generator=gen)
    tables = torch.randperm(n_blocks, generator=gen).view(len(LENS), m).int()
    q = torch.randn(len(LENS), H, d, generator=gen)
    sinks = torch.randn(H, generator=gen) * 2
    return q.to(dtype), kc, vc, tables, torch.tensor(LENS, dtype=torch.int32), sinks


def _float64(q, kc, vc, tables, lens, scale, window, softcap, sinks):
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        rows = tables[b, pos // S].long() * S + pos % S
        k, v = kc.double().flatten(0, 1)[rows], vc.double().flatten(0, 1)[rows]  # [L, Hkv, D]
        for h in range(H):
            s = k[:, h // G] @ q[b, h].double() * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            if sinks is not None:
                s = torch.cat([s, sinks[h:h + 1].double()])
            p = torch.softmax(s, 0)[: len(pos)]
            out[b, h] = p @ v[:, h // G]
    return out


@pytest.mark.parametrize("d", [64, 128, 48])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [0, 23])
@pytest.mark.parametrize("softcap,with_sinks", [(5.0, False), (0.0, True), (3.0, True)])
def test_decode_with_softcap_and_sinks(d, dtype, tol, window, softcap, with_sinks):
    q, kc, vc, tables, lens, sinks = _setup(d, dtype)
    sinks = sinks if with_sinks else None
    scale = d ** -0.5
    kcd, vcd = kc.to(dtype), vc.to(dtype)
    want = _float64(q, kcd, vcd, tables, lens, scale, window, softcap, sinks)
    got = cpu_ops.paged_decode(q, kcd, vcd, tables, lens, scale, window=window, softcap=softcap, sinks=sinks)
    assert ((got.double() - want).abs() <= tol * (1 + want.abs())).all()
    one = cpu_ops.paged_decode(q[-1:], kcd, vcd, tables[-1:], lens[-1:], scale, window=window, softcap=softcap,
                               sinks=sinks)
    assert ((one.double() - want[-1:]).abs() <= tol * (1 + want[-1:].abs())).all()
    plain = cpu_ops.paged_decode(q, kcd, vcd, tables, lens, scale, window=window)
    assert (plain.double() - want).abs().max() > 20 * tol  # the modifications change the result


@pytest.mark.parametrize("d", [64, 48])
def test_decode_with_softcap_and_sinks_over_an_int8_cache(d):
    q, kc, vc, tables, lens, sinks = _setup(d, torch.float32, seed=1)
    kq, vq = (kv_quant.allocate(*kc.shape, torch.int8, torch.device("cpu")) for _ in range(2))
    slots = torch.arange(kc.shape[0] * S)
    kv_quant.store(kc.flatten(0, 1), vc.flatten(0, 1), kq, vq, slots)
    everything = torch.arange(kc.shape[0])
    kd, vd = (kv_quant.gather(c, everything, torch.float32) for c in (kq, vq))
    want = _float64(q, kd, vd, tables, lens, d ** -0.5, 0, 4.0, sinks)
    got = cpu_ops.paged_decode(q, kq, vq, tables, lens, d ** -0.5, softcap=4.0, sinks=sinks)
    assert ((got.double() - want).abs() <= 2e-5 * (1 + want.abs())).all()


def test_bad_modifications_are_refused():
    q, kc, vc, tables, lens, sinks = _setup(64, torch.float32)
    with pytest.raises(RuntimeError, match="sinks float32"):
        cpu_ops._EXT.mod.paged_decode(q, kc, vc, tables, lens, 0.125, torch.empty(0), 0, 0.0, sinks[:3])
    with pytest.raises(RuntimeError, match="softcap"):
        cpu_ops._EXT.mod.paged_decode(q, kc, vc, tables, lens, 0.125, torch.empty(0), 0, -1.0, torch.empty(0))


def test_attend_in_pieces_of_queries_equals_one_piece(monkeypatch):
    """scores.attend holds at most MAX_SCORES scores: a long chunk runs in pieces of queries, with the same
    numbers (each row's softmax is its own), with a [q, L] mask and a broadcast one alike."""
    from servescope.model.attention import scores as sc

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 8, 300, 32, generator=g), torch.randn(1, 4, 500, 32, generator=g), torch.randn(
        1, 4, 500, 32, generator=g)
    mask = torch.arange(500)[None] <= torch.arange(200, 500)[:, None]  # [q, L]: the chunk's causal rows
    sinks = torch.randn(8, generator=g)
    whole = [sc.attend(q, k, v, 0.2, m, 30.0, s) for m, s in ((mask, sinks), (mask[None, None], None))]
    monkeypatch.setattr(sc, "MAX_SCORES", 8 * 500 * 37)  # pieces of 37 queries
    pieces = [sc.attend(q, k, v, 0.2, m, 30.0, s) for m, s in ((mask, sinks), (mask[None, None], None))]
    for a, b in zip(whole, pieces):
        assert torch.equal(a, b)
