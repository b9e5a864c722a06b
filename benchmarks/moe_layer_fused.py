"""One MoE layer's packed experts: the fused C++ op against the grouped Python path (issue 37).

OLMoE-1B-7B's expert shape (64 experts, k = 8, width 2048, expert width 1024) in Q4_0 (int4 group 32), random
weights and routing; `layers` copies of the layer so that a batch-1 call reads its experts from memory, not
cache. PackedExperts.grouped (the fused op, kernels/cpu's moe_packed) and model/moe.grouped_experts (the
reference: ~4 torch ops per active expert) run alternately on the same inputs; medians of the per-layer time.
Where the CPU's kernels keep panels (model/quantize.keep_panels, as the engine lays its experts out there), the
fused op over a copy of the experts in that layout as well.

    PYTHONPATH=src python benchmarks/moe_layer_fused.py --threads 2 [--batches 1,4,16] [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    import torch  # (torch half)

    from servescope.model.linears.packed import QuantLinear, kept_panel
    from servescope.model.moe import PackedExperts, grouped_experts
    from servescope.quant.packed import quantize
    from servescope.quant.scheme import QuantScheme

    torch.set_num_threads(args.threads)
    h, width, n, k = 2048, 1024, 64, 8
    g = torch.Generator().manual_seed(0)
    up = quantize(torch.randn(2 * width, h, generator=g) * 0.05, QuantScheme(4))
    down = quantize(torch.randn(h, width, generator=g) * 0.05, QuantScheme(4))
    layers = [PackedExperts([QuantLinear(up[0].clone(), up[1].clone(), h) for _ in range(n)],
                            [QuantLinear(down[0].clone(), down[1].clone(), width) for _ in range(n)])
              for _ in range(args.layers)]
    run = {"fused": lambda ex, x, i, w: ex.grouped(x, i, w),
           "grouped": lambda ex, x, i, w: grouped_experts(x, i, w, ex)}
    sets = {"fused": layers, "grouped": layers}
    if kept_panel():  # the layout the engine keeps experts in on this CPU (model/quantize.keep_panels)
        sets["kept"] = [PackedExperts([QuantLinear(up[0].clone(), up[1].clone(), h) for _ in range(n)],
                                      [QuantLinear(down[0].clone(), down[1].clone(), width) for _ in range(n)])
                        for _ in range(args.layers)]
        for ex in sets["kept"]:
            for m in ex.linears():
                m.keep_panels(kept_panel())
        run["kept"] = run["fused"]
    for b in (int(v) for v in args.batches.split(",")):
        times = {name: [] for name in run}
        for it in range(args.iters):
            for name in (list(run) if it % 2 else list(run)[::-1]):
                total = 0.0
                for ex in sets[name]:
                    x = torch.randn(b, h, generator=g)
                    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
                    w = torch.rand(b, k, generator=g)
                    t0 = time.perf_counter()
                    run[name](ex, x, ids, w)
                    total += time.perf_counter() - t0
                times[name].append(total / len(layers))
        f, r = statistics.median(times["fused"]), statistics.median(times["grouped"])
        line = f"batch {b}: per layer fused {1e3 * f:.2f} ms, grouped {1e3 * r:.2f} ms ({r / f:.2f}x)"
        if "kept" in times:
            kt = statistics.median(times["kept"])
            line += f"; fused over kept panels {1e3 * kt:.2f} ms ({f / kt:.2f}x the row layout's)"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
