"""Every CPU kernel path, checked here whatever this machine is: the dispatcher's choice for given CPU
flags, a clear error for a forced path the CPU lacks, and kernels_check.cpp (each kernel against a
float64 reference, no torch) compiled for every ISA: run natively where the CPU can, compiled only
where it cannot, and for aarch64 cross-compiled and run under qemu-aarch64 (Debian's
g++-aarch64-linux-gnu and qemu-user, which `make test` installs where it can)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

import background_jobs  # tests/, on sys.path (tests/conftest.py's folder)

from servescope.analysis.cpu_isa import (cpu_flags, has_fast_bf16, isa_signature, library_caps, machine_arch,
                                         onednn_allows_bf16, select_isa, supported_isas)
from servescope.errors import InvalidParameterError
from servescope.kernels.cpu.extension import CpuExtension, isa_cflags

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "src" / "servescope" / "kernels" / "cpu" / "csrc"
CHECK = Path(__file__).with_name("kernels_check.cpp")
AVX512 = {"avx512f", "avx512bw", "avx512vl", "fma", "avx2"}
ZEN3 = {"avx2", "fma", "f16c", "sse4_2"}
# -O1: a third less compile time than -O2 for the same checks
COMMON = ["-O1", "-std=c++17", "-ffp-contract=off", f"-I{CSRC}"]


@pytest.mark.parametrize("flags, arch, best", [
    (AVX512 | {"avx512_bf16"}, "x86_64", "avx512"),
    (ZEN3, "x86_64", "avx2"),
    ({"avx2"}, "x86_64", "scalar"),  # AVX2 without FMA: no vector path
    ({"avx512f", "fma", "avx2"}, "x86_64", "avx2"),  # AVX-512 F without BW/VL (Knights Landing)
    ({"fp", "asimd", "asimddp"}, "aarch64", "neon"),
    (set(), "riscv64", "scalar"),
    (AVX512, "aarch64", "scalar"),  # x86 flags on an ARM machine mean nothing
])
def test_dispatcher_picks_the_best_path(flags, arch, best):
    assert select_isa(flags, arch) == best
    assert supported_isas(flags, arch)[0] == best and supported_isas(flags, arch)[-1] == "scalar"


def test_forcing_a_path_the_cpu_lacks_is_a_clear_error():
    with pytest.raises(InvalidParameterError, match="lacks avx512bw, avx512f, avx512vl; it can run avx2, scalar"):
        select_isa(ZEN3, "x86_64", "avx512")
    with pytest.raises(InvalidParameterError, match="neon"):
        select_isa(ZEN3, "x86_64", "neon")
    with pytest.raises(InvalidParameterError, match="not a CPU kernel path"):
        select_isa(ZEN3, "x86_64", "sse9")
    assert select_isa(AVX512, "x86_64", " AVX2 ") == "avx2"  # a path the CPU has can be forced
    assert select_isa(ZEN3, "x86_64", "scalar") == "scalar"


def test_extension_refuses_a_forced_path_before_building(monkeypatch):
    lacking = next(isa for isa in ("neon", "avx512", "avx2") if isa not in supported_isas(cpu_flags(), machine_arch()))
    monkeypatch.setenv("SERVESCOPE_CPU_ISA", lacking)
    ext = CpuExtension("servescope_never_built", "cpu_ops.cpp", "test extension")
    with pytest.raises(InvalidParameterError, match=lacking):
        ext.load()
    assert ext.mod is None


def test_a_background_build_leaves_its_error_to_the_callers_load(monkeypatch):
    """cpu_ops.load_in_background (an engine starts the first build before it loads weights): a bad
    forced path is not swallowed, the next load() raises it and nothing is marked built."""
    lacking = next(isa for isa in ("neon", "avx512", "avx2") if isa not in supported_isas(cpu_flags(), machine_arch()))
    monkeypatch.setenv("SERVESCOPE_CPU_ISA", lacking)
    ext = CpuExtension("servescope_never_built", "cpu_ops.cpp", "test extension")
    ext.load_in_background()
    for t in threading.enumerate():
        if t.name == "build-servescope_never_built":
            t.join(timeout=60)
    with pytest.raises(InvalidParameterError, match=lacking):
        ext.load()
    assert ext.mod is None and not ext._tried


def test_cflags_and_signature_follow_the_flags():
    assert "-mavx512bf16" in isa_cflags("avx512", AVX512 | {"avx512_bf16"})
    assert "-mavx512bf16" not in isa_cflags("avx512", AVX512)
    assert not any("512" in f for f in isa_cflags("avx2", AVX512 | {"avx512_bf16"}))
    assert isa_cflags("neon", {"asimd", "asimddp"})[-1] == "-march=armv8.2-a+dotprod"
    # Zen 3 and Zen 4 share a CPU name; their cache keys must differ
    assert isa_signature(ZEN3, "avx2") != isa_signature(AVX512 | {"avx512_bf16"}, "avx512")
    assert not has_fast_bf16(ZEN3) and has_fast_bf16({"avx512_bf16"}) and has_fast_bf16({"bf16", "asimd"})


def test_a_onednn_cap_below_bf16_makes_bfloat16_slow():
    """torch multiplies bfloat16 through oneDNN: capped below AVX512_CORE_BF16 it emulates them (2.5 GFLOP/s
    against 174 uncapped, measured on a Zen 4 with ONEDNN_MAX_CPU_ISA=AVX2), so auto must not pick it."""
    assert onednn_allows_bf16({}) and onednn_allows_bf16({"ONEDNN_MAX_CPU_ISA": "ALL"})
    assert onednn_allows_bf16({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"})
    assert onednn_allows_bf16({"DNNL_MAX_CPU_ISA": "avx512_core_bf16"})
    assert not onednn_allows_bf16({"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not onednn_allows_bf16({"DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI"})
    assert onednn_allows_bf16({"ONEDNN_MAX_CPU_ISA": "no-such-level"})  # oneDNN ignores it too
    assert library_caps({}) == "" and library_caps({"ATEN_CPU_CAPABILITY": " "}) == ""
    assert library_caps({"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}) == \
        "ATEN_CPU_CAPABILITY=avx2,MKL_ENABLE_INSTRUCTIONS=avx2"


def _jobs() -> dict:
    """Every kernels_check build this machine can make: {name: (command without -o, run it?, runner)}."""
    # the NEON build first: its run under qemu (one core) overlaps the x86 builds
    jobs = {}
    native = machine_arch() in ("aarch64", "arm64")
    cross = shutil.which("g++") if native else shutil.which("aarch64-linux-gnu-g++")
    qemu = None if native else shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if cross and (native or qemu):
        # the baseline every aarch64 CPU has (the kernels use no dotprod / bf16 instructions yet)
        jobs["neon"] = ([cross, *COMMON, "-DSERVESCOPE_ISA_NEON", "-march=armv8-a", "-static", CHECK], True,
                        [qemu] if qemu else [])
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler and machine_arch() in ("x86_64", "amd64"):
        for isa in ("avx512", "avx2", "scalar"):
            runnable = isa in supported_isas(cpu_flags(), machine_arch())
            flags = cpu_flags() if runnable else AVX512 | {"avx512_bf16"}
            # run natively where this CPU has the ISA, else compile (the path is at least built)
            jobs[isa] = ([compiler, *COMMON, *isa_cflags(isa, flags), CHECK] + ([] if runnable else ["-c"]),
                         runnable, [])
    return jobs


JOBS = _jobs()
# each build compiled, then run where it can, in the background while the tests before these run
# (tests/background_jobs.py); the NEON build first, its qemu run being the longest
for _name, (_cmd, _runnable, _runner) in JOBS.items():
    _exe = background_jobs.workdir() / f"isa_paths-{_name}"
    background_jobs.register(f"isa_paths/{_name}", [[*_cmd, "-o", _exe]] + ([[*_runner, _exe]] if _runnable else []),
                             __name__)


def _checked(name: str) -> str:
    """The output of the kernels check build `name` (compiled, and run where it can: every check ok)."""
    compiled, *ran = background_jobs.result(f"isa_paths/{name}")
    assert compiled.returncode == 0, f"{' '.join(map(str, compiled.args))}\n{compiled.stderr[-3000:]}"
    if not JOBS[name][1]:
        return ""
    (r,) = ran
    assert r.returncode == 0 and " ok: " in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    return r.stdout


def test_aarch64_kernels_under_qemu():
    """The NEON path, cross-compiled and run under user-mode qemu (or natively on an ARM machine)."""
    if "neon" not in JOBS:
        pytest.skip("aarch64 check needs g++-aarch64-linux-gnu and qemu-user (apt-get install qemu-user "
                    "g++-aarch64-linux-gnu; `make test` installs them where it runs as root)")
    assert _checked("neon").startswith("neon ok")


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_x86_kernels_against_float64(isa):
    """Run natively where this CPU has the ISA, else compile (the path is at least built)."""
    if machine_arch() not in ("x86_64", "amd64"):
        pytest.skip("x86 paths are checked on x86 machines (this one is %s)" % machine_arch())
    if isa not in JOBS:
        pytest.skip("no C++ compiler here")
    out = _checked(isa)
    if JOBS[isa][1]:
        assert out.startswith(isa)
