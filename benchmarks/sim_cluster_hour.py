"""How long the simulator takes for one simulated hour of a 64-GPU cluster (issue 40's floor: 2 minutes).

Llama-3-70B, 8 replicas of TP8 on H100s (64 GPUs) behind a router, bench serve's synthetic workload
at 50 requests/s (prompts 512-1536 tokens, outputs 128-384). Runs --seconds of arrivals (the whole hour
by default) and prints the CPU seconds it took, the steps simulated, the CPU time per step, and the CPU
seconds per simulated hour (a shorter run scales linearly: the cluster is in steady state after the
first seconds). One process: the simulator is single-threaded.

    python benchmarks/sim_cluster_hour.py --seconds 3600 --json benchmarks/results/sim_cluster_hour.json
"""

from __future__ import annotations

import argparse
import json
import time

from servescope.config.engine import BatchingConfig, ParallelConfig
from servescope.sim.cluster import ROUTERS, Deployment
from servescope.sim.run import simulate
from servescope.sim.spec import instance_spec
from servescope.sim.workload import synthetic_workload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3600.0, help="seconds of arrivals to simulate")
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--router", default="least-tokens", choices=ROUTERS)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    spec = instance_spec("llama-3-70b", "H100", parallel=ParallelConfig(tensor_parallel_size=8),
                         batching=BatchingConfig(max_num_seqs=128, max_num_batched_tokens=4096))
    reqs = synthetic_workload(int(a.rate * a.seconds), (512, 1536), (128, 384), spec.model.vocab_size, a.rate)
    dep = Deployment(spec, 8, a.router, keep_steps=False)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    run = simulate(dep, reqs)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    steps = sum(e.num_steps for e in dep.engines)
    out = {"simulated_seconds": run.result.duration_s, "requests": len(reqs), "steps": steps, "cpu_seconds": cpu,
           "wall_seconds": wall, "cpu_us_per_step": cpu / steps * 1e6,
           "cpu_seconds_per_simulated_hour": cpu * 3600 / run.result.duration_s,
           "median_ttft_ms": run.result.ttft.median_ms, "median_tpot_ms": run.result.tpot.median_ms,
           "router": a.router, "rate": a.rate}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
