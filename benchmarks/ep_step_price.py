"""Expert parallelism over gloo, measured beside its price: the all-to-all of each MoE step and the step.

    python benchmarks/ep_step_price.py [--model random:PRESET | DIR] [--ep 2] [--threads 1]
        [--batches 1,4,16] [--new 16] [--json out.json]

One engine at EP = N (N local processes, `--threads` each; the experts split over them, dispatch and combine
as gloo all_to_all_single: parallel/expert_parallel.py) decodes `b` sequences at a time. Each decode step's
StepRecord carries what rank 0 measured -- the step's wall time, its time inside collectives (comm_seconds)
and, of that, its all-to-alls (all_to_all_seconds) -- and what the cost model predicted for it
(predicted_seconds, with predicted_comm_seconds for the collectives: analysis/collectives.expert_parallel_cost
on the link the engine probed, `local-gloo`, its all-to-all measured on its own, and the wait for the busier
rank's experts and for the ranks' spread on equal work, analysis/parallel_skew.py). Printed per batch: the
medians of each and the errors (predicted - measured) / measured, then the prediction's parts: the rank's
compute (host overhead included), the all-to-alls, the other collectives (the all-gathers and the step plan's
broadcasts) and the wait, and the step's error priced with the routing's skew alone (the link's desync 0, as
before it was measured); then rank
0's collectives by kind, as it issued them (timed here around torch.distributed's calls in this process, rank
0's, each call counted in the step it fell in): per step the calls of each kind and their median ms per call
(the plan's two broadcasts together; the tokens-per-expert all-gather, the dispatch, the combine and the
outputs' all-gather of each sparse layer), beside the price of one (collectives.plan_seconds, all_gather_seconds,
all_to_all_seconds on the probed link; the combine's wait for the busier rank apart). The model is a mid-size
random Qwen3-MoE (8 layers, hidden 1024, 32 experts of 512, top 8) unless --model names another.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from moe_float_plan import CONFIG  # noqa: E402


def measure(model: str, args) -> dict:
    from servescope.bench.latency import run_engine_latency  # (torch)
    from servescope.engine.llm import LLM  # (torch)

    from servescope.measure.local_hardware import local_gloo_link  # (torch) measured here once, then cached

    link = local_gloo_link(measure=True)
    print(link.describe(), flush=True)
    calls = CallLog()
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
                  f"other collectives {med['p_other'] * 1e3:5.2f} (plan {med['p_plan'] * 1e3:4.2f}), wait "
                  f"{med['p_wait'] * 1e3:5.2f}; measured: compute {med['m_compute'] * 1e3:6.2f}, all-to-all (its "
                  f"wait in it) {med['all_to_all_seconds'] * 1e3:5.2f}, other collectives {med['m_other'] * 1e3:5.2f}; "
                  f"step error with the routing's skew alone (no ranks' spread) {med['skew_only_error']:+.1%}",
                  flush=True)
            med["calls"] = calls.by_kind(steps)
            print("    per call, measured / priced: " + ", ".join(
                f"{k} {c['calls']:g}/step {c['seconds'] * 1e3:5.2f} / {price(llm, link, k, b) * 1e3:4.2f} ms"
                for k, c in med["calls"].items()), flush=True)
    finally:
        calls.remove()
        llm.engine.shutdown()
    return out


def torch_threads() -> int:
    import torch  # (torch)

    return torch.get_num_threads()


def breakdown(llm, steps: list) -> dict:
    """Medians of the prediction's parts over decode `steps` (the engine's own predictor, each step's contexts
    and measured distinct experts) and of the measured compute and collectives besides the all-to-alls."""
    import dataclasses  # (stdlib)

    predictor = llm.engine.step_cost_predictor.predictor
    # the same steps priced without the ranks' spread on equal work (the routing's skew alone: LinkSpec.desync 0)
    skew_only = dataclasses.replace(predictor, link=dataclasses.replace(predictor.link, desync=0.0))
    parts = []
    for s in steps:
        active = s.moe_experts_active
        seqs, distinct = [(1, c - 1) for c in s.context_lens], sum(active) / len(active) if active else None
        p = predictor.predict(seqs, len(s.context_lens), distinct)
        comm = p.comm_seconds or 0.0
        parts.append({"p_compute": p.seconds - comm, "p_a2a": p.all_to_all_seconds, "p_wait": p.wait_seconds,
                      "p_other": comm - p.all_to_all_seconds - p.wait_seconds, "p_plan": p.plan_seconds,
                      "m_compute": s.compute_seconds,
                      "m_other": s.comm_seconds - s.all_to_all_seconds,
                      "skew_only_error": skew_only.predict(seqs, len(s.context_lens), distinct).seconds
                      / s.wall_seconds - 1})
    return {k: statistics.median(d[k] for d in parts) for k in parts[0]}


class CallLog:
    """Rank 0's collectives as this process issues them: torch.distributed's broadcast, all-gather and
    all_to_all_single wrapped to log (kind, start, end) on perf_counter, the clock of StepRecord.start_time."""

    KINDS = {"broadcast": "plan", "all_gather_single": "all-gather", "all_gather_into_tensor": "all-gather",
             "all_to_all_single": "all-to-all"}

    def __init__(self):
        import torch.distributed as dist  # (torch)

        self.dist, self.log, self.saved = dist, [], {}
        for name, kind in self.KINDS.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                self.saved[name] = fn
                setattr(dist, name, self._wrap(fn, kind))

    def _wrap(self, fn, kind):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.log.append((kind, t0, time.perf_counter()))
            return out
        return timed

    def remove(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)

    def by_kind(self, steps: list) -> dict:
        """{kind: {calls per step, median seconds per call}} over `steps`: the plan (its broadcasts, timed
        together), and per sparse layer, in the order a layer issues them, the tokens-per-expert all-gather
        ("counts"), the dispatch, the combine and the outputs' all-gather ("outputs")."""
        names = {"all-gather": ("counts", "outputs"), "all-to-all": ("dispatch", "combine"), "plan": ("plan",)}
        per = {k: [] for k in ("plan", "counts", "dispatch", "combine", "outputs")}
        calls = {k: [] for k in per}
        for s in steps:
            seen = {k: 0 for k in names}
            step = {k: [] for k in per}
            for kind, t0, t1 in self.log:
                if s.start_time <= t0 < s.start_time + s.wall_seconds:
                    step[names[kind][seen[kind] % len(names[kind])]].append(t1 - t0)
                    seen[kind] += 1
            for k, ts in step.items():
                calls[k].append(len(ts))
                per[k] += [sum(ts)] if k == "plan" and ts else ts
        return {k: {"calls": statistics.median(calls[k]), "seconds": statistics.median(ts)}
                for k, ts in per.items() if ts}


def price(llm, link, kind: str, batch: int) -> float:
    """The cost model's seconds for one call of `kind` (CallLog.by_kind's) in a decode step of `batch` tokens."""
    from servescope.analysis.collectives import (all_gather_seconds, all_to_all_seconds, plan_bytes,
                                                 plan_seconds)

    cfg, ep = llm.engine.model_config, llm.engine.step_cost_predictor.predictor.ep
    e = cfg.moe.experts
    rows = -(-batch // ep) * cfg.hidden_size * 4  # a rank's slice [Tr, Dm], float32
    return {"plan": lambda: plan_seconds(plan_bytes(batch, batch), ep, link),
            "counts": lambda: all_gather_seconds(e.num_experts * 8, ep, link),
            "outputs": lambda: all_gather_seconds(rows, ep, link),
            "dispatch": lambda: all_to_all_seconds(rows * e.top_k * (ep - 1) / ep, ep, link),
            "combine": lambda: all_to_all_seconds(rows * e.top_k * (ep - 1) / ep, ep, link)}[kind]()


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
