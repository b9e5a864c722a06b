"""measure/local_hardware.py hands the engine's own measurers to the pure probe: the full probe."""

import json

import torch

from servescope.analysis import probe
from servescope.analysis.hardware import get_hardware
from servescope.measure import local_hardware


def test_probe_local_cpu_measures_the_engine_and_caches_the_full_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # tiny sizes for the pure part; the engine's measurers run as they do for `servescope hardware probe`
    spec = local_hardware.probe_local_cpu(bandwidth_bytes=4 * 2**20, matmul_size=64, runs=1)
    # the engine's host work, measured on a tiny model: some microseconds per layer, not seconds
    assert 1e-7 < spec.layer_overhead_s < 5e-3 and 0 <= spec.step_overhead_s < 0.05
    assert 0 <= spec.seq_overhead_s < 5e-3  # and per sequence of the step: microseconds
    assert set(spec.linear_rates) == {"float32", "bfloat16"}
    stored = json.loads((tmp_path / "servescope" / "hardware.json").read_text())
    assert list(stored) == [probe._cache_key(torch.get_num_threads())]
    # what the engine measured is what analysis reads back, and what every name for it resolves to
    monkeypatch.setattr(probe, "measure_read_bandwidth", lambda *a, **k: AssertionError("re-probed"))
    assert get_hardware("local-cpu") == spec
    assert local_hardware.resolve_hardware("cpu") == spec
    assert local_hardware.hardware_for_device(torch.device("cpu")) == spec
    assert local_hardware.hardware_for_device(torch.device("cpu"), "h100").name == "H100-SXM"
