"""The decode GEMV against oneDNN's prepacked GEMM, MKL's F.linear and (float32) the panel GEMM, by rows.

A decode step at batch M multiplies M rows by every weight. The GEMV (csrc/kernels.h) reads each weight
once for all M rows; oneDNN's blocked GEMM (the path above kernels/cpu/linear.py MAX_ROWS) has a fixed
cost of its own at small M. This times one pass over SmolLM2-135M's 30 layers of weight shapes (qkv,
o, gate_up, down: 420 MB in float32, far above the caches; `--shape llama-3.2-1b`: that shape's 16 layers)
with each, for M in --rows and each dtype,
in --rounds interleaved rounds, and prints the medians and the largest M where the GEMV is faster:
the evidence for MAX_ROWS (and, in float32, for PANEL_MAX_ROWS: the panel GEMM's row).

    python benchmarks/gemv_rows.py --threads 2 --rounds 5 --json benchmarks/results/gemv_rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from servescope.bench.envinfo import environment_info
from servescope.kernels.cpu import linear as cpu_linear

# qkv, o, gate_up, down (N, K) and the layers of each --shape
SHAPES = {"smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
          "llama-3.2-1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 16)}


def one_pass(fn, mats, xs) -> float:
    t0 = time.perf_counter()
    for w, packed in mats:
        fn(xs[w.shape[1]], w, packed)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    LAYER_SHAPES, LAYERS = SHAPES[args.shape]
    torch.set_num_threads(args.threads)
    if not cpu_linear.available():
        print("the CPU kernel extension is not available here", file=sys.stderr)
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    paths = {
        "gemv": lambda x, w, packed: cpu_linear.gemv(x, w, None, None).to(x.dtype),  # as the DecodePlan does
        "onednn": lambda x, w, packed: cpu_linear.onednn_linear(x, packed[0]),
        "mkl": lambda x, w, packed: torch.nn.functional.linear(x, w),  # torch's default BLAS path
        "panel": lambda x, w, packed: cpu_linear.panel_gemm(x, packed[1], w.shape[0]).to(x.dtype),
    }
    results = {}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        dpaths = {p: fn for p, fn in paths.items() if p != "panel" or dtype == torch.float32}  # panels: float32
        g = torch.Generator().manual_seed(0)
        mats = []
        for _ in range(LAYERS):
            for n, k in LAYER_SHAPES:
                w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
                mats.append((w, (cpu_linear.pack_for_onednn(w), cpu_linear.pack_panels(w))))
        times = {(p, m): [] for p in dpaths for m in rows}
        for _ in range(args.rounds):
            for m in rows:
                xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {k for _, k in LAYER_SHAPES}}
                for p, fn in dpaths.items():
                    one_pass(fn, mats[:8], xs)  # warm the code path, not the weights
                    times[(p, m)].append(one_pass(fn, mats, xs))
        table = {m: {p: statistics.median(times[(p, m)]) * 1e3 for p in dpaths} for m in rows}
        faster = [m for m in rows if table[m]["gemv"] < table[m]["onednn"]]
        results[name] = {"shape": args.shape, "ms": table, "gemv_faster_up_to": max(faster) if faster else 0}
        print(f"{name}: one pass over {LAYERS} layers (ms, median of {args.rounds})")
        print("  rows  " + "".join(f"{m:>8}" for m in rows))
        for p in dpaths:
            print(f"  {p:<6}" + "".join(f"{table[m][p]:8.2f}" for m in rows))
        flops = {m: 2 * m * sum(n * k for n, k in LAYER_SHAPES) * LAYERS for m in rows}
        best = {m: flops[m] / min(table[m].values()) / 1e6 for m in rows}  # GFLOP/s (ms in the table)
        print("  GFLOP/s" + "".join(f"{best[m]:8.1f}" for m in rows) + "   (the fastest path)")
        print("  ratio " + "".join(f"{table[m]['onednn'] / table[m]['gemv']:8.2f}" for m in rows)
              + "   (oneDNN / GEMV)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gemv_rows", "environment": environment_info(), "threads": args.threads,
                       "rounds": args.rounds, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
