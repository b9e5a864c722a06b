"""The packed-weight kernels on every ISA path, torch-free (packed_check.cpp: quant_gemv_check.cpp's GEMV
orders, AMX panels, prefill GEMM and dequantisation against float64, and moe_experts_check.cpp's fused MoE
op bit for bit with the reference's order of operations, in one program so that each build compiles the
kernels once): plain C++ (scalar); AVX2 and AVX-512 with and without their VNNI dot products where this CPU
runs them (compiled only where it does not), AVX-512 with AMX-INT8 tiles (the VNNI kernels too where the
kernel refuses the tiles); NEON with and without dotprod, cross-compiled and run under qemu where
g++-aarch64-linux-gnu and qemu-user are installed."""

import os
import re
import shutil

import pytest

import background_jobs  # tests/, on sys.path (tests/conftest.py's folder)
from servescope.analysis.cpu_isa import cpu_flags, machine_arch, supported_isas
from servescope.kernels.cpu.extension import ISA_CFLAGS

HERE = os.path.dirname(__file__)
CSRC = os.path.join(HERE, "..", "..", "src", "servescope", "kernels", "cpu", "csrc")
SRC = os.path.join(HERE, "packed_check.cpp")
X86 = {"avx512": "-mavx512vnni", "avx2": "-mavxvnni"}  # the path's int8 dot-product flag
X86_FLAG = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}


def isa_jobs(src: str = SRC) -> dict:
    """Every build of the check program `src` this machine can make: {name: (command without -o, how to run
    it or None, int8 dot)}."""
    def cmd(cxx, flags):
        return [cxx, "-std=c++17", "-O1", *flags, "-I", CSRC, src]  # -O1: as test_isa_paths, a third less compile

    # the NEON builds first: their runs under qemu (one core each, seconds) overlap the x86 builds
    jobs, gxx = {}, shutil.which("g++")
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx and qemu:
        for arch in ("armv8.2-a+dotprod", "armv8-a"):
            jobs[f"neon-{arch}"] = (cmd(cxx, [f"-march={arch}", "-DSERVESCOPE_ISA_NEON"]),
                                    (qemu, "-L", "/usr/aarch64-linux-gnu"), "dotprod" in arch)
    if gxx:
        jobs["scalar"] = (cmd(gxx, ["-DSERVESCOPE_ISA_SCALAR"]), (), None)
    if gxx and machine_arch() in ("x86_64", "amd64"):
        for isa in ("avx512", "avx2"):
            for vnni in (True, False):
                flags = [f"-DSERVESCOPE_ISA_{isa.upper()}", *ISA_CFLAGS[isa]] + ([X86[isa]] if vnni else [])
                runnable = (isa in supported_isas(cpu_flags(), machine_arch())
                            and (not vnni or X86_FLAG[isa] in cpu_flags()))
                jobs[f"{isa}-{vnni}"] = (cmd(gxx, flags), () if runnable else None, vnni)
        amx = ["-DSERVESCOPE_ISA_AVX512", *ISA_CFLAGS["avx512"], X86["avx512"], "-mamx-tile", "-mamx-int8",
               "-mamx-bf16", "-mavx512bf16"]
        runnable = ("avx512" in supported_isas(cpu_flags(), machine_arch())
                    and {"amx_int8", "amx_bf16", "avx512_vnni", "avx512_bf16"} <= cpu_flags())
        jobs["avx512-amx"] = (cmd(gxx, amx), () if runnable else None, True)
    return jobs


JOBS = isa_jobs()
# each build compiled, then run where this CPU can, in the background while the tests before these run
# (tests/background_jobs.py); the NEON builds first, their qemu runs being the longest
for _name, (_cmd, _runner, _) in JOBS.items():
    _exe = background_jobs.workdir() / f"quant_isas-{_name}"
    background_jobs.register(f"quant_isas/{_name}", [[*_cmd, "-o", _exe]] + ([[*_runner, _exe]] if _runner is not None
                                                                            else []), __name__)


def check_build(name, jobs=JOBS):
    """The build `name` of `jobs` compiled, and run where this CPU can: it must print bad=0 (and its int8_dot)."""
    if name not in jobs:
        pytest.skip(f"{name}: no compiler for it here (g++, or g++-aarch64-linux-gnu and qemu-user)")
    compiled, *ran = background_jobs.result(f"quant_isas/{name}")
    assert compiled.returncode == 0, f"{' '.join(map(str, compiled.args))}\n{compiled.stderr[-3000:]}"
    _, runner, int8_dot = jobs[name]
    if runner is None:  # compiled only: this CPU lacks the ISA
        return ""
    (out,) = ran
    assert out.returncode == 0 and re.search(r"\bbad=0\b", out.stdout), out.stdout + out.stderr
    if int8_dot is not None:
        assert f"int8_dot={int(int8_dot)}" in out.stdout, out.stdout
    return out.stdout


@pytest.mark.parametrize("arch", ["armv8.2-a+dotprod", "armv8-a"], ids=["dotprod", "plain"])
def test_neon_path_under_qemu(arch):
    check_build(f"neon-{arch}")


def test_avx512_amx_path():
    """The AMX-INT8 and AMX-BF16 kernels beside the VNNI ones; where the CPU has the tiles they must also run."""
    if machine_arch() not in ("x86_64", "amd64"):
        pytest.skip("x86 paths need an x86 g++")
    out = check_build("avx512-amx")
    if "amx_int8" in cpu_flags() and JOBS["avx512-amx"][1] is not None:
        assert "amx=1" in out and "amx_bf16=1" in out, out


def test_scalar_path():
    check_build("scalar")


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "no-vnni"])
def test_x86_paths(isa, vnni):
    if machine_arch() not in ("x86_64", "amd64"):
        pytest.skip("x86 paths need an x86 g++")
    check_build(f"{isa}-{vnni}")
