"""The decode GEMV of every CPU kernel path this machine runs, against its read bandwidth, same process.

Batch-1 decode is the GEMV over every weight once per token, so the fraction of a plain streaming read
it reaches is the decode floor's main term. This builds the extension once per ISA (the ones this
CPU can run: on an AVX-512 machine avx512, avx2 and scalar), loads them side by side, and in each of
--rounds interleaved rounds times: a 512 MiB `torch.sum` (the probe's bandwidth), then one pass of
M=1 GEMVs over SmolLM2-135M's float32 weight shapes (30 layers x qkv, o, gate_up, down, then the
49152-row head: 538 MB, far above the caches) per ISA. Reports medians and same-run ratios.

    python benchmarks/isa_gemv.py --threads 2 --rounds 5 --json benchmarks/results/isa_gemv.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from servescope.analysis.cpu_isa import ENV, cpu_flags, machine_arch, supported_isas
from servescope.bench.envinfo import environment_info
from servescope.kernels.cpu import ops as cpu_ops
from servescope.kernels.cpu.extension import CpuExtension
from servescope.timing import median_seconds

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down of SmolLM2-135M
HEAD = (49152, 576)


def load_isa(isa: str):
    os.environ[ENV] = isa
    try:
        ext = CpuExtension(cpu_ops._EXT.name, cpu_ops.SOURCES, f"{isa} kernels",
                           extra_cflags=cpu_ops._EXT.extra_cflags)
        return ext.load()
    finally:
        del os.environ[ENV]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isas", default=None, help="comma-separated (default: every path this CPU runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isas = args.isas.split(",") if args.isas else supported_isas(cpu_flags(), machine_arch())
    mods = {isa: load_isa(isa) for isa in isas}
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(30) for n, k in LAYER_SHAPES]
    ws.append(torch.randn(*HEAD, generator=gen) * 0.02)
    nbytes = sum(w.numel() * 4 for w in ws)
    xs = {w.shape[1]: torch.randn(1, w.shape[1], generator=gen) for w in ws}
    empty = torch.empty(0)
    buf = torch.ones(512 * 2**20 // 4)
    rows = []
    for r in range(args.rounds):
        row = {"read": buf.numel() * 4 / median_seconds(lambda: buf.sum(), 3)}
        for isa, mod in mods.items():
            def one_pass(mod=mod):
                for w in ws:
                    mod.gemv(xs[w.shape[1]], w, empty, empty)
            row[isa] = nbytes / median_seconds(one_pass, 3)
        rows.append(row)
        print(f"round {r}: read {row['read'] / 1e9:.1f} GB/s; "
              + "; ".join(f"{isa} {row[isa] / 1e9:.1f} GB/s ({row[isa] / row['read']:.0%})" for isa in mods),
              flush=True)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    frac = {isa: statistics.median(row[isa] / row["read"] for row in rows) for isa in mods}
    print("medians: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in med.items()))
    print("median fraction of the same round's read: " + ", ".join(f"{isa} {v:.0%}" for isa, v in frac.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "isa_gemv", "weight_bytes": nbytes, "rounds": rows, "median": med,
                       "fraction_of_read": frac, **environment_info()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
