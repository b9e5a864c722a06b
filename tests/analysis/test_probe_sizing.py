"""The probe sizes each dtype's matmul to its speed (a first run in seconds on a CPU that emulates
bfloat16), lists the slow ones, measures their linear kernel at the GEMV's rows only, and keys its
cache on the kernel path and the CPU flags."""

from __future__ import annotations

import pytest

from servescope.analysis import cpu_isa

# matmul rates of a Zen 3 (2026-12-01): float32 ~175 GFLOP/s, bfloat16 emulated at 0.3
ZEN3_RATES = {"float32": 175e9, "bfloat16": 0.3e9, "float16": 0.5e9}


@pytest.fixture
def fake_matmul(monkeypatch):
    pytest.importorskip("torch")
    from servescope.analysis import probe

    calls = []

    def fake(dtype_name, n=2048, runs=5):
        calls.append((dtype_name, n, runs))
        return ZEN3_RATES[dtype_name]

    monkeypatch.setattr(probe, "measure_matmul_flops", fake)
    return calls


def test_each_dtype_is_measured_at_a_size_its_speed_affords(fake_matmul):
    from servescope.analysis import probe

    assert probe.sized_matmul_flops("float32", 2048, 5) == (175e9, 2048)
    assert probe.sized_matmul_flops("bfloat16", 2048, 5) == (0.3e9, 256)
    # the work the probe asked of each dtype: a 2048^3 bfloat16 matmul (a minute at 0.3 GFLOP/s) never
    worst = max(2.0 * n**3 / ZEN3_RATES[dt] * runs for dt, n, runs in fake_matmul)
    assert worst < 1.0


def test_slow_dtypes_are_listed_and_their_gemm_rows_skipped(fake_matmul, tmp_path):
    from servescope.analysis import probe

    asked = []

    def rates(dt, rows=None):
        asked.append((dt, rows))
        return [[m, 1e9] for m in (rows or (1, 8))]

    m = probe.EngineMeasurers(host_overhead=lambda: (1e-4, 1e-6, 2e-5), linear_rates=rates,
                              decode_attention_flops=lambda dt: 1e9, packed_gemm_flops=lambda: 1e9)
    spec = probe.probe_local_hardware(cache_path=tmp_path / "hw.json", measurers=m, bandwidth_bytes=4 * 2**20,
                                      runs=1, kernel_path="avx2 C++ kernels")
    assert spec.slow_dtypes == ["bfloat16", "float16"] and "no fast path for bfloat16" in spec.notes
    assert asked == [("float32", None), ("bfloat16", probe.SLOW_ROWS)]
    assert spec.linear_rate("bfloat16", 8) is None  # beyond the measured rows: priced by the (slow) peak
    assert spec.kernel_path == "avx2 C++ kernels"
    # the spec, slow dtypes and kernel path included, survives the cache
    assert probe.probe_local_hardware(cache_path=tmp_path / "hw.json", measurers=m) == spec


def test_cache_key_names_the_kernel_path_and_flags(monkeypatch):
    pytest.importorskip("torch")
    from servescope.analysis import probe

    monkeypatch.setenv(cpu_isa.ENV, "scalar")
    key = probe.cache_key(2)
    assert "|isa=scalar|flags=" in key and "threads=2" in key
    monkeypatch.delenv(cpu_isa.ENV)
    assert probe.cache_key(2) != key


def test_auto_dtype_is_bfloat16_only_with_bf16_instructions(monkeypatch):
    torch = pytest.importorskip("torch")
    from servescope.analysis import cpu_isa
    from servescope.config import EngineConfig
    from servescope.engine import weights as builder

    cpu = torch.device("cpu")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert builder.resolve_dtypes(EngineConfig(dtype="auto"), cpu)[0] == torch.float32
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert builder.resolve_dtypes(EngineConfig(dtype="auto"), cpu)[0] == torch.bfloat16
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN capped below its bf16 kernels
    assert builder.resolve_dtypes(EngineConfig(dtype="auto"), cpu)[0] == torch.float32


def test_a_probe_on_a_busy_machine_is_used_but_not_cached(fake_matmul, tmp_path, monkeypatch, caplog):
    from servescope.analysis import busy, probe

    monkeypatch.setattr(busy, "BUSY_MIN_WINDOW_S", 0.0)
    monkeypatch.setattr(probe, "process_cpu_seconds", lambda: 0.0)  # other processes had the cores
    path = tmp_path / "hw.json"
    spec = probe.probe_local_hardware(cache_path=path, bandwidth_bytes=4 * 2**20, runs=1)
    assert spec.memory_bandwidth > 0 and "the machine was busy" in spec.notes
    assert "not cached" in caplog.text and not path.exists()
    calls = len(fake_matmul)
    probe.probe_local_hardware(cache_path=path, bandwidth_bytes=4 * 2**20, runs=1)
    assert len(fake_matmul) > calls  # measured again, not read back
    # on a quiet machine the same probe is cached
    monkeypatch.setattr(probe, "process_cpu_seconds", lambda: 1e9 * len(fake_matmul))
    quiet = probe.probe_local_hardware(cache_path=path, bandwidth_bytes=4 * 2**20, runs=1)
    assert "busy" not in quiet.notes and path.exists()
