"""Every datasheet spec loads and follows the conventions; lookups are forgiving; the probe caches."""

import json

import pytest

from servescope.analysis import hardware
from servescope.analysis.hardware import DTYPES, HARDWARE_SPECS, HardwareSpec, get_hardware, list_hardware
from servescope.errors import InvalidParameterError

EXPECTED = {"A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "L4", "L40S", "RTX-4090", "MI300X"}


def test_every_spec_loads():
    assert EXPECTED <= set(HARDWARE_SPECS)
    assert "local-cpu" in list_hardware()
    for name in EXPECTED:
        hw = get_hardware(name)
        assert hw.name == name and hw.kind == "gpu"
        assert set(DTYPES) <= set(hw.peak_flops)
        assert hw.source
        # dense tensor peaks exceed fp32; int8 is at least bf16
        assert hw.flops("bfloat16") > hw.flops("float32")
        assert hw.flops("int8") >= hw.flops("bfloat16")
        assert 1e11 < hw.memory_bandwidth < 1e13
        assert 10e9 < hw.memory_bytes < 300e9
        assert 10 < hw.ridge_point("bfloat16") < 1000
        assert HardwareSpec.from_dict(hw.to_dict()) == hw


def test_datasheet_numbers():
    h100 = get_hardware("H100-SXM")
    assert h100.flops("bfloat16") == pytest.approx(989.5e12)
    assert h100.memory_bandwidth == pytest.approx(3.35e12)
    assert h100.memory_bytes == 80_000_000_000
    assert get_hardware("A100-80GB").flops("bfloat16") == pytest.approx(312e12)
    assert get_hardware("A100-40GB").memory_bandwidth == pytest.approx(1555e9)
    assert get_hardware("H200").memory_bytes == 141_000_000_000
    assert get_hardware("L40S").flops("bfloat16") == pytest.approx(362.05e12)
    assert get_hardware("MI300X").flops("float16") == pytest.approx(1307.4e12)


@pytest.mark.parametrize("alias,name", [("h100", "H100-SXM"), ("H100-sxm", "H100-SXM"), ("h100_pcie", "H100-PCIe"),
                                        ("a100", "A100-80GB"), ("rtx4090", "RTX-4090"), ("Mi300x", "MI300X"),
                                        ("l40s", "L40S"), ("h200", "H200")])
def test_aliases(alias, name):
    assert get_hardware(alias).name == name


def test_unknown_hardware_lists_known_names():
    with pytest.raises(InvalidParameterError) as e:
        get_hardware("tpu-v9")
    assert e.value.param == "hardware"
    assert "H100-SXM" in str(e.value) and "local-cpu" in str(e.value)


def test_spec_validation():
    with pytest.raises(InvalidParameterError):
        HardwareSpec(name="x", kind="tpu", peak_flops={d: 1.0 for d in DTYPES}, memory_bandwidth=1, memory_bytes=1)
    with pytest.raises(InvalidParameterError):
        HardwareSpec(name="x", kind="gpu", peak_flops={"float32": 1.0}, memory_bandwidth=1, memory_bytes=1)


# Stand-ins for the engine's measurers (measure/local_hardware.py passes the real ones; analysis/ never
# imports the engine): fixed figures, so the tests can check that they reach the spec unchanged.
_RATES = [[1, 1e9], [8, 4e9]]
FAKE_ENGINE = dict(host_overhead=lambda: (2e-4, 3e-6, 4e-5), linear_rates=lambda dt, rows=None: _RATES,
                   decode_attention_flops=lambda dt: 5e9, packed_gemm_flops=lambda: 7e9)
TINY = dict(bandwidth_bytes=4 * 2**20, matmul_size=64, runs=2)


def test_probe_measures_caches_and_forces(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from servescope.analysis import probe

    cache = tmp_path / "hardware.json"
    kw = dict(cache_path=cache, measurers=probe.EngineMeasurers(**FAKE_ENGINE), **TINY)
    spec = probe.probe_local_hardware(**kw)
    assert spec.name == "local-cpu" and spec.kind == "cpu"
    assert spec.memory_bandwidth > 1e8 and spec.flops("float32") > 1e7 and spec.flops("bfloat16") > 1e6
    assert spec.memory_bytes > 2**28
    # the engine's measurements land in the spec as measured
    assert (spec.step_overhead_s, spec.layer_overhead_s, spec.seq_overhead_s) == (2e-4, 3e-6, 4e-5)
    assert spec.linear_rates == {"float32": _RATES, "bfloat16": _RATES}
    assert spec.decode_attention_flops == {"float32": 5e9, "bfloat16": 5e9} and spec.packed_gemm_flops == 7e9
    stored = json.loads(cache.read_text())
    assert list(stored) == [probe.cache_key(probe.torch_threads())] and "threads=" in next(iter(stored))

    def boom(*a, **k):
        raise AssertionError("the cached result should have been used")

    monkeypatch.setattr(probe, "measure_read_bandwidth", boom)
    assert probe.probe_local_hardware(**kw) == spec
    with pytest.raises(AssertionError):
        probe.probe_local_hardware(force=True, **kw)


def test_probe_survives_a_failing_measurer(tmp_path):
    pytest.importorskip("torch")
    from servescope.analysis import probe

    def cannot(*a):
        raise RuntimeError("not built here")

    m = probe.EngineMeasurers(**{**FAKE_ENGINE, "decode_attention_flops": cannot, "packed_gemm_flops": cannot})
    spec = probe.probe_local_hardware(cache_path=tmp_path / "hw.json", measurers=m, **TINY)
    assert spec.decode_attention_flops == {} and spec.layer_overhead_s == 3e-6 and spec.packed_gemm_flops == 0


def test_probe_without_engine_measurers_never_stands_in_for_the_full_one(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from servescope.analysis import probe

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    pure = probe.probe_local_hardware(**TINY)
    assert pure.step_overhead_s == pure.layer_overhead_s == 0 and not pure.linear_rates
    path = tmp_path / "servescope" / "hardware.json"
    (key,) = json.loads(path.read_text())
    assert key != probe.cache_key(probe.torch_threads()) and key.endswith("|engine=none")
    assert probe.cached_local_hardware() is None
    with pytest.raises(InvalidParameterError, match="not been probed"):
        hardware.get_hardware("local-cpu")
    # a partial set is keyed by what it holds, apart from both the pure and the full probe
    part = probe.probe_local_hardware(measurers=probe.EngineMeasurers(host_overhead=FAKE_ENGINE["host_overhead"]),
                                      **TINY)
    assert part.layer_overhead_s == 3e-6 and len(json.loads(path.read_text())) == 2
    assert probe.cached_local_hardware() is None


def test_get_hardware_local_cpu_reads_the_full_probe_cache(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from servescope.analysis import probe

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    full = probe.probe_local_hardware(measurers=probe.EngineMeasurers(**FAKE_ENGINE), **TINY)
    assert (tmp_path / "servescope" / "hardware.json").is_file()
    monkeypatch.setattr(probe, "measure_read_bandwidth", lambda *a, **k: pytest.fail("re-probed"))
    assert hardware.get_hardware("local-cpu") == full
    assert hardware.get_hardware("CPU").name == "local-cpu"


def test_a_spec_cached_before_the_per_sequence_overhead_is_measured_again(tmp_path):
    pytest.importorskip("torch")
    from servescope.analysis import probe

    cache = tmp_path / "hardware.json"
    kw = dict(cache_path=cache, measurers=probe.EngineMeasurers(**FAKE_ENGINE), **TINY)
    spec = probe.probe_local_hardware(**kw)
    stored = json.loads(cache.read_text())
    (key,) = stored
    del stored[key]["seq_overhead_s"]  # as the probe wrote it before it measured the term
    cache.write_text(json.dumps(stored))
    assert probe.cached_local_hardware(cache) is None  # never read back without the term
    again = probe.probe_local_hardware(**kw)  # measured again, under the same key
    assert again.seq_overhead_s == 4e-5 and list(json.loads(cache.read_text())) == [key]
    assert probe.probe_local_hardware(**kw) == again and spec.seq_overhead_s == 4e-5
