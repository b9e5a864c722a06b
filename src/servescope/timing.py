"""Wall-clock timing of a callable: the one helper the probes and benchmarks share (no imports from
the package, so that every layer may use it)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """Median wall time of `runs` calls of fn after `warmup` untimed calls (page faults, thread pool
    start, kernel selection)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
