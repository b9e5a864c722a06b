"""Paged decode attention alone: the C++ kernel (`cpu_ops.paged_decode`) over one decode step of every
layer, the KV cache in memory as in a real step (one cache per layer, larger than the CPU's caches) and
its blocks scattered (a shuffled block table, as the allocator hands them out after a while).

    python benchmarks/decode_attention.py [--batch 42] [--context 350] [--threads 2] [--rounds 7]

Default shape: SmolLM2-135M's heads (9 query, 3 KV, head dim 64), 30 layers, block size 16, the batch
and context of the offline-throughput workload's decode steps. Prints the median time of the 30 layers
per cache dtype and the bytes of K and V it read per second. To compare two trees, run it with
PYTHONPATH pointing at each one's src/ (and TORCH_EXTENSIONS_DIR at a directory of its own).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention import kv_quant
from servescope.timing import median_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=42)
    ap.add_argument("--context", type=int, default=350)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = args.dtypes.split(",")
    if not names or any(n not in ("float32", "bfloat16") for n in names):
        ap.error(f"--dtypes: float32 and / or bfloat16, got {args.dtypes!r}")
    torch.set_num_threads(args.threads)
    if cpu_ops.load() is None:
        raise SystemExit("the CPU kernels did not build on this machine (see the warning above)")
    b, ctx, s, hkv, d = args.batch, args.context, args.block_size, args.kv_heads, args.head_dim
    per_seq = (ctx + s - 1) // s
    gen = torch.Generator().manual_seed(0)
    block_table = (1 + torch.randperm(b * per_seq, generator=gen)).to(torch.int32).view(b, per_seq)
    context_lens = torch.full((b,), ctx, dtype=torch.int32)
    results = {}
    for name in names:
        dtype = getattr(torch, name)
        caches = []
        for _ in range(args.layers):  # allocated as the engine allocates its cache (kv_quant.allocate)
            k = kv_quant.allocate(b * per_seq + 1, s, hkv, d, dtype, torch.device("cpu"))
            v = kv_quant.allocate(b * per_seq + 1, s, hkv, d, dtype, torch.device("cpu"))
            k.copy_(torch.randn(k.shape, generator=gen))
            v.copy_(torch.randn(v.shape, generator=gen))
            caches.append((k, v))
        q = torch.randn(b, args.heads, d, generator=gen).to(dtype)

        def step():
            for k, v in caches:
                cpu_ops.paged_decode(q, k, v, block_table, context_lens, d ** -0.5)

        t = median_seconds(step, args.rounds)
        nbytes = args.layers * b * ctx * 2 * hkv * d * caches[0][0].element_size()
        results[name] = {"ms": 1e3 * t, "gb_per_s": nbytes / t / 1e9}
        print(f"{name:9s} {1e3 * t:7.1f} ms for {args.layers} layers  {nbytes / t / 1e9:5.1f} GB/s of K and V  "
              f"(batch {b}, context {ctx}, median of {args.rounds})")
        caches = None  # frees this dtype's cache before the next allocates (not del: step() closes over it)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "isa": cpu_ops.isa(),
                       "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
