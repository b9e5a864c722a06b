"""One layer's decode attention with soft-capped scores or sinks: the C++ paged kernel against the eager
reference it replaced on the CPU (model/attention/scores.attend through the reference backend), at real heads.

    python benchmarks/score_mods_decode.py [--threads 2] [--contexts 1024 4096] [--batches 1 8]

Shapes: Gemma-2-2B (8 heads, 4 KV heads, head dim 256, scores soft-capped at 50; the general kernel path) and
gpt-oss-20b (64 heads, 8 KV heads, head dim 64, sinks; the register-tiled path), bfloat16 queries and cache.
Medians of --runs calls each, the two alternating; the ratio is reference / kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention.reference import TorchAttentionBackend

S = 16
SHAPES = {"gemma-2-2b (softcap 50)": (8, 4, 256, 50.0, False), "gpt-oss-20b (sinks)": (64, 8, 64, 0.0, True)}


def one_case(heads, kv_heads, d, softcap, with_sinks, batch, context, runs):
    gen = torch.Generator().manual_seed(0)
    m = -(-context // S)
    kc = torch.randn(batch * m, S, kv_heads, d, generator=gen).bfloat16()
    vc = torch.randn(batch * m, S, kv_heads, d, generator=gen).bfloat16()
    tables = torch.randperm(batch * m, generator=gen).view(batch, m).int()
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, d, generator=gen).bfloat16()
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    scale = d ** -0.5

    def kernel():
        return cpu_ops.paged_decode(q, kc, vc, tables, lens, scale, softcap=softcap, sinks=sinks)

    def reference():
        return TorchAttentionBackend._paged_decode(q, kc, vc, tables, lens, context, scale, softcap=softcap,
                                                   sinks=sinks)

    err = (kernel().float() - reference().float()).abs().max().item()
    times = {"kernel": [], "reference": []}
    for _ in range(runs):
        for name, fn in (("kernel", kernel), ("reference", reference)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return statistics.median(times["kernel"]), statistics.median(times["reference"]), err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_ops.load() is None:
        raise SystemExit("the CPU extension is not built here")
    print("| shape | batch | context | kernel ms | reference ms | reference / kernel | max abs diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (h, hkv, d, cap, sinks) in SHAPES.items():
        for b in args.batches:
            for ctx in args.contexts:
                k, r, err = one_case(h, hkv, d, cap, sinks, b, ctx, args.runs)
                print(f"| {name} | {b} | {ctx} | {k * 1e3:.2f} | {r * 1e3:.2f} | {r / k:.1f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
