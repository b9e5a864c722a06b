"""Expert parallelism over gloo, measured beside its price: the all-to-all of each MoE step and the step.

    python benchmarks/ep_step_price.py [--model random:PRESET | DIR] [--ep 2] [--threads 1]
        [--batches 1,4,16] [--new 16] [--json out.json]

One engine at EP = N (N local processes, `--threads` each; the experts split over them, dispatch and combine
as gloo all_to_all_single: parallel/expert_parallel.py) decodes `b` sequences at a time. Each decode step's
StepRecord carries what rank 0 measured -- the step's wall time, its time inside collectives (comm_seconds)
and, of that, its all-to-alls (all_to_all_seconds) -- and what the cost model predicted for it
(predicted_seconds, with predicted_comm_seconds for the collectives: analysis/collectives.expert_parallel_cost
on the link the engine probed, `local-gloo`, its all-to-all measured on its own, and the wait for the busier
rank's experts, analysis/parallel_skew.py). Printed per batch: the medians of each and the errors
(predicted - measured) / measured, then the prediction's parts: the rank's compute (host overhead included),
the all-to-alls, the other collectives (all-gathers, the step plan's broadcast is not priced) and the wait. The
model is a mid-size random Qwen3-MoE (8 layers, hidden 1024, 32 experts of 512, top 8) unless --model names
another.
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

    from servescope.measure.local_hardware import local_gloo_link  # (torch) measured here once, then cached

    print(local_gloo_link(measure=True).describe(), flush=True)
    llm = LLM(model=model, dtype=args.dtype, num_threads=args.threads or None, expert_parallel_size=args.ep,
              max_num_seqs=max(args.batches), max_model_len=512, skip_tokenizer_init=True)
    print(f"torch threads on rank 0: {torch_threads()}", flush=True)
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
            med.update(breakdown(llm, steps))
            print(f"    predicted: compute {med['p_compute'] * 1e3:6.2f} ms, all-to-all {med['p_a2a'] * 1e3:5.2f}, "
                  f"other collectives {med['p_other'] * 1e3:5.2f}, wait {med['p_wait'] * 1e3:5.2f}; measured: "
                  f"compute {med['m_compute'] * 1e3:6.2f}, all-to-all (its wait in it) "
                  f"{med['all_to_all_seconds'] * 1e3:5.2f}, "
                  f"other collectives {med['m_other'] * 1e3:5.2f}", flush=True)
    finally:
        llm.engine.shutdown()
    return out


def torch_threads() -> int:
    import torch  # (torch)

    return torch.get_num_threads()


def breakdown(llm, steps: list) -> dict:
    """Medians of the prediction's parts over decode `steps` (the engine's own predictor, each step's contexts
    and measured distinct experts) and of the measured compute and collectives besides the all-to-alls."""
    predictor = llm.engine.step_cost_predictor.predictor
    parts = []
    for s in steps:
        active = s.moe_experts_active
        p = predictor.predict([(1, c - 1) for c in s.context_lens], len(s.context_lens),
                              sum(active) / len(active) if active else None)
        comm = p.comm_seconds or 0.0
        parts.append({"p_compute": p.seconds - comm, "p_a2a": p.all_to_all_seconds, "p_wait": p.wait_seconds,
                      "p_other": comm - p.all_to_all_seconds - p.wait_seconds, "m_compute": s.compute_seconds,
                      "m_other": s.comm_seconds - s.all_to_all_seconds})
    return {k: statistics.median(d[k] for d in parts) for k in parts[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="random:PRESET or a checkpoint directory (default: a mid-size "
                                                  "random Qwen3-MoE)")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: the runtime's default)")
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
