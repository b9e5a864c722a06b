"""Real 1 prefill + 1 decode disaggregation (engine/disaggregated.py) beside its simulation (sim/disagg.py).

The embedded SmolLM2-135M, one torch thread per engine (two processes on the machine's cores). First the
plain engine (this process's, later the decode engine) is warmed up and its measured / predicted step
table profiled on workloads of its own (labs/sim_validation.profile_steps); then the disaggregated pair
serves each workload on the wall clock (sim/driver.drive, the lab's WallClock: the same arrivals as the
simulation), and the simulator runs 1P1D of the same instance spec with that step table, the KV priced on
the measured local gloo link (measure/local_hardware.local_gloo_link). Prints measured, simulated and the
error of median TTFT, median TPOT, p90 TTFT and output throughput per workload.

    python benchmarks/disagg_1p1d.py --json benchmarks/results/disagg_1p1d.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from servescope.cli.output import write_json
from servescope.config import EngineConfig
from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.engine.disaggregated import DisaggregatedEngine
from servescope.engine.llm_engine import LLMEngine
from servescope.labs.sim_validation import WallClock, profile_steps
from servescope.measure.local_hardware import local_gloo_link, probe_local_cpu
from servescope.measure.sequence_overhead import host_costs
from servescope.sim.disagg import Disaggregated
from servescope.sim.driver import bench_result, drive
from servescope.sim.spec import HostCosts, instance_spec
from servescope.sim.step_table import StepTable
from servescope.sim.workload import synthetic_workload

BLOCKS, SEQS, BUDGET, MAX_LEN = 2048, 32, 512, 4096
WORKLOADS = {  # name: (prompts, input lengths, output lengths, requests/s)
    "low rate": (24, (64, 256), (32, 96), 1.0),
    "long prompts": (12, (1024, 2048), (16, 48), 0.5),
    "saturation": (32, (64, 256), (48, 96), math.inf),
}
METRICS = ("median_ttft_ms", "median_tpot_ms", "p90_ttft_ms", "output_throughput")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--step-table", default=None, help="a table this script profiled before (skips the profile)")
    p.add_argument("--save-table", default=None, help="write the profiled table here")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    config = EngineConfig(dtype="auto", num_threads=1, num_kv_blocks=BLOCKS, max_num_seqs=SEQS,
                          max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN, hardware="local-cpu")
    engine = LLMEngine(config)
    hw = probe_local_cpu()  # after the engine: keyed by the torch threads it set
    dtype = str(engine.dtype).replace("torch.", "")
    per_seq, per_token, source = host_costs(dtype, with_tokenizer=True)
    spec = instance_spec("smollm2-135m", hw, dtype=dtype, cache=KVCacheConfig(num_kv_blocks=BLOCKS),
                         batching=BatchingConfig(max_num_seqs=SEQS, max_num_batched_tokens=BUDGET,
                                                 max_model_len=MAX_LEN),
                         host=HostCosts(per_seq, per_token, source))
    vocab = spec.model.vocab_size
    t0 = time.perf_counter()
    table = StepTable.load(a.step_table) if a.step_table else profile_steps(engine, vocab)
    print(f"step table ready in {time.perf_counter() - t0:.0f} s", flush=True)
    if a.save_table:
        with open(a.save_table, "w") as f:
            json.dump(table.to_dict(), f)
    spec = spec.replace(step_table=table)
    link = local_gloo_link()
    engine.kv_manager.reset_prefix_cache()
    pair = DisaggregatedEngine(engine)
    drive(WallClock(pair), synthetic_workload(8, (16, 600), 8, vocab, math.inf, seed=99), prefix="warm")
    out = {"machine": {"torch_threads_per_engine": torch.get_num_threads(), "kv_link": link.name,
                       "kv_link_bandwidth": link.bandwidth, "kv_link_latency_s": link.latency_s},
           "workloads": {}}
    try:
        for i, name in enumerate(a.workloads):
            n, inp, outp, rate = WORKLOADS[name]
            reqs = synthetic_workload(n, inp, outp, vocab, rate, seed=2000 + i)
            first = len(pair.transfers)
            records, duration, _ = drive(WallClock(pair), reqs, prefix=f"real-{i}")
            real = bench_result(records, duration).to_dict()
            sim_dep = Disaggregated(spec, 1, 1, kv_link=link, keep_steps=False)
            sim = bench_result(*drive(sim_dep, reqs)[:2]).to_dict()
            sent = pair.transfers[first:]
            row = {m: {"measured": real[m], "simulated": sim[m], "error": sim[m] / real[m] - 1} for m in METRICS}
            row["transfers"] = {"count": len(sent), "mean_ms": 1e3 * sum(t[3] for t in sent) / max(len(sent), 1),
                                "mean_bytes": sum(t[2] for t in sent) / max(len(sent), 1),
                                "simulated_mean_ms": sim_dep.stats(1.0)["mean_transfer_ms"]}
            out["workloads"][name] = row
            print(name, json.dumps(row, indent=1), flush=True)
    finally:
        pair.shutdown()
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
