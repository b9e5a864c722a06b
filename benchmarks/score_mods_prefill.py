"""Prefill rows with soft-capped scores or sinks on the CPU: each row one query of the C++ paged decode kernel
(what model/attention/cpu.py runs where paged_tokens_beat_attend says so) against scores.attend (BLAS over the
chunk's materialised [H, q, L] scores), at real heads and GQA groups. The thread CPU clock, one thread by
default, so the ratio holds on a shared machine.

    python benchmarks/score_mods_prefill.py [--threads 1] [--queries 512] [--contexts 1024 2048]

Prints per shape, dtype and context: each path's median ms, attend / paged, and their largest difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention import scores
from servescope.model.attention.cpu import paged_tokens_beat_attend

S = 16
# name: (query heads, KV heads, head dim, soft-cap, sinks)
SHAPES = {"gpt-oss-20b (sinks)": (64, 8, 64, 0.0, True), "gemma-2-2b (softcap 50)": (8, 4, 256, 50.0, False),
          "group 4, dim 128 (sinks)": (32, 8, 128, 0.0, True), "group 2, dim 64 (sinks)": (16, 8, 64, 0.0, True)}


def _clock(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return statistics.median(times)


def one_case(shape: tuple, dtype: torch.dtype, queries: int, context: int, runs: int) -> dict:
    h, hkv, d, softcap, with_sinks = shape
    gen = torch.Generator().manual_seed(0)
    nb = -(-context // S)
    kc = torch.randn(nb, S, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(nb, S, hkv, d, generator=gen).to(dtype)
    q = torch.randn(queries, h, d, generator=gen).to(dtype)
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    tables = torch.arange(nb, dtype=torch.int32)[None].expand(queries, -1).contiguous()
    lens = torch.arange(context - queries + 1, context + 1, dtype=torch.int32)  # the chunk's causal rows
    k, v = kc.flatten(0, 1)[:context], vc.flatten(0, 1)[:context]
    mask = torch.arange(context)[None] <= torch.arange(context - queries, context)[:, None]
    scale = d ** -0.5

    def paged():
        return cpu_ops.paged_decode(q, kc, vc, tables, lens, scale, softcap=softcap, sinks=sinks)

    def attend():
        return scores.attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale, mask,
                             softcap, sinks)[0].transpose(0, 1)

    diff = (paged().float() - attend().float()).abs().max().item()
    tp, ta = _clock(paged, runs), _clock(attend, runs)
    return {"paged_ms": tp * 1e3, "attend_ms": ta * 1e3, "ratio": ta / tp, "max_diff": diff,
            "paged_chosen": paged_tokens_beat_attend(h // hkv, d)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ops.available():
        raise SystemExit("the CPU extension is not built here")
    for name, shape in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for ctx in args.contexts:
                r = one_case(shape, dtype, args.queries, ctx, args.runs)
                print(f"{name:26s} {str(dtype)[6:]:8s} q {args.queries} ctx {ctx}: paged {r['paged_ms']:7.1f} ms  "
                      f"attend {r['attend_ms']:7.1f} ms  attend/paged {r['ratio']:5.2f}x  max diff {r['max_diff']:.1e}"
                      f"  (engine takes {'paged' if r['paged_chosen'] else 'attend'})")


if __name__ == "__main__":
    main()
