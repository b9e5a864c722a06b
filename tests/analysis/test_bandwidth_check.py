"""analysis/bandwidth.py: a cached probe is read with a spot check of the read bandwidth beside it, and the
memory-bound terms follow the spot check where the two disagree beyond the tolerance."""

import json
import math

import pytest

from servescope.analysis import bandwidth
from servescope.analysis.bandwidth import TOLERANCE, bandwidth_origin, checked_spec, rescaled_seconds
from servescope.analysis.cost_model import step_cost
from servescope.analysis.kernel_table import KernelTable
from servescope.analysis.spec import HardwareSpec
from .test_kernel_table import CFG, table_dict

GB = 1e9
PEAKS = {"float32": 100e9, "bfloat16": 200e9, "float16": 200e9, "int8": 200e9}
# weight bytes/s of a linear kernel: at 1 row a GEMV near the bandwidth, at 512 rows a GEMM far below it
RATES = {"bfloat16": [[1, 24 * GB], [512, 1 * GB]]}


def cached_spec(bw=30 * GB, **kw) -> HardwareSpec:
    return HardwareSpec(name="local-cpu", kind="cpu", peak_flops=PEAKS, memory_bandwidth=bw, memory_bytes=2**34,
                        step_overhead_s=1e-4, layer_overhead_s=2e-6, linear_rates=RATES,
                        decode_attention_flops={"bfloat16": 5e9}, packed_gemm_flops=7e9, **kw)


def test_a_spot_check_far_off_the_cached_bandwidth_prices_the_memory_bound_terms():
    cached = cached_spec()
    spec = checked_spec(cached, 60 * GB)
    assert spec.memory_bandwidth == 60 * GB
    assert (spec.probed_bandwidth, spec.spot_bandwidth) == (30 * GB, 60 * GB)  # both figures reported
    # the GEMV's rate was 80% bandwidth: that share halves in time; the GEMM's was 1/30 of it: it barely moves
    (m1, r1), (m512, r512) = spec.linear_rates["bfloat16"]
    assert (m1, m512) == (1, 512)
    t1, m1_ = 1 / (24 * GB), 1 / (30 * GB)
    assert 1 / r1 == pytest.approx(math.sqrt(t1**2 - m1_**2 + (m1_ / 2) ** 2)) and 1 / r1 < t1
    assert r512 == pytest.approx(1 * GB, rel=0.02) and r512 > 1 * GB
    # compute-bound terms stay as cached
    for field in ("peak_flops", "decode_attention_flops", "packed_gemm_flops", "step_overhead_s",
                  "layer_overhead_s", "memory_bytes"):
        assert getattr(spec, field) == getattr(cached, field)
    assert "spot check's 60.0 GB/s" in bandwidth_origin(spec) and "30.0 GB/s" in bandwidth_origin(spec)
    # and a slower machine now: the decode step's prediction grows with it
    slow = checked_spec(cached, 15 * GB)
    t = lambda hw: step_cost(CFG, [(1, 100)], hw, "bfloat16").predicted_seconds  # noqa: E731
    assert t(slow) > 1.5 * t(cached) > 1.5 * t(spec)


def test_a_spot_check_within_the_tolerance_keeps_the_cached_spec():
    cached = cached_spec()
    near = 30 * GB * (1 + 0.9 * TOLERANCE)
    spec = checked_spec(cached, near)
    assert spec.memory_bandwidth == cached.memory_bandwidth and spec.linear_rates == cached.linear_rates
    assert (spec.probed_bandwidth, spec.spot_bandwidth) == (30 * GB, near)
    assert spec.replace(probed_bandwidth=0.0, spot_bandwidth=0.0) == cached
    assert "probe's cached 30.0 GB/s" in bandwidth_origin(spec) and "within 10%" in bandwidth_origin(spec)
    # no figure taken: the cached spec as it is, and nothing to report
    assert checked_spec(cached, None) == cached and checked_spec(cached, 0.0) == cached
    assert bandwidth_origin(cached) == ""


def test_rescaled_seconds_moves_only_the_memory_share():
    # all memory: the time follows the bandwidth
    assert rescaled_seconds(1e-3, 30e6, 30 * GB, 60 * GB) == pytest.approx(0.5e-3)
    # a tenth memory: it hides under the rest, which stays; the time barely moves
    assert rescaled_seconds(1e-3, 3e6, 30 * GB, 60 * GB) == pytest.approx(math.sqrt(0.99e-6 + 0.05e-3**2))
    assert 0.99e-3 < rescaled_seconds(1e-3, 3e6, 30 * GB, 60 * GB) < 1e-3
    # half memory: between the two
    half = rescaled_seconds(1e-3, 15e6, 30 * GB, 15 * GB)
    assert half == pytest.approx(math.sqrt(0.75e-6 + 1e-6)) and 1e-3 < half < 1.5e-3
    # more bytes than the time could read (a cached re-read): the whole time is the share, no more
    assert rescaled_seconds(1e-3, 90e6, 30 * GB, 15 * GB) == pytest.approx(2e-3)
    # an unknown bandwidth or the same one: as measured
    assert rescaled_seconds(1e-3, 30e6, 0.0, 60 * GB) == 1e-3 == rescaled_seconds(1e-3, 30e6, 30 * GB, 30 * GB)


def test_a_kernel_table_is_priced_at_the_specs_bandwidth_from_its_own():
    table = {**table_dict(), "bandwidth": 30 * GB}
    fast = cached_spec(bw=30 * GB, kernel_tables={table["key"]: table})
    slow = checked_spec(fast.replace(kernel_tables={}), 10 * GB).replace(kernel_tables={table["key"]: table})
    decode = [(1, 100)]
    at_table, at_slow = step_cost(CFG, decode, fast), step_cost(CFG, decode, slow)
    t = KernelTable.from_dict(table)
    # at the table's own bandwidth: the table's times as timed
    assert at_table.op("qkv_proj").seconds == pytest.approx(CFG.num_hidden_layers * t.linear_seconds("qkv_proj", 1))
    for name in ("qkv_proj", "attn_out_proj", "mlp", "lm_head"):
        op = at_slow.op(name)
        t0 = at_table.op(name).seconds
        share = min(t0, op.bytes / (30 * GB))
        assert op.measured and op.seconds == pytest.approx(math.sqrt(t0**2 - share**2 + (3 * share) ** 2))
    assert at_slow.predicted_seconds > at_table.predicted_seconds
    # a table without its bandwidth (timed with the spot check off) is priced as timed
    untimed = {**table, "bandwidth": 0.0}
    plain = slow.replace(kernel_tables={table["key"]: untimed})
    assert step_cost(CFG, decode, plain).op("qkv_proj").seconds == at_table.op("qkv_proj").seconds


def _write_cache(path, spec, key):
    path.write_text(json.dumps({key: spec.to_dict()}))


def test_the_probe_reads_its_cache_through_the_spot_check(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from servescope.analysis import probe

    monkeypatch.setattr(probe, "measure_read_bandwidth", lambda *a, **k: pytest.fail("re-probed"))
    cached = cached_spec().replace(memory_bytes=probe.total_memory_bytes(), seq_overhead_s=0.0)
    path = tmp_path / "hw.json"
    _write_cache(path, cached, probe.cache_key(probe.torch_threads()))
    stored = path.read_text()
    far = probe.cached_local_hardware(path, spot_check=lambda: 90 * GB)
    assert far.memory_bandwidth == 90 * GB and far.probed_bandwidth == 30 * GB
    near = probe.cached_local_hardware(path, spot_check=lambda: 31 * GB)
    assert near.memory_bandwidth == 30 * GB and near.spot_bandwidth == 31 * GB
    m = probe.EngineMeasurers(host_overhead=lambda: (0, 0, 0), linear_rates=lambda dt, rows=None: [[1, 1.0]],
                              decode_attention_flops=lambda dt: 1.0, packed_gemm_flops=lambda: 1.0)
    assert probe.probe_local_hardware(cache_path=path, measurers=m, spot_check=lambda: 90 * GB) == far
    assert path.read_text() == stored  # the cache keeps the probe's own figures
    # the default spot check is the switchable one; off (as in every other test), the cached spec as it is
    monkeypatch.setenv(bandwidth.SPOT_CHECK_ENV, "0")
    assert bandwidth.default_spot_check() is None and probe.cached_local_hardware(path) == cached
    monkeypatch.setenv(bandwidth.SPOT_CHECK_ENV, "1")
    monkeypatch.setattr(bandwidth, "spot_read_bandwidth", lambda: 10 * GB)
    assert bandwidth.default_spot_check() is not None


def test_a_cached_probe_of_a_machine_with_other_memory_is_not_used(tmp_path):
    pytest.importorskip("torch")
    from servescope.analysis import probe

    other = cached_spec().replace(memory_bytes=2 * probe.total_memory_bytes())
    path = tmp_path / "hw.json"
    _write_cache(path, other, probe.cache_key(probe.torch_threads()))
    assert probe.cached_local_hardware(path, spot_check=lambda: None) is None


def test_a_spot_check_is_the_median_of_the_recent_history(tmp_path):
    # a VM that jumps between two levels: one fast read moves the figure by one place, not to its own value
    now = [1000.0]
    h = bandwidth.BandwidthHistory(tmp_path / "bw.json", "cpu|threads=2", clock=lambda: now[0])
    assert h.add(30 * GB) == 30 * GB  # a first sample is all there is
    for b in (32, 31, 33):
        now[0] += 10
        h.add(b * GB)
    now[0] += 10
    assert h.add(62 * GB) == 32 * GB
    assert [b for _, b in h.recent()] == [30 * GB, 32 * GB, 31 * GB, 33 * GB, 62 * GB]
    # samples older than the window, or beyond the count, no longer count
    now[0] += bandwidth.HISTORY_SECONDS - 5
    assert h.add(60 * GB) == pytest.approx(61 * GB)  # only 62 and 60 are within the hour
    for _ in range(bandwidth.HISTORY_SAMPLES):
        h.add(40 * GB)
    assert len(h.recent()) == bandwidth.HISTORY_SAMPLES and h.add(90 * GB) == 40 * GB
    # another key (thread count) has its own history; a broken file is an empty one; a bad sample is refused
    assert bandwidth.BandwidthHistory(tmp_path / "bw.json", "cpu|threads=1", clock=lambda: now[0]).recent() == []
    (tmp_path / "bw.json").write_text("{not json")
    assert h.recent() == [] and h.add(20 * GB) == 20 * GB
    with pytest.raises(ValueError, match="bandwidth"):
        h.add(0.0)
    assert [b for _, b in h.recent()] == [20 * GB]


def test_the_default_spot_check_keeps_its_samples_beside_the_probe_cache(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    reads = iter([30 * GB, 60 * GB, 31 * GB])
    monkeypatch.setattr(bandwidth, "measure_read_bandwidth", lambda *a, **k: next(reads))
    monkeypatch.setattr(bandwidth, "CpuMeter", lambda: FakeMeter(0.0))  # the test machine's neighbours aside
    monkeypatch.setenv(bandwidth.SPOT_CHECK_ENV, "0")  # off: nothing sampled, nothing written
    bandwidth.record_sample(50 * GB)
    assert bandwidth.default_spot_check() is None and not (tmp_path / "servescope" / "bandwidth.json").exists()
    monkeypatch.setenv(bandwidth.SPOT_CHECK_ENV, "1")
    check = bandwidth.default_spot_check()
    assert [check(), check(), check()] == [30 * GB, 45 * GB, 31 * GB]
    assert (tmp_path / "servescope" / "bandwidth.json").exists()


class FakeMeter:
    """A CpuMeter whose window saw the rest of the machine take `others` CPUs."""

    def __init__(self, others):
        self.others = others

    def window(self):
        from servescope.analysis.busy import Window

        return Window(0.1, 2.0, self.others)


def test_a_read_on_a_busy_machine_counts_for_its_run_but_is_not_kept(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(bandwidth.SPOT_CHECK_ENV, "1")
    reads = iter([34 * GB, 36 * GB, 20 * GB, 21 * GB, 35 * GB])
    others = iter([0.0, 0.05, 1.0, 0.9, None])  # None: no /proc/stat, the read is taken as quiet
    monkeypatch.setattr(bandwidth, "measure_read_bandwidth", lambda *a, **k: next(reads))
    monkeypatch.setattr(bandwidth, "CpuMeter", lambda: FakeMeter(next(others)))
    check = bandwidth.default_spot_check()
    got = [check() for _ in range(5)]
    # the two busy reads (20, 21) each count once in their own median, and never in a later one
    assert got == [34 * GB, 35 * GB, 34 * GB, 34 * GB, 35 * GB]
    kept = [b for _, b in bandwidth.local_history().recent()]
    assert kept == [34 * GB, 36 * GB, 35 * GB]


def test_quiet_read_follows_the_rest_of_the_machine():
    from servescope.analysis.busy import Window

    assert bandwidth.quiet_read(Window(0.1, 2.0, None))
    assert bandwidth.quiet_read(Window(0.1, 2.0, bandwidth.READ_OTHERS_MAX))
    assert not bandwidth.quiet_read(Window(0.1, 2.0, bandwidth.READ_OTHERS_MAX + 0.1))
