"""Expert parallelism over gloo, measured beside its price: the all-to-all of each MoE step and the step.

    python benchmarks/ep_step_price.py [--model random:PRESET | DIR] [--ep 2] [--threads 1]
        [--batches 1,4,16] [--new 16] [--json out.json]

One engine at EP = N (N local processes, `--threads` each; the experts split over them, dispatch and combine
as gloo all_to_all_single: parallel/expert_parallel.py) decodes `b` sequences at a time. Each decode step's
StepRecord carries what rank 0 measured -- the step's wall time, its time inside collectives (comm_seconds)
and, of that, its all-to-alls (all_to_all_seconds) -- and what the cost model predicted for it
(predicted_seconds, with predicted_comm_seconds for the collectives: analysis/collectives.expert_parallel_cost
on the link the engine probed, `local-gloo`). Printed per batch: the medians of each and the errors
(predicted - measured) / measured. The model is a mid-size random Qwen3-MoE (8 layers, hidden 1024, 32 experts
of 512, top 8) unless --model names another.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from moe_float_plan import CONFIG  # noqa: E402


def measure(model: str, args) -> dict:
    from servescope.bench.latency import run_engine_latency  # (torch)
    from servescope.engine.llm import LLM  # (torch)

    llm = LLM(model=model, dtype=args.dtype, num_threads=args.threads, expert_parallel_size=args.ep,
              max_num_seqs=max(args.batches), max_model_len=512, skip_tokenizer_init=True)
    out = {}
    try:
        for b in args.batches:
            res = run_engine_latency(llm, b, 16, args.new, iters=args.iters, measure_bandwidth=False)
            steps = [s for s in res["_steps"] if s.phase == "decode" and s.num_decode_seqs == b
                     and s.predicted_seconds is not None]
            med = {k: statistics.median(getattr(s, k) or 0.0 for s in steps)
                   for k in ("wall_seconds", "predicted_seconds", "comm_seconds", "predicted_comm_seconds",
                             "all_to_all_seconds")}
            med["steps"] = len(steps)
            med["step_error"] = med["predicted_seconds"] / med["wall_seconds"] - 1
            comm = med["comm_seconds"]
            med["comm_error"] = med["predicted_comm_seconds"] / comm - 1 if comm else None
            out[b] = med
            print(f"EP={args.ep} batch {b:2d}: step {med['wall_seconds'] * 1e3:7.2f} ms measured, "
                  f"{med['predicted_seconds'] * 1e3:7.2f} predicted ({med['step_error']:+.1%}); collectives "
                  f"{med['comm_seconds'] * 1e3:6.2f} ms measured (all-to-all {med['all_to_all_seconds'] * 1e3:6.2f}), "
                  f"{med['predicted_comm_seconds'] * 1e3:6.2f} predicted"
                  + (f" ({med['comm_error']:+.1%})" if med["comm_error"] is not None else "")
                  + f"  [{med['steps']} steps]", flush=True)
    finally:
        llm.engine.shutdown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="random:PRESET or a checkpoint directory (default: a mid-size "
                                                  "random Qwen3-MoE)")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(CONFIG, f)
            model = "random:" + os.path.join(tmp, "config.json")
        out = measure(model, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or "qwen3-moe mid", "ep": args.ep, "threads": args.threads,
                       "batches": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
