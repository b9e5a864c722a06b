"""The C++ decode plan's layers timed as the kernel table times them, beside the same engine's whole decode steps.

    python benchmarks/decode_plan_vs_steps.py [--model random:PRESET | DIR] [--dtype bfloat16]
        [--quantization int4] [--threads 2] [--batches 8,16] [--contexts 128,256] [--repeats 5] [--steps 40]

The kernel table's decode factor (analysis/kernel_table.layers_factor) is the plan's layers at 1-64 rows over
256 cached tokens (measure/decode_plan.py) against the table's sum of their kernels. Where the factor seems to
over- or under-price a step, this says whether the plan's time at the table's point is what the engine's own
steps of that many sequences take: per batch, the plan's layers `--repeats` times at each context (over caches
whose pages are all written, as the table times them), then `--steps` decode steps of the engine over
128-token prompts (median wall time and the StepRecords' prediction), then the plan again. The plan holds the
layers only: a step adds the embedding, the head, the sampler and the host work between.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch

from servescope.labs.common import LabOptions, LabSession, greedy, random_prompt
from servescope.measure import decode_plan

PROMPT = 128


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def plan_ms(engine, rows: int, context: int, repeats: int) -> list:
    cfg = engine.model_config
    caches = decode_plan._caches(cfg, rows, -(-(context + 1) // decode_plan.BLOCK), engine.kv_dtype)
    out = []
    for _ in range(repeats):
        t = decode_plan.plan_seconds(engine.executor.decode_plan, cfg, engine.runner.backend, rows, context, caches,
                                     engine.dtype)
        if t is None:
            return []
        out.append(t * 1e3)
    return out


def steps_ms(engine, rows: int, steps: int) -> tuple:
    rng = random.Random(0)
    for i in range(rows):
        engine.add_request(f"r{i}", random_prompt(rng, PROMPT, engine.model_config.vocab_size), greedy(steps + 8))
    for _ in range(4):  # the prefills and the first decodes
        engine.step()
    first = len(list(engine.step_records))
    for _ in range(steps):
        engine.step()
    recs = [r for r in list(engine.step_records)[first:] if r.num_decode_seqs == rows and not r.num_prefill_tokens]
    if not recs:
        raise SystemExit(f"no decode-only step of {rows} sequences ran")
    return (statistics.median(r.wall_seconds for r in recs) * 1e3,
            statistics.median(r.predicted_seconds for r in recs) * 1e3, len(recs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="random:PRESET, a directory or GGUF (default: the embedded model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--contexts", default="128,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    session = LabSession(LabOptions(out=Path("/tmp/decode_plan_vs_steps"), dtype=a.dtype, threads=a.threads,
                                    model=a.model, quantization=a.quantization))
    for rows in _ints(a.batches):
        max_len = PROMPT + a.steps + 16
        per_seq = -(-max_len // decode_plan.BLOCK) + 1
        engine = session.engine(max_num_seqs=rows, max_model_len=max_len, num_kv_blocks=rows * per_seq + 8)
        if engine.executor.decode_plan is None:
            raise SystemExit("this engine runs no C++ decode plan (its decode steps run the model's forward)")
        for ctx in _ints(a.contexts):
            ts = plan_ms(engine, rows, ctx, a.repeats)
            print(f"b={rows:3d} plan layers at {ctx:4d} cached tokens, ms: " + " ".join(f"{t:.2f}" for t in ts))
        wall, pred, n = steps_ms(engine, rows, a.steps)
        print(f"b={rows:3d} engine decode step, ms: measured {wall:.2f}, predicted {pred:.2f} "
              f"({(pred - wall) / wall * 100:+.1f}%, median of {n})")
        ctx = _ints(a.contexts)[-1]
        ts = plan_ms(engine, rows, ctx, a.repeats)
        print(f"b={rows:3d} plan layers at {ctx:4d} again, ms: " + " ".join(f"{t:.2f}" for t in ts), flush=True)


if __name__ == "__main__":
    main()
