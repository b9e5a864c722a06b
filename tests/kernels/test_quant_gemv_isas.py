"""csrc/quant_gemv.h on the ISA paths this machine does not run natively: plain C++ (scalar), and NEON
cross-compiled and run under qemu where g++-aarch64-linux-gnu and qemu-user are installed."""

import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(__file__)
CSRC = os.path.join(HERE, "..", "..", "src", "servescope", "kernels", "csrc")
SRC = os.path.join(HERE, "quant_gemv_check.cpp")


def _build_and_run(cxx, flags, tmp_path, runner=()):
    exe = str(tmp_path / "check")
    subprocess.run([cxx, "-std=c++17", "-O2", *flags, "-I", CSRC, SRC, "-o", exe], check=True, capture_output=True)
    out = subprocess.run([*runner, exe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "bad=0" in out.stdout, out.stdout + out.stderr


def test_scalar_path(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    _build_and_run("g++", ["-DSERVESCOPE_ISA_SCALAR"], tmp_path)


def test_neon_path_under_qemu(tmp_path):
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        pytest.skip("no aarch64 cross compiler or qemu-user")
    _build_and_run(cxx, ["-march=armv8.2-a", "-DSERVESCOPE_ISA_NEON"], tmp_path, (qemu, "-L", "/usr/aarch64-linux-gnu"))
