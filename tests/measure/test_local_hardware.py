"""measure/local_hardware.py hands the engine's own measurers to the pure probe: the full probe."""

import dataclasses
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
    assert list(stored) == [probe.cache_key(torch.get_num_threads())]
    # what the engine measured is what analysis reads back, and what every name for it resolves to
    monkeypatch.setattr(probe, "measure_read_bandwidth", lambda *a, **k: AssertionError("re-probed"))
    assert get_hardware("local-cpu") == spec
    assert local_hardware.resolve_hardware("cpu") == spec
    assert local_hardware.hardware_for_device(torch.device("cpu")) == spec
    assert local_hardware.hardware_for_device(torch.device("cpu"), "h100").name == "H100-SXM"


def test_the_local_link_entry_holds_the_step_collectives(tmp_path, monkeypatch):
    """local_gloo_link measures the all-reduce and the step's other collectives once and caches both in one entry;
    an entry cached before those were measured gets them added, its all-reduce fit kept."""
    from servescope.analysis.collectives import cached_local_link, save_local_link
    from servescope.analysis.link_fit import fit_link
    from servescope.engine.hardware import local_link_key

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(local_hardware, "measure_all_reduce",
                        lambda: calls.append("ar") or {8192: 1e-4, 1 << 20: 1e-3, 1 << 24: 2e-2})
    step = {"all_to_all": {0: 2e-4, 1 << 20: 1.2e-3, 1 << 24: 1.7e-2}, "all_gather": {8: 3e-4, 1 << 20: 1.4e-3},
            "plan": {80: 6e-4}, "desync": {1 << 25: 0.05}}
    monkeypatch.setattr(local_hardware, "measure_step_collectives", lambda: calls.append("a2a") or step)
    link = local_hardware.local_gloo_link()
    assert calls == ["ar", "a2a"] and link.a2a_bandwidth > 0 and link.max_segment_bytes
    assert link.ag_bandwidth > 0 and link.plan_s > 0 and link.desync == 0.05
    assert local_hardware.local_gloo_link() == link and calls == ["ar", "a2a"]  # read back, not measured again
    assert cached_local_link(local_link_key()) == link
    older = fit_link({8192: 2e-4, 1 << 20: 2e-3, 1 << 24: 3e-2}, 2)  # none of the step's collectives in it
    save_local_link(local_link_key(), older)
    completed = local_hardware.local_gloo_link()
    assert calls[-1] == "a2a" and calls.count("ar") == 1
    assert completed.bandwidth == older.bandwidth and completed.a2a_bandwidth == link.a2a_bandwidth
    assert completed.plan_s == link.plan_s
    assert local_hardware.local_gloo_link(measure=False) == completed
    # an entry from before the ranks' spread was measured: the step's collectives measured again, with it
    save_local_link(local_link_key(), dataclasses.replace(completed, desync=0.0))
    assert local_hardware.local_gloo_link().desync == 0.05 and calls.count("a2a") == 3


def test_an_expert_parallel_engine_keeps_the_probe_without_a_kernel_table(monkeypatch):
    """Its sparse blocks run collectives, and a table times a whole block where each rank runs 1/N of it: the
    probe's rates price it (as a tensor-parallel engine's)."""
    from types import SimpleNamespace

    from servescope.analysis.hardware import LOCAL_CPU

    def timed(*a, **k):
        raise AssertionError("the kernels were timed")

    monkeypatch.setattr(local_hardware, "kernel_table_for", timed)
    monkeypatch.setattr(local_hardware.cpu_ops, "available", lambda: True)
    used = []
    predictor = SimpleNamespace(tp=1, pp=1, ep=2)
    cost = SimpleNamespace(predictor=predictor, hw=SimpleNamespace(name=LOCAL_CPU), use_hardware=used.append)
    engine = SimpleNamespace(step_cost_predictor=cost, device=torch.device("cpu"))
    assert local_hardware.with_kernel_table(engine) is engine and not used


def test_the_local_spec_records_whether_bfloat16_rows_take_the_integer_gemm(tmp_path, monkeypatch):
    """This build's kernels' route for bfloat16 rows of packed weights is recorded by the probe beside its
    measurements (and read back with the cached spec), and the cost model's integer peak follows it
    (analysis/cost_model.integer_gemm_flops)."""
    from servescope.engine import hardware

    for route in (True, False):
        monkeypatch.setattr(hardware, "panel_gemm_takes_rows", lambda: route)
        assert hardware.kernel_routes()["packed_gemm_bfloat16"] is route
        spec = probe.probe_local_hardware(cache_path=tmp_path / f"hw-{route}.json", bandwidth_bytes=2**20,
                                          matmul_size=64, runs=1, **hardware.kernel_routes())
        assert spec.packed_gemm_bfloat16 is route
        assert probe.probe_local_hardware(cache_path=tmp_path / f"hw-{route}.json") == spec
