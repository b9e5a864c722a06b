"""Request arrival process: gamma-distributed gaps (Poisson when burstiness = 1), as vLLM.

Gaps have shape k = burstiness and scale 1 / (rate * k), so their mean is always
1 / rate and their coefficient of variation is 1 / sqrt(k): k < 1 is burstier
than Poisson, k > 1 more regular. rate = inf sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_gaps(n: int, request_rate: float, burstiness: float = 1.0, seed: int | None = 0) -> np.ndarray:
    """`n` inter-arrival gaps in seconds (float64). Gap i is the wait after sending request i."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not request_rate > 0:  # also rejects NaN
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(n, dtype=np.float64)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int | None = 0) -> np.ndarray:
    """Send times in seconds from the start: request 0 at 0, request i after i gaps."""
    gaps = arrival_gaps(n, request_rate, burstiness, seed)
    times = np.zeros(n, dtype=np.float64)
    if n > 1:
        times[1:] = np.cumsum(gaps[:-1])
    return times
