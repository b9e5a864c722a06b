"""Decode batch 1 and prefill 512 of the embedded model per weight mode, interleaved in one process
(rounds of every mode in turn, medians reported), for docs/BENCHMARKS.md.

    python benchmarks/quant_speed.py [--threads 2] [--rounds 3] [--modes none gguf int4 int8-g32 int8]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope import LLM, SamplingParams  # noqa: E402


def decode_tps(llm, prompt, new):
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    return 1.0 / llm.generate([prompt], sp)[0].metrics.tpot


def prefill_tps(llm, prompt):
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([prompt], sp)
    return len(prompt) / (time.perf_counter() - t0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["none", "gguf", "int4", "int8-g32", "int8"])
    args = ap.parse_args()
    kw = dict(num_kv_blocks=128, max_model_len=1024, enable_prefix_caching=False, num_threads=args.threads)
    llms = {m: LLM(quantization=None if m == "none" else m, **kw) for m in args.modes}
    prompt = [(i * 37) % 40000 + 100 for i in range(128)]
    long = [(i * 53) % 40000 + 100 for i in range(512)]
    res = {m: {"decode": [], "prefill": []} for m in args.modes}
    for llm in llms.values():  # warm up
        decode_tps(llm, prompt[:16], 4)
    for r in range(args.rounds):
        for m, llm in llms.items():
            res[m]["decode"].append(decode_tps(llm, prompt, args.new))
            res[m]["prefill"].append(prefill_tps(llm, long))
            print(f"round {r} {m}: decode {res[m]['decode'][-1]:.1f} tok/s, prefill512 {res[m]['prefill'][-1]:.1f} tok/s",
                  flush=True)
    base = statistics.median(res[args.modes[0]]["decode"])
    print(f"| weights | weight MiB | decode b1 tok/s (median of {args.rounds}) | vs {args.modes[0]} | prefill 512 tok/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for m, llm in llms.items():
        d, p = statistics.median(res[m]["decode"]), statistics.median(res[m]["prefill"])
        print(f"| {m} | {llm.engine.weight_bytes / 2**20:.1f} | {d:.1f} | {d / base:.2f}x | {p:.1f} |")
