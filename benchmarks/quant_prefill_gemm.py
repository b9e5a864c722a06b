"""The packed prefill path's GEMM per layer of SmolLM2-135M (512 rows), before and after issue 15's rework:

    python benchmarks/quant_prefill_gemm.py [--threads 1] [--reps 9]

  old   the whole matrix dequantised to a new float32 tensor, `.to(dtype)`, F.linear (MKL for float32)
  new   QuantLinear.forward: dequantised straight in the activation dtype into the reused scratch buffer,
        oneDNN's linear on that plain weight
for float32 and bfloat16 activations, int4 group 32. CPU time (time.process_time) per call, median of
--reps, summed over the four projections: on a shared machine CPU time moves less than wall time."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from quant_speed import _time  # noqa: E402

from servescope.kernels.cpu import ops as cpu_ops  # noqa: E402
from servescope.model.linears import packed as ql  # noqa: E402
from servescope.quant.scheme import QuantScheme  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down (N, K)


def cpu_ms(fn, reps: int) -> float:
    return _time(fn, reps, clock=time.process_time) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mod = cpu_ops.load()
    if mod is None:
        print("the CPU extension is not built here")
        return 1
    print(f"| dtype | old ms / layer | new ms / layer | new / old |  ({args.threads} threads, CPU time, 512 rows)")
    print("| --- | ---: | ---: | ---: |")
    for dtype in (torch.float32, torch.bfloat16):
        old = new = 0.0
        for n, k in SHAPES:
            q = ql.QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), QuantScheme(4, 32))
            x = torch.randn(512, k).to(dtype)
            old += cpu_ms(lambda: F.linear(x, mod.quant_dequantize(q.qweight, q.scales, k).to(dtype)), args.reps)
            new += cpu_ms(lambda: q(x), args.reps)
        print(f"| {str(dtype).replace('torch.', '')} | {old:.1f} | {new:.1f} | {new / old:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
