"""The packed decode GEMV's profile per shape, on every kernel path this CPU runs, torch-free:

    python benchmarks/quant_gemv_profile.py [--threads 1 2] [--steps 10] [--csrc DIR] [--isas avx512 avx2]

Builds benchmarks/quant_gemv_profile.cpp against the kernels' headers (--csrc: another tree's, e.g. an
older commit's `git archive`, for a before/after) once per ISA with the extension's own flags for this
CPU, and runs it with 1 and 2 OpenMP threads (benchmarks/shim/ATen/Parallel.h splits the rows as
torch's pool does). Per shape of SmolLM2-135M: median us per call and GB/s of the packed bytes, the
step's GEMVs in decode order (30 layers + the int8 head, larger than the caches), a streaming read for
scale, and the kernel with its weights hot (its compute rate)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope.analysis.cpu_isa import cpu_flags, machine_arch, supported_isas  # noqa: E402
from servescope.kernels.cpu.extension import isa_cflags  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "..", "src", "servescope", "kernels", "cpu", "csrc")


def build(isa: str, csrc: str, out: str) -> str:
    exe = os.path.join(out, f"quant_gemv_profile_{isa}")
    cmd = ["g++", "-std=c++17", "-O3", "-fopenmp", "-DSERVESCOPE_TORCH", "-I", os.path.join(HERE, "shim"), "-I", csrc,
           *isa_cflags(isa, cpu_flags()), os.path.join(HERE, "quant_gemv_profile.cpp"), "-o", exe]
    subprocess.run(cmd, check=True)
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--csrc", default=CSRC, help="the kernels' headers (default: this tree's)")
    ap.add_argument("--isas", nargs="+", default=None, help="default: every vector path this CPU runs")
    args = ap.parse_args()
    isas = args.isas or [i for i in supported_isas(cpu_flags(), machine_arch()) if i != "scalar"]
    with tempfile.TemporaryDirectory() as tmp:
        exes = {isa: build(isa, args.csrc, tmp) for isa in isas}
        for isa, exe in exes.items():
            for t in args.threads:
                env = dict(os.environ, OMP_NUM_THREADS=str(t))
                run = subprocess.run([exe, str(args.steps)], env=env, check=True, capture_output=True,
                                     text=True)
                print(run.stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
