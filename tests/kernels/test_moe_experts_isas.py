"""csrc/moe_experts.h, the fused MoE experts over packed weights, on every ISA path the packed kernels are
checked on (test_quant_gemv_isas.py builds its check program the same ways): plain C++, AVX2 and AVX-512
with and without their VNNI dot products, AVX-512 with AMX-INT8 tiles, NEON with and without dotprod under
qemu. moe_experts_check.cpp compares the fused op bit for bit with the reference's order of operations and
with a float64 sum over the dequantised experts."""

import os

import pytest

import test_quant_gemv_isas as packed_isas  # tests/kernels, on sys.path as the test file's folder
from parallel_build import build_all

JOBS = packed_isas.isa_jobs(os.path.join(os.path.dirname(__file__), "moe_experts_check.cpp"))
BUILDS = ["scalar", "avx512-True", "avx512-False", "avx2-True", "avx2-False", "avx512-amx",
          "neon-armv8.2-a+dotprod", "neon-armv8-a"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    yield from build_all({k: c for k, (c, _, _) in JOBS.items()}, tmp_path_factory.mktemp("moe_isas"))


@pytest.mark.parametrize("name", BUILDS)
def test_moe_experts_path(name, built):
    packed_isas.check_build(built, name, JOBS)
