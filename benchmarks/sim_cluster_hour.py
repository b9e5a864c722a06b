"""How long the simulator takes for one simulated hour of a 64-GPU cluster (issue 40's floor: 2 minutes).

Llama-3-70B, 8 replicas of TP8 on H100s (64 GPUs) behind a router, bench serve's random workload
at 50 requests/s (prompts 512-1536 tokens, outputs 128-384). Runs --seconds of arrivals (the whole hour
by default) and prints the wall and CPU seconds it took (--workers N: the replicas in N processes,
sim/parallel.py; CPU seconds include the workers'), the steps simulated, the CPU time per step, and the CPU
seconds per simulated hour (a shorter run scales linearly: the cluster is in steady state after the
first seconds). One process: the simulator is single-threaded.

    python benchmarks/sim_cluster_hour.py --seconds 3600 --json benchmarks/results/sim_cluster_hour.json

--context-quantum 0 predicts every step on its exact shape (sim/step_time.py); --check-every N predicts every
Nth step on its exact shape as well and reports how far the memoised prediction was from it (stepping one
at a time: the check wraps the memo single steps use). --no-fast-forward steps every replica one step at a
time (sim/fast_forward.py plans the stretches of steps that only decode by default; the same report).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np

from servescope.cli.output import write_json
from servescope.config.engine import BatchingConfig, ParallelConfig
from servescope.sim.cluster import ROUTERS, Deployment
from servescope.sim.run import simulate
from servescope.sim.spec import DEFAULT_CONTEXT_QUANTUM, instance_spec
from servescope.bench.arrivals import arrival_times


CHUNK = 1024  # prompts drawn at once (one generator per chunk: a generator per prompt costs more than its draw)


class LazyWorkload:
    """bench serve's random workload drawn a chunk of requests at a time when the driver asks for them: an
    hour at 50 req/s is 180k prompts of ~1k tokens, ~7 GB as Python ints if drawn up front."""

    def __init__(self, n: int, rate: float, prompt: tuple, output: tuple, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        # Python numbers, read per request (a numpy scalar read costs several times a list's)
        self.times = arrival_times(n, rate, 1.0, seed).tolist()
        prompt_lens = rng.integers(prompt[0], prompt[1] + 1, n)
        self.prompt_lens, self.output_lens = prompt_lens.tolist(), rng.integers(output[0], output[1] + 1, n).tolist()
        self.starts = np.concatenate(([0], np.cumsum(prompt_lens))).tolist()
        self.vocab, self.seed = vocab, seed
        # (chunk index, its prompts' tokens back to back, int64). A prompt's list is made from its slice when read:
        # its ints made then cost less than drawing the chunk as references to shared int objects did (an object
        # array gathered from a vocabulary's worth of ints touches a random one of them per token)
        self._chunk = (-1, None)

    def prompt(self, i: int) -> list:
        """Request i's prompt tokens (a new list: the engine copies it into its Request)."""
        c = i // CHUNK
        if self._chunk[0] != c:
            lo, hi = self.starts[c * CHUNK], self.starts[min((c + 1) * CHUNK, len(self.times))]
            self._chunk = (c, np.random.default_rng((self.seed, c)).integers(0, self.vocab, hi - lo))
        base = self.starts[c * CHUNK]
        return self._chunk[1][self.starts[i] - base:self.starts[i + 1] - base].tolist()

    def __len__(self) -> int:
        return len(self.times)

    def __getitem__(self, i: int) -> "LazyRequest":
        return LazyRequest(self, i)


class LazyRequest:
    """A SimRequest whose prompt is drawn when read (the driver reads it once, to send it)."""

    def __init__(self, w: LazyWorkload, i: int):
        self.w, self.i = w, i
        self.arrival, self.prompt_len, self.output_len = float(w.times[i]), int(w.prompt_lens[i]), int(w.output_lens[i])

    @property
    def prompt(self) -> list:
        return self.w.prompt(self.i)


def check_memo(timer, every: int) -> list:
    """Wrap the replicas' shared StepTimer so that every `every`th step is also predicted on its exact rows;
    the list fills with (memoised - exact) / exact of those steps (the checks' CPU time counts in the run)."""
    errors: list = []
    memo = timer._memo
    calls = [0]

    def checked(seqs, num_logits):
        hit = memo(seqs, num_logits)
        calls[0] += 1
        if calls[0] % every == 0:
            exact = timer.predictor.predict(list(seqs), num_logits).seconds
            errors.append(hit[0].seconds / exact - 1)
        return hit

    timer._memo = checked
    return errors


def cpu_seconds() -> tuple:
    """CPU seconds of this process and of its finished children (the worker processes)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3600.0, help="seconds of arrivals to simulate")
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--router", default="least-tokens", choices=ROUTERS)
    p.add_argument("--context-quantum", type=int, default=DEFAULT_CONTEXT_QUANTUM)
    p.add_argument("--check-every", type=int, default=0, help="compare every Nth memoised step with its exact one")
    p.add_argument("--workers", type=int, default=1, help="processes the 8 replicas run in (sim/parallel.py)")
    p.add_argument("--no-fast-forward", action="store_true", help="step every replica one step at a time")
    p.add_argument("--model", default="llama-3-70b", help="model preset (e.g. gemma-3-1b: a hybrid of windows)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel GPUs per replica")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    spec = instance_spec(a.model, "H100", parallel=ParallelConfig(tensor_parallel_size=a.tp),
                         batching=BatchingConfig(max_num_seqs=128, max_num_batched_tokens=4096))
    spec = spec.replace(context_quantum=a.context_quantum)
    reqs = LazyWorkload(int(a.rate * a.seconds), a.rate, (512, 1536), (128, 384), spec.model.vocab_size)
    fast_forward = not (a.no_fast_forward or a.check_every)
    dep = Deployment(spec, 8, a.router, keep_steps=False, fast_forward=fast_forward)
    errors = check_memo(dep.engines[0].timer, a.check_every) if a.check_every else None
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    run = simulate(dep, reqs, workers=1 if a.check_every else a.workers)
    wall = time.perf_counter() - wall0
    cpu_self, cpu_children = (after - before for after, before in zip(cpu_seconds(), cpu0))
    cpu = cpu_self + cpu_children
    r = run.result
    steps = sum(e.num_steps for e in dep.engines)
    out = {"simulated_seconds": run.result.duration_s, "requests": len(reqs), "steps": steps, "cpu_seconds": cpu,
           "wall_seconds": wall, "cpu_us_per_step": cpu / steps * 1e6,
           "cpu_seconds_per_simulated_hour": cpu * 3600 / run.result.duration_s,
           "wall_seconds_per_simulated_hour": wall * 3600 / run.result.duration_s, "workers": a.workers,
           "cpu_seconds_this_process": cpu_self, "cpu_seconds_workers": cpu_children,
           "median_ttft_ms": r.ttft.median_ms, "p90_ttft_ms": r.ttft.percentiles_ms[90.0],
           "p99_ttft_ms": r.ttft.percentiles_ms[99.0], "median_tpot_ms": r.tpot.median_ms,
           "p90_tpot_ms": r.tpot.percentiles_ms[90.0], "p99_tpot_ms": r.tpot.percentiles_ms[99.0],
           "output_throughput": r.output_throughput, "router": a.router, "rate": a.rate,
           "context_quantum": a.context_quantum, "fast_forward": fast_forward, "model": a.model, "tp": a.tp}
    if errors:
        rel = np.abs(np.array(errors))
        out["memo_check"] = {"steps": len(errors), "mean_error": float(np.mean(errors)),
                             "mean_abs_error": float(rel.mean()), "p99_abs_error": float(np.percentile(rel, 99)),
                             "max_abs_error": float(rel.max())}
    print(json.dumps(out, indent=1))
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
