"""Decode tokens/s by batch size on packed weights against bfloat16 dense, at a preset's real shape (issue 35's
floor: packed never below bf16 dense at batch 1-64, >= 1.3x at batch 16).

For each weight form (bf16 dense; int4 = int4-g32-sym, Q4_0's form; int8-g32 = Q8_0's form; all with
bfloat16 activations, what `--dtype auto` picks on a CPU with bfloat16 dot products) it loads the random
model once and runs `bench latency`'s runner per batch size (short prompts, --output-len new tokens each),
recording the median decode step and batch / step as tokens/s. Only the public API is used, so the same
file times an older tree (PYTHONPATH=<tree>/src) for a before / after comparison.

    python benchmarks/packed_decode_batch.py --model random:llama-3.2-1b --threads 2 \
        --json benchmarks/results/packed_decode_batch.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

WEIGHTS = {"bf16": None, "int4": "int4", "int8-g32": "int8-g32"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama-3.2-1b")
    p.add_argument("--weights", default="bf16,int4,int8-g32")
    p.add_argument("--batch-sizes", default="1,4,8,16,32,64")
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import torch  # after the arguments: --help answers without loading torch (as decode_batch_sweep.py)

    from servescope.bench.envinfo import environment_info
    from servescope.bench.latency import run_engine_latency
    from servescope.engine.llm import LLM

    torch.set_num_threads(a.threads)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    out = {}
    for name in a.weights.split(","):
        llm = LLM(model=a.model, dtype="bfloat16", quantization=WEIGHTS[name], max_num_seqs=max(sizes),
                  num_threads=a.threads)
        out[name] = {}
        for b in sizes:
            r = run_engine_latency(llm, b, a.input_len, a.output_len, iters=1, dtype="bfloat16",
                                   measure_bandwidth=False)
            step = r["phases"]["decode"]["median_step_seconds"]
            out[name][b] = {"median_step_seconds": step, "tokens_per_second": b / step}
        print(f"{name:>9}: " + "  ".join(f"b={b} {out[name][b]['tokens_per_second']:.1f}" for b in sizes), flush=True)
        del llm
        gc.collect()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "packed_decode_batch", "model": a.model, "environment": environment_info(),
                       "threads": a.threads, "input_len": a.input_len, "output_len": a.output_len,
                       "tokens_per_second": out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
