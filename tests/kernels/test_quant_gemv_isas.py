"""csrc/quant_dot.h and quant_gemv.h on every ISA path, torch-free (quant_gemv_check.cpp): plain C++
(scalar); AVX2 and AVX-512 with and without their VNNI dot products where this CPU runs them (compiled
only where it does not); NEON with and without dotprod, cross-compiled and run under qemu where
g++-aarch64-linux-gnu and qemu-user are installed."""

import os
import shutil
import subprocess

import pytest

from servescope.analysis.cpu_isa import cpu_flags, machine_arch, supported_isas
from servescope.kernels.cpu_extension import ISA_CFLAGS

HERE = os.path.dirname(__file__)
CSRC = os.path.join(HERE, "..", "..", "src", "servescope", "kernels", "csrc")
SRC = os.path.join(HERE, "quant_gemv_check.cpp")
X86 = {"avx512": "-mavx512vnni", "avx2": "-mavxvnni"}  # the path's int8 dot-product flag
X86_FLAG = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}


def _build_and_run(cxx, flags, tmp_path, runner=(), run=True, int8_dot=None):
    exe = str(tmp_path / "check")
    r = subprocess.run([cxx, "-std=c++17", "-O2", *flags, "-I", CSRC, SRC, "-o", exe], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    if not run:
        return
    out = subprocess.run([*runner, exe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "bad=0" in out.stdout, out.stdout + out.stderr
    if int8_dot is not None:
        assert f"int8_dot={int(int8_dot)}" in out.stdout, out.stdout


def test_scalar_path(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    _build_and_run("g++", ["-DSERVESCOPE_ISA_SCALAR"], tmp_path)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "no-vnni"])
def test_x86_paths(isa, vnni, tmp_path):
    if machine_arch() not in ("x86_64", "amd64") or shutil.which("g++") is None:
        pytest.skip("x86 paths need an x86 g++")
    flags = [f"-DSERVESCOPE_ISA_{isa.upper()}", *ISA_CFLAGS[isa]] + ([X86[isa]] if vnni else [])
    runnable = isa in supported_isas(cpu_flags(), machine_arch()) and (not vnni or X86_FLAG[isa] in cpu_flags())
    _build_and_run("g++", flags, tmp_path, run=runnable, int8_dot=vnni)


@pytest.mark.parametrize("arch", ["armv8.2-a+dotprod", "armv8-a"], ids=["dotprod", "plain"])
def test_neon_path_under_qemu(arch, tmp_path):
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        pytest.skip("no aarch64 cross compiler or qemu-user")
    _build_and_run(cxx, [f"-march={arch}", "-DSERVESCOPE_ISA_NEON"], tmp_path, (qemu, "-L", "/usr/aarch64-linux-gnu"),
                   int8_dot="dotprod" in arch)
