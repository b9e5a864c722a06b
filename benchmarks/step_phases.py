"""Where the time of a batched workload goes, by step phase: the engine's own StepRecords summed per phase
(prefill / mixed / decode), measured and predicted, for the serving floor's workload run in-process
(32 requests of 256 random prompt tokens and 128 new ones, at most --concurrency at a time).

    python benchmarks/step_phases.py [--dtype float32] [--quantization gguf] [--concurrency 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
import random
import time

import torch

from servescope import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(dtype=args.dtype, quantization=args.quantization, max_num_seqs=args.concurrency)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 32000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    n0 = len(llm.engine.step_records)
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
    wall = time.perf_counter() - t0
    phases = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])  # steps, measured s, predicted s, tokens
    for r in list(llm.engine.step_records)[n0:]:
        p = phases[r.phase]
        p[0] += 1
        p[1] += r.wall_seconds
        p[2] += r.predicted_seconds or 0.0
        p[3] += r.num_tokens
    out = args.num_prompts * args.output_len
    print(f"{args.dtype}{' ' + args.quantization if args.quantization else ''}: {wall:.2f} s, {out / wall:.1f} output "
          f"tok/s, {sum(p[0] for p in phases.values())} steps")
    for name, (n, measured, predicted, tokens) in phases.items():
        print(f"  {name:8s} {n:4d} steps  {measured:6.2f} s measured  {predicted:6.2f} s predicted  "
              f"{tokens:6d} tokens  {1e3 * measured / n:7.1f} ms/step")


if __name__ == "__main__":
    main()
