"""The KV cache dtypes side by side, in one process, interleaved (rounds of every dtype in turn; medians),
for docs/BENCHMARKS.md: (1) the C++ paged decode attention kernel alone on SmolLM2's heads (9 query
heads, 3 KV heads, head dim 64, 30 layers' worth of calls) at batch x context, float32 queries over a
float32 / int8 / fp8 cache, the cache far larger than the CPU's caches; (2) the embedded model's decode
step (float32 weights) at batch x context per KV dtype; (3) the tokens 1 GiB of KV cache holds.

    python benchmarks/kv_cache_dtype.py [--threads 2] [--rounds 3] [--batch 4] [--context 256]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope import LLM, SamplingParams  # noqa: E402
from servescope.kernels.cpu import ops as cpu_ops  # noqa: E402
from servescope.model.attention import kv_quant  # noqa: E402

DTYPES = {"float32": torch.float32, "int8": torch.int8, **({"fp8_e4m3": kv_quant.FP8} if kv_quant.FP8 else {})}


def kernel_case(dtype, batch, context, layers=30, hkv=3, h=9, d=64, s=16):
    """One cache per layer (so that a step's reads come from memory, as in a model), random K/V."""
    per_seq = -(-context // s)
    nblk = batch * per_seq
    g = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(layers):
        kc, vc = (kv_quant.allocate(nblk, s, hkv, d, dtype, torch.device("cpu")) for _ in range(2))
        slots = torch.arange(nblk * s)
        x = torch.randn(nblk * s, hkv, d, generator=g)
        if dtype == torch.float32:
            kc.view(-1, hkv, d).copy_(x)
            vc.view(-1, hkv, d).copy_(x.flip(0))
        else:
            kv_quant.store(x, x.flip(0), kc, vc, slots)
        caches.append((kc, vc))
    tables = torch.randperm(nblk, generator=g).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, h, d, generator=g)
    return q, caches, tables, lens


def time_kernel(case) -> float:
    q, caches, tables, lens = case
    t0 = time.perf_counter()
    for kc, vc in caches:
        cpu_ops.paged_decode(q, kc, vc, tables, lens, 0.125)
    return time.perf_counter() - t0


def decode_step_s(llm, batch, context, new=8) -> float:
    prompts = [[(i * 37 + j * 101) % 40000 + 100 for i in range(context)] for j in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    first = llm.engine.step_records[-1].step if llm.engine.step_records else -1
    llm.generate(prompts, sp)
    recs = [r for r in llm.engine.step_records if r.step > first and r.phase == "decode" and r.num_decode_seqs == batch]
    return statistics.median(r.wall_seconds for r in recs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = {n: kernel_case(dt, args.batch, args.context) for n, dt in DTYPES.items()}
    kw = dict(max_model_len=args.context + 64, max_num_seqs=args.batch, enable_prefix_caching=False,
              max_num_batched_tokens=2048, num_threads=args.threads, skip_tokenizer_init=True)
    blocks = args.batch * (-(-(args.context + 64) // 16)) + 8
    base = LLM(num_kv_blocks=blocks, **kw)
    llms = {n: base.with_config(kv_cache_dtype=n, num_kv_blocks=blocks) for n in DTYPES}
    for n in DTYPES:  # warm-up
        time_kernel(cases[n])
        decode_step_s(llms[n], 1, 32, new=2)
    kern = {n: [] for n in DTYPES}
    step = {n: [] for n in DTYPES}
    for _ in range(args.rounds):
        for n in DTYPES:
            kern[n].append(time_kernel(cases[n]))
            step[n].append(decode_step_s(llms[n], args.batch, args.context))
    cap = {n: base.with_config(kv_cache_dtype=n, kv_cache_memory_bytes=1 << 30, num_kv_blocks=None)
           .engine.cache_config.num_blocks * 16 for n in DTYPES}
    km, sm = ({n: statistics.median(v[n]) for n in DTYPES} for v in (kern, step))
    print(f"batch {args.batch}, context {args.context}, {args.threads} threads, {args.rounds} interleaved rounds "
          "(medians); ratios are float32's time / this dtype's (same run)")
    print("| KV cache | bytes / token | tokens in 1 GiB | attention kernel, 30 layers (ms) | x float32 "
          "| decode step (ms) | x float32 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in DTYPES:
        print(f"| {n} | {llms[n].engine.kv_bytes_per_token} | {cap[n]} | {km[n] * 1e3:.2f} | "
              f"{km['float32'] / km[n]:.2f} | {sm[n] * 1e3:.2f} | {sm['float32'] / sm[n]:.2f} |")


if __name__ == "__main__":
    main()
