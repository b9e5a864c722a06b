"""What speculative decoding should gain: expected tokens per step and the predicted speed-up.

With per-draft acceptance rate a (each draft accepted with probability a, independently, until the first
rejection) and k drafts, a verification step emits E = (1 - a^(k+1)) / (1 - a) tokens (the accepted drafts
plus the target's own token; k + 1 when a = 1). It costs one target step over B(1 + k) rows instead of B
rows, plus the proposer (a draft model: about k of its own decode steps). So

    speed-up = E * t_target(B) / (t_target(B (1 + k)) + t_propose(B, k))

It pays while decode is memory-bound (t_target(B (1 + k)) ~ t_target(B): the weights are read once
whatever the rows) and stops paying as the batch approaches the compute crossover, where each extra row
costs its full FLOPs. Pure functions of numbers: the caller brings the step times (the cost model's).
"""

from __future__ import annotations

from typing import Callable


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Tokens one verification emits on average: sum_{i=0..k} a^i."""
    if k <= 0:
        return 1.0
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def predicted_speedup(acceptance: float, k: int, t_base: float, t_verify: float, t_propose: float = 0.0) -> float:
    """Tokens per second with speculation over tokens per second without (same batch)."""
    if k <= 0:
        return 1.0
    return expected_tokens_per_step(acceptance, k) * t_base / (t_verify + t_propose)


def best_k(acceptance: float, max_k: int, step_seconds: Callable[[int], float], batch: int,
           propose_seconds: Callable[[int], float] = lambda k: 0.0, min_gain: float = 1.02) -> tuple:
    """(k in 0..max_k with the highest predicted speed-up, that speed-up); 0 when no k gains min_gain.
    step_seconds(rows): the target's step time over that many one-token rows; batch: rows without
    speculation; propose_seconds(k): the proposer's cost for k drafts per request."""
    t_base = step_seconds(batch)
    best, gain = 0, 1.0
    for k in range(1, max_k + 1):
        g = predicted_speedup(acceptance, k, t_base, step_seconds(batch * (1 + k)), propose_seconds(k))
        if g > gain:
            best, gain = k, g
    return (best, gain) if gain >= min_gain else (0, 1.0)
