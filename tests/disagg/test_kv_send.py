"""The KV send path's pieces: one contiguous gather and its inverse (engine/kv_transfer.py), the probe that times
the path between two processes by part, and its latency + bytes / bandwidth fit (measure/kv_send.py)."""

import pytest
import torch

from servescope.engine.kv_transfer import BufferPool, gather_blocks, scatter_blocks
from servescope.measure import kv_send
from servescope.measure.kv_send import PARTS, fit_kv_send, measure_kv_send


def _caches(layers=3, pool=8, fill=True):
    make = torch.randn if fill else torch.zeros
    return [(make(pool, 4, 2, 3), make(pool, 4, 2, 3)) for _ in range(layers)]


def test_gather_is_one_contiguous_tensor_and_scatter_puts_it_back():
    src, dst = _caches(), _caches(fill=False)
    blocks = [5, 1, 6]
    kv = gather_blocks(src, blocks)
    assert kv.shape == (3, 2, 3, 4, 2, 3) and kv.is_contiguous()
    for layer, (k, v) in enumerate(src):
        for i, b in enumerate(blocks):
            assert torch.equal(kv[layer, 0, i], k[b]) and torch.equal(kv[layer, 1, i], v[b])
    scatter_blocks(dst, [0, 2, 4], kv)
    assert torch.equal(gather_blocks(dst, [0, 2, 4]), kv)
    untouched = [1, 3, 5, 6, 7]
    assert all(not k[untouched].any() and not v[untouched].any() for k, v in dst)
    assert gather_blocks(src, []).shape == (3, 2, 0, 4, 2, 3)


def test_the_fit_recovers_latency_and_bandwidth():
    latency, bandwidth = 1.5e-3, 2e9
    measured = {b: {**{p: 0.0 for p in PARTS}, "total": latency + b / bandwidth} for b in (5e5, 2e6, 8e6, 3e7)}
    link = fit_kv_send(measured)
    assert link.latency_s == pytest.approx(latency) and link.bandwidth == pytest.approx(bandwidth)
    assert link.name == "local-gloo" and "gather" in link.notes
    with pytest.raises(ValueError, match="two sizes"):
        fit_kv_send({5e5: measured[5e5]})


@pytest.mark.timeout(300)
def test_the_probe_times_every_part_at_every_size():
    measured = measure_kv_send(counts=(1, 4), runs=2)
    block = kv_send.LAYERS * 2 * torch.Size(kv_send.BLOCK_SHAPE).numel() * kv_send.DTYPE.itemsize
    assert sorted(measured) == [block, 4 * block]
    for parts in measured.values():
        assert set(parts) == {*PARTS, "total"} and all(parts[p] > 0 for p in PARTS)
        assert parts["total"] >= parts["bytes"]
    assert fit_kv_send(measured).bandwidth > 0


def test_the_pool_reuses_a_buffer_and_keeps_no_more_than_it_may():
    pool = BufferPool(keep_bytes=1000)
    a = pool.take((10, 4), torch.float32)  # 160 bytes
    assert a.shape == (10, 4) and a.dtype == torch.float32
    pool.give(a)
    b = pool.take((2, 10), torch.bfloat16)  # 40 bytes: fits in a's buffer
    assert b.data_ptr() == a.data_ptr()
    c = pool.take((2, 10), torch.bfloat16)  # a's buffer is lent: a new one
    assert c.data_ptr() != b.data_ptr()
    pool.give(b)
    pool.give(c)
    pool.give(torch.zeros(3))  # not lent by the pool: ignored
    assert pool.spare_bytes == 160 + 40
    big = pool.take((300,), torch.float32)  # 1200 bytes: more than the pool keeps
    pool.give(big)
    assert pool.spare_bytes <= 1000
    assert pool.take((0, 3), torch.float32).numel() == 0


def test_gather_into_a_given_buffer_and_refuses_a_wrong_one():
    src = _caches()
    out = torch.empty(3, 2, 2, 4, 2, 3)
    assert gather_blocks(src, [4, 0], out).data_ptr() == out.data_ptr()
    assert torch.equal(out, gather_blocks(src, [4, 0]))
    with pytest.raises(ValueError, match="needs"):
        gather_blocks(src, [4], out)


def test_the_local_kv_link_is_measured_once_then_read_from_its_cache(tmp_path, monkeypatch):
    from servescope.analysis.collectives import cached_local_link, kv_send_key
    from servescope.engine.hardware import local_link_key
    from servescope.measure import local_hardware

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake(*a, **kw):
        calls.append(1)
        return {b: {**{p: 0.0 for p in PARTS}, "total": 1e-3 + b / 1e9} for b in (1e6, 1e7)}

    monkeypatch.setattr(local_hardware, "measure_kv_send", fake)
    assert local_hardware.local_kv_link(measure=False) is None
    link = local_hardware.local_kv_link()
    assert link.bandwidth == pytest.approx(1e9) and link.latency_s == pytest.approx(1e-3) and calls == [1]
    assert local_hardware.local_kv_link() == link and calls == [1]  # cached: not measured again
    assert cached_local_link(local_link_key()) is None  # its own key: the all-reduce link's stays apart
    assert cached_local_link(kv_send_key(local_link_key())) == link
    local_hardware.local_kv_link(force=True)
    assert calls == [1, 1]
