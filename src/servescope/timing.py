"""Wall-clock timing of a callable: the one helper the probes and benchmarks share (no imports from
the package, so that every layer may use it)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], object], runs: int, warmup: int = 1, cuda: bool = False) -> float:
    """Median wall time of `runs` calls of fn after `warmup` untimed calls (page faults, thread pool
    start, kernel selection). cuda: time each call with CUDA events on the current stream (the GPU's
    time for the work fn queues), after a synchronize that ends the warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        import torch  # lazy: analysis/ uses this module and must import without torch

        torch.cuda.synchronize()
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
