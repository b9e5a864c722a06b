"""A MoE's sparse MLPs on a decode step's own rows against the kernel table's random rows, paired (issue 37).

    PYTHONPATH=src python benchmarks/moe_real_rows.py --gguf DIR/gguf/olmoe-1b-7b-Q4_0.gguf --threads 2 \
        [--batch 16] [--rounds 20] [--steps 8]

The kernel table times each sparse block on random rows (measure/moe_kernels.py: randn x 0.5, the same rows for
every layer) and prices a step's MLPs by them, scaled by the step's distinct experts. On a shared machine the
step's own rows seemed to cost 1.12-1.20x more at the same routing statistics. Here, quiet, in one process:

1. `--batch` prompts are prefilled and decoded `--steps` steps; then one decode step runs through the model's
   forward (the executor's Python path) with each sparse block's input captured (the rows the C++ plan's
   sparse MLP receives in the same step: the same math);
2. each round runs every sparse layer's `plan.sparse[i].run` once over the captured rows and once over the
   table's random rows (`--batch` x hidden, randn x 0.5), in alternating order; per round the two passes'
   times and their ratio; the routing of both (distinct experts per layer, rows per expert: max and the
   histogram) from the blocks' counters;
3. controls in the same rounds: the captured rows shuffled across layers (layer i gets layer i+1's rows:
   the routing of another layer's rows), and random rows scaled to each layer's captured rms.

Printed: medians over the rounds, the paired ratio's median and quartiles.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def capture(engine, blocks) -> list:
    """Each sparse block's input in one decode step run through the model's forward."""
    got = {}
    hooks = [b.register_forward_pre_hook(lambda m, args, i=i: got.__setitem__(i, args[0].detach().clone()))
             for i, (_, b) in enumerate(blocks)]
    ex = engine.executor
    paths = ex.layer_paths
    try:
        ex.layer_paths = [p for p in paths if p is not ex.decode_plan]
        engine.step()
    finally:
        ex.layer_paths = paths
        for h in hooks:
            h.remove()
    if len(got) != len(blocks):
        raise SystemExit(f"captured {len(got)} of {len(blocks)} sparse layers' rows")
    rows = [got[i] for i in range(len(blocks))]
    return [r.reshape(-1, r.shape[-1]) for r in rows]


def routing(blocks) -> tuple:
    """(mean distinct experts per layer, max rows of one expert, Counter of rows per active expert) since the
    blocks' last take."""
    per = [b.take_routing() for _, b in blocks]
    hist = Counter(int(c) for p in per for c in p.tolist() if c > 0)
    return (statistics.mean(int((p > 0).sum()) for p in per), max(int(p.max()) for p in per), hist)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()

    import torch

    from servescope.engine.llm import LLM
    from servescope.labs.common import greedy, random_prompt
    from servescope.model.moe import moe_blocks

    torch.set_num_threads(a.threads)
    llm = LLM(model=a.gguf, quantization="gguf", num_threads=a.threads, max_num_seqs=a.batch, max_model_len=1024)
    engine = llm.engine
    plan = engine.executor.decode_plan
    if plan is None or not plan.sparse:
        raise SystemExit("this engine's decode plan runs no sparse MLP")
    model, cfg = engine.model, engine.model_config
    blocks = moe_blocks(model)
    runs = [plan.sparse[i].run for i, _ in blocks]
    rng = random.Random(0)
    for i in range(a.batch):
        engine.add_request(f"r{i}", random_prompt(rng, 128, cfg.vocab_size), greedy(a.steps + 64))
    for _ in range(a.steps + a.batch):  # every prefill and some decodes
        engine.step()
    real = capture(engine, blocks)
    if any(r.shape[0] != a.batch for r in real):
        raise SystemExit(f"the captured step held {real[0].shape[0]} rows, not {a.batch}")
    dtype = real[0].dtype
    rnd = (torch.randn(a.batch, cfg.hidden_size, generator=torch.Generator().manual_seed(a.batch)) * 0.5).to(dtype)
    rms = [float(r.float().pow(2).mean().sqrt()) for r in real]
    rnd_rms = float(rnd.float().pow(2).mean().sqrt())
    inputs = {
        "real": real,
        "table's random": [rnd] * len(runs),
        "real, next layer's": real[1:] + real[:1],
        "random at real rms": [(rnd.float() * (s / rnd_rms)).to(dtype) for s in rms],
    }
    print(f"{len(runs)} sparse layers, {a.batch} rows, {dtype}; rms of the captured rows per layer "
          f"{min(rms):.2f}-{max(rms):.2f} (the table's {rnd_rms:.2f})", flush=True)
    times = {k: [] for k in inputs}
    stats = {}
    with torch.inference_mode():
        for name, xs in inputs.items():  # warm-up and the routing of each
            routing(blocks)
            for run, x in zip(runs, xs):
                run(x)
            stats[name] = routing(blocks)
        for r in range(a.rounds):
            order = list(inputs) if r % 2 == 0 else list(reversed(inputs))
            for name in order:
                xs = inputs[name]
                times[name].append(_timed(lambda xs=xs: [run(x) for run, x in zip(runs, xs)]))
    base = times["table's random"]
    for name, ts in times.items():
        distinct, top, hist = stats[name]
        ratio = sorted(t / b for t, b in zip(ts, base))
        q = statistics.quantiles(ratio, n=4) if len(ratio) >= 2 else [ratio[0]] * 3
        print(f"{name:22s} {statistics.median(ts) * 1e3:8.2f} ms a pass; over random's: "
              f"median {statistics.median(ratio):.3f} "
              f"(quartiles {q[0]:.3f}-{q[2]:.3f})  distinct experts {distinct:.1f}, max rows {top}, "
              f"rows per expert {dict(sorted(hist.items()))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
