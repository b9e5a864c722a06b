"""Run a workload on a simulated deployment; bench serve's result and a trace `servescope replay` plays."""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

from servescope.bench.metrics import BenchmarkResult
from servescope.sim.cluster import Deployment
from servescope.sim.driver import bench_result, drive
from servescope.sim.parallel import drive_replicas
from servescope.telemetry.trace import write_chrome_trace


@dataclass
class SimRun:
    result: BenchmarkResult
    deployment: Deployment
    finished: list  # Finished per request, in request order
    wall_seconds: float  # what the simulation itself took
    stats: dict = field(default_factory=dict)


def simulate(deployment: Deployment, requests: Sequence, max_concurrency: Optional[int] = None, goodput=None,
             percentiles=(90.0, 99.0), config: Optional[dict] = None, workers: int = 1) -> SimRun:
    """Send `requests` (sim/workload.SimRequest) to the deployment on its virtual clock. workers > 1: the
    replicas of a data-parallel Deployment without a concurrency limit run in that many processes
    (sim/parallel.py: the same results); anything else runs in this one. A Deployment with fast_forward (the
    default) without a concurrency limit goes through sim/parallel.py in one process too: its replicas plan
    their stretches of decodes (sim/fast_forward.py) and the router reads their loads from the plans, with
    the step-by-step run's results."""
    t0 = time.perf_counter()
    colocated = isinstance(deployment, Deployment) and max_concurrency is None  # not P/D instances
    with _no_cycle_collection():
        if colocated and ((workers > 1 and len(deployment.engines) > 1) or deployment.fast_forward):
            records, duration, finished = drive_replicas(deployment, requests, workers)
        else:
            records, duration, finished = drive(deployment, requests, max_concurrency)
        result = bench_result(records, duration, goodput, percentiles, config)
    return SimRun(result, deployment, finished, time.perf_counter() - t0, deployment.stats(duration))


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector off for the run (forked workers inherit it), back as it was after: the run
    makes millions of lists and objects that live to its end (requests, their token ids, times and records),
    and each full collection walks all of them, token by token -- a tenth of a cluster hour's CPU and growing
    with its length -- to find no garbage (reference counting frees what the simulator drops; the few
    cycles it leaves wait for the next collection)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def write_trace(path: str | Path, run: SimRun, instance: int = 0) -> Path:
    """The Chrome trace of one instance's steps (its StepRecords carry their predictions, as an engine's
    do) and the requests it served, for `servescope replay` and Perfetto."""
    engine = run.deployment.engines[instance]
    steps = engine.steps or []
    outputs = [SimpleNamespace(request_id=f.request_id, outputs=[SimpleNamespace(index=0, metrics=f.metrics)])
               for f in run.finished if f.request_id in run.deployment.served_by(instance)]
    return write_chrome_trace(path, steps, outputs)
