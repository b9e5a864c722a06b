"""servescope.labs: reproducible experiments, one file each, that make one serving concept visible.

Every lab runs on the local engine (the embedded SmolLM2-135M by default), writes PNG plots, a
markdown report with the measured and predicted numbers, and results.json into its output
directory. `servescope lab list` prints LABS; `servescope lab NAME` runs one.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Optional

from servescope.errors import InvalidParameterError
from servescope.labs.common import LabOptions, LabResult, LabSession

# name -> (module, one-line description); `lab all` runs the concept labs in this order
LABS = {
    "prefill-vs-decode": ("prefill_vs_decode",
                          "achieved FLOP/s and GB/s of prefill and decode steps placed on the local roofline"),
    "kv-cache": ("kv_cache", "time per token vs position with and without the KV cache; KV bytes vs context"),
    "attention-scaling": ("attention_scaling",
                          "TTFT vs prompt length up to 4096 tokens, quadratic term fitted; attention's share"),
    "batching": ("batching", "decode step time and tokens/s vs batch 1..64: the memory-bound plateau, then the rise"),
    "latency-vs-throughput": ("latency_vs_throughput",
                              "TTFT, TPOT and ITL vs throughput as closed-loop concurrency grows"),
    "chunked-prefill": ("chunked_prefill",
                        "ITL of running decodes when a long prompt arrives, with and without chunked prefill"),
    "speculative": ("speculative", "speed-up of n-gram speculation vs k and batch, copy-heavy and open prompts, "
                                   "measured beside predicted"),
    "quantization": ("quantization", "decode step time and KV capacity vs bits per weight and per cached token, "
                                     "measured beside predicted"),
    "moe": ("moe", "decode step time, bytes and experts read vs batch: dense vs MoE of equal active "
                   "parameters, measured beside predicted"),
    "kv-layouts": ("kv_layouts", "KV bytes per token, KV held per sequence and capacity vs context for MHA, GQA, "
                                 "MQA, windowed and hybrid layouts, measured beside predicted; decode step vs context"),
}
# not part of `lab all`: the cost model's validation (docs/VALIDATION.md)
EXTRA_LABS = {
    "validate": ("validate", "cost model vs measured step time: decode batch 1..32, prefill 128..2048 tokens"),
    "simulate": ("sim_validation", "the simulator (servescope simulate) vs the engine on the same workloads, "
                                   "135M and a 1B shape: TTFT, TPOT, throughput"),
    "cluster": ("cluster", "simulated 70B on H100s: colocated vs disaggregated goodput, DP scaling per router"),
    "parallelism": ("parallelism", "step time at TP x PP = 1x1, 2x1, 1x2 here (gloo) beside predicted; "
                                   "Llama-3-70B on 8 x H100/H200 predicted"),
}


def all_labs() -> dict:
    return {**LABS, **EXTRA_LABS}


def run_lab(name: str, opts: LabOptions, session: Optional[LabSession] = None) -> LabResult:
    """Run lab `name` with `opts` (a session shares loaded weights between labs)."""
    labs = all_labs()
    if name not in labs:
        raise InvalidParameterError("lab", f"unknown lab {name!r}; labs: {', '.join(labs)}")
    # the lab's module by name: `lab list` and one lab's run import only what they use
    mod = importlib.import_module(f"servescope.labs.{labs[name][0]}")
    session = session or LabSession(opts)
    session.opts = opts
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = mod.run(opts, session)
    result.seconds = time.perf_counter() - t0
    return result


__all__ = ["LABS", "EXTRA_LABS", "LabOptions", "LabResult", "LabSession", "all_labs", "run_lab"]
