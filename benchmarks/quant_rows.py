"""Packed-weight kernels against bfloat16 dense oneDNN by rows, at the Llama-3.2-1B shape: the evidence for
which packed kernel runs at how many rows (csrc/quant_dot.h QDOT_TILED_ROWS, csrc/quant_amx.h QDOT_AMX_ROWS_*,
csrc/quant_amx_bf16.h QDOT_AMX_BF16_ROWS_*, model/linears/packed.py PACKED_MAX_ROWS).

A batched decode step multiplies M rows by every weight. This times one pass over --layers layers of the
1B shape's projections (qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192; distinct weights
per layer so that they come from memory, as in a step) with each path, for M in --rows, in --rounds
interleaved rounds, and prints the medians (ms) and the fastest packed path per M:
  stream     quant_gemv's streaming order (4 rows of x per pass over the weights), int8 dot products
  tiled      quant_gemv's weight-stationary order (every row of a block of x per weight tile)
  amx        quant_gemv's AMX-INT8 kernel (csrc/quant_amx.h), where the CPU has it
  amx-bf16   quant_gemv's AMX-BF16 kernel (csrc/quant_amx_bf16.h: each panel dequantised to bfloat16 once),
             where the CPU has it
  gemm       the panel GEMM (quant_gemv's order 5: re-lays the weights per call)
  kept       the same GEMM over weights kept in its panel layout (csrc/quant_kept.h: laid out once at load,
             what the engine runs where the CPU's kernels keep panels; a copy of each matrix here)
  deq+dnn    the weights dequantised to the activation dtype in tiles, then oneDNN's GEMM
             (QuantLinear._prefill)
  dense      a bfloat16 / float32 dense weight prepacked for oneDNN (what the packed formats must beat)
for int4 g32 symmetric (Q4_0's form), int8 g32 symmetric (Q8_0's) and int4 g32 asymmetric (Q4_1's), with
float32 and bfloat16 activations.

    python benchmarks/quant_rows.py --threads 2 --rounds 3 --json benchmarks/results/quant_rows.json

On a machine shared with other work, wall time at 2 threads swings several-fold; `--threads 1 --clock thread`
times the calling thread's CPU time instead (with one thread the kernels run in it), which the neighbours
disturb far less (they still share the caches and memory bandwidth): the order of the paths per row count,
not the 2-thread milliseconds.
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
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears.packed import QuantLinear, kept_panel, to_panels

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # qkv, o, gate_up, down of Llama-3.2-1B
FORMATS = {"q4_0": (4, False), "q8_0": (8, False), "q4_1": (4, True)}


def packed_layer(bits: int, asym: bool, g: torch.Generator) -> list:
    """QuantLinears of one layer with random bytes and scales (the kernels' speed does not depend on them)."""
    out = []
    for n, k in SHAPES:
        w = (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g) if bits == 4
             else torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
        scales = (torch.rand(n, k // 32, *((2,) if asym else ()), generator=g) * 0.01 + 0.001).half()
        out.append(QuantLinear(w, scales, k))
    return out


CLOCK = {"wall": time.perf_counter, "thread": time.thread_time}


def one_pass(fn, mats, xs, clock=time.perf_counter) -> float:
    t0 = clock()
    for m in mats:
        fn(m, xs[m.in_features if isinstance(m, QuantLinear) else m[0].shape[1]])
    return clock() - t0


def paths(mod, dtype) -> dict:
    empty = torch.empty(0)
    out = {
        "stream": lambda lin, x: mod.quant_gemv(x, lin.qweight, lin.scales, empty, 1),
        "tiled": lambda lin, x: mod.quant_gemv(x, lin.qweight, lin.scales, empty, 2),
        "deq+dnn": lambda lin, x: lin._prefill(mod, x),
    }
    if mod.isa().get("amx_int8") == "1":
        out["amx"] = lambda lin, x: mod.quant_gemv(x, lin.qweight, lin.scales, empty, 3)
    if mod.isa().get("amx_bf16") == "1":
        out["amx-bf16"] = lambda lin, x: mod.quant_gemv(x, lin.qweight, lin.scales, empty, 4)
    out["gemm"] = lambda lin, x: mod.quant_gemv(x, lin.qweight, lin.scales, empty, 5)
    if kept_panel():
        out["kept"] = lambda lin, x: mod.quant_gemv(x, *lin.kept, empty, 0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--formats", default="q4_0,q8_0,q4_1")
    ap.add_argument("--json", default=None)
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                    help="wall time, or the calling thread's CPU time (only with --threads 1)")
    args = ap.parse_args()
    if args.clock == "thread" and args.threads != 1:
        ap.error("--clock thread needs --threads 1 (other threads' work would not be counted)")
    clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    mod = cpu_ops.load()
    if mod is None:
        print("the CPU kernel extension is not available here", file=sys.stderr)
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    formats = {f: [lin for _ in range(args.layers) for lin in packed_layer(*FORMATS[f], g)]
               for f in args.formats.split(",")}
    for lin in (lin for lins in formats.values() for lin in lins if kept_panel()):
        lin.kept = to_panels(lin.qweight, lin.scales, kept_panel())
    results = {}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        dense = []
        for _ in range(args.layers):
            for n, k in SHAPES:
                w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
                dense.append((w, cpu_linear.pack_for_onednn(w)))
        timed = {(f, p): [] for f in formats for p in paths(mod, dtype)}
        timed.update({("dense", "dense"): []})
        with torch.inference_mode():
            for _ in range(args.rounds):
                for m in rows:
                    xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {k for _, k in SHAPES}}
                    for f, lins in formats.items():
                        for p, fn in paths(mod, dtype).items():
                            one_pass(fn, lins[:4], xs)  # warm the code path and the scratch buffers
                            timed[(f, p)].append((m, one_pass(fn, lins, xs, clock)))
                    dn = lambda wp, x: cpu_linear.onednn_linear(x, wp[1])  # noqa: E731
                    one_pass(dn, dense[:4], xs)
                    timed[("dense", "dense")].append((m, one_pass(dn, dense, xs, clock)))
        table = {f"{f}/{p}": {m: statistics.median(t for mm, t in ts if mm == m) * 1e3 for m in rows}
                 for (f, p), ts in timed.items()}
        results[name] = table
        print(f"{name} activations: one pass over {args.layers} layers of the 1B shape "
              f"(ms of {args.clock} time, median of {args.rounds})")
        print("  rows          " + "".join(f"{m:>8}" for m in rows))
        for key, row in table.items():
            print(f"  {key:<14}" + "".join(f"{row[m]:8.2f}" for m in rows))
        for f in formats:
            best = [min((table[f"{f}/{p}"][m], p) for p in paths(mod, dtype)) for m in rows]
            print(f"  {f} best     " + "".join(f"{p:>8}" for _, p in best))
            ratios = [table["dense/dense"][m] / t for (t, _), m in zip(best, rows)]
            print(f"  {f} dense/best" + "".join(f"{r:8.2f}" for r in ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "quant_rows", "environment": environment_info(), "threads": args.threads,
                       "rounds": args.rounds, "layers": args.layers, "clock": args.clock, "results": results},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
