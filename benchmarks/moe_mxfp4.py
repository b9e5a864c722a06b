"""gpt-oss's experts in MXFP4 (issues 36 / 37): the fused C++ op against the torch paths, one layer at
gpt-oss-20b's expert shape (32 experts, k = 4, width 2880, expert width 2880), random weights and routing.

  fused    PackedClampedExperts.grouped: kernels/cpu's moe_packed over the MXFP4 blocks (int8 dot products,
           biases and the clamped SwiGLU in C++)
  grouped  model/moe.grouped_experts over the same packed modules (per expert: QuantLinear's packed GEMV,
           torch bias / activation ops)
  bf16 / f32  ClampedExperts over float weights (torch F.linear per active expert): the float path
`layers` copies of the packed layer (the float layers are each larger than any cache) so that a call reads its
experts from memory; the paths run alternately on the same inputs; medians of the per-layer time.

    PYTHONPATH=src python benchmarks/moe_mxfp4.py --threads 2 [--batches 1,4,16] [--iters 10]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _layers(args, torch):
    from servescope.model.linears.packed import QuantLinear
    from servescope.model.moe import ClampedExperts
    from servescope.model.moe_clamped import PackedClampedExperts
    from servescope.quant import mxfp4

    h, width, n = 2880, 2880, 32
    g = torch.Generator().manual_seed(0)
    up_w, down_w = torch.randn(2 * width, h, generator=g) * 0.05, torch.randn(h, width, generator=g) * 0.05
    up, down = mxfp4.quantize(up_w), mxfp4.quantize(down_w)
    packed = []
    for _ in range(args.layers):
        ex = PackedClampedExperts([QuantLinear(up[0].clone(), up[1].clone(), h) for _ in range(n)],
                                  [QuantLinear(down[0].clone(), down[1].clone(), width) for _ in range(n)], 7.0, 1.702)
        ex.gate_up_proj_bias.data.normal_(0, 0.1, generator=g)
        ex.down_proj_bias.data.normal_(0, 0.1, generator=g)
        packed.append(ex)
    floats = {}
    for name, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        ex = ClampedExperts(n, h, width, 7.0, 1.702).to(dtype)
        with torch.no_grad():
            ex.gate_up_proj.copy_(up_w.to(dtype).expand(n, -1, -1))
            ex.down_proj.copy_(down_w.to(dtype).expand(n, -1, -1))
            ex.gate_up_proj_bias.copy_(packed[0].gate_up_proj_bias)
            ex.down_proj_bias.copy_(packed[0].down_proj_bias)
        floats[name] = ex
    return packed, floats, h, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--layers", type=int, default=3)
    args = ap.parse_args()
    import torch  # (torch half)

    from servescope.model.moe import grouped_experts

    torch.set_num_threads(args.threads)
    packed, floats, h, n = _layers(args, torch)
    k, g = 4, torch.Generator().manual_seed(1)
    run = {"fused": lambda x, i, w, layer: packed[layer].grouped(x, i, w),
           "grouped": lambda x, i, w, layer: grouped_experts(x, i, w, packed[layer]),
           "bf16": lambda x, i, w, layer: floats["bf16"].grouped(x.bfloat16(), i, w.bfloat16()),
           "f32": lambda x, i, w, layer: floats["f32"].grouped(x, i, w)}
    for b in (int(v) for v in args.batches.split(",")):
        times = {name: [] for name in run}
        for it in range(args.iters):
            names = list(run) if it % 2 else list(reversed(run))
            for name in names:
                total, count = 0.0, 0
                for layer in range(args.layers):
                    x = torch.randn(b, h, generator=g)
                    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
                    w = torch.softmax(torch.randn(b, k, generator=g), -1)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        run[name](x, ids, w, layer)
                    total, count = total + time.perf_counter() - t0, count + 1
                times[name].append(total / count)
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"batch {b}: per layer " + ", ".join(f"{name} {1e3 * t:.2f} ms" for name, t in med.items())
              + f" (fused: {med['grouped'] / med['fused']:.2f}x grouped, {med['bf16'] / med['fused']:.2f}x bf16, "
              f"{med['f32'] / med['fused']:.2f}x f32)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
