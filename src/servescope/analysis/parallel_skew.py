"""The wait for the slower rank under expert parallelism (pure functions).

Each sparse layer's combine all-to-all (parallel/expert_parallel.py) cannot end before the busiest rank's
experts are done: a rank whose experts got fewer rows, or fewer distinct experts to read, waits there for the
other. The cost model prices one rank's experts at the mean load (op_counts.mlp_counts at expert_parallel N:
1/N of the routed rows and of the distinct experts read), so every sparse layer adds
    wait = t(busiest rank's load) - t(mean load)
to a rank's step, inside its collectives (what rank 0's comm_seconds measures). Perfectly balanced routing
waits for nothing.

The busiest rank's load under uniform routing (each of T tokens picks k of E experts, no repeats; rank r holds
m = E/N of them):
- rows R_r (the (token, expert) pairs its experts run): per token a hypergeometric draw, mean k/N; over the
  ranks they sum to kT, so their variance less their covariance is v - c = T k (E - k) / (N (E - 1)).
- distinct experts D_r (of its m, those some token chose): with p = 1 - (1 - k/E)^T an expert's chance to be
  read and q = (E - k)(E - k - 1) / (E (E - 1)) a token's chance to miss two given experts, any two experts are
  both read with P2 = 1 - 2 (1 - p) + q^T, covariance c1 = P2 - p^2, so v - c = m (p (1 - p) - c1) (D_r and
  D_s of two ranks: m^2 c1 apart; within one rank m p (1 - p) + m (m - 1) c1).
Loads exchangeable over the ranks with variance v and covariance c have X_i - mean(X) distributed as N
independent ones of variance v - c, less their mean; taken as Gaussian, E[max_i X_i] = mean + sqrt(v - c) e_N,
e_N the expected maximum of N standard normals (0.564 at N = 2, 1.029 at N = 4). A decode token at E = 32,
k = 8, N = 2: 4.99 distinct experts on the busier rank against the exact hypergeometric 4.94.
The busiest rank is then priced by the cost model itself, as a rank whose share is that load (expert_parallel
N' = kT / rows, distinct experts N' x its distinct), so the wait is in the same rates as the step's compute.

Equal work is not equal time either: two ranks reading their weights at once on one machine's memory finish
apart (rank 0 waited in the combine about as often and as long as the other rank did in it: not a skew of the
routing). A link whose probe measured it (LinkSpec.desync: the sd of one rank's time for the same memory-bound
work over its mean, parallel/link_probe.py) adds per sync after a segment of t seconds of a rank's work a spread
of sd desync x t, independent of the load's: the experts' segment waits e_N sqrt(s_load^2 + (desync t)^2) (the
two spreads added as variances), the rest of the layer's work (attention, norms, router: before the
tokens-per-expert all-gather) e_N desync t.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

from servescope.analysis.cost_model import step_cost
from servescope.analysis.hardware import HardwareSpec
from servescope.analysis.moe import expected_distinct_experts
from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError


@lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals]: the integral of x n phi(x) Phi(x)^(n - 1) (Simpson, 4000
    intervals over [-10, 10]); 0 for one."""
    if n < 1:
        raise InvalidParameterError("ranks", f"the maximum of {n} values")
    if n == 1:
        return 0.0
    steps, lo, hi = 4000, -10.0, 10.0
    h = (hi - lo) / steps

    def f(x: float) -> float:
        return x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * math.erfc(-x / math.sqrt(2))) ** (n - 1)

    total = f(lo) + f(hi) + sum((4 if i % 2 else 2) * f(lo + i * h) for i in range(1, steps))
    return total * h / 3


def busiest_rank_load(num_experts: int, top_k: int, tokens: int, ranks: int) -> tuple:
    """((mean rows, busiest rank's rows), (mean distinct experts, busiest rank's distinct experts)) of one
    sparse layer's `tokens` tokens under uniform top-k routing over `ranks` ranks of E/N experts each."""
    e, k, t, n = num_experts, top_k, int(tokens), ranks
    if n < 1 or e % n or not 0 < k <= e or t < 0:
        raise InvalidParameterError("experts", f"{k} of {e} experts over {n} ranks for {t} tokens")
    m, en = e // n, expected_max_normal(n)
    rows = k * t / n
    rows_max = min(min(k, m) * t, rows + math.sqrt(t * k * (e - k) / (n * (e - 1)) if e > 1 else 0.0) * en)
    p = expected_distinct_experts(e, k, t) / e
    q = (e - k) * (e - k - 1) / (e * (e - 1)) if e > 1 else 0.0
    c1 = (1 - 2 * (1 - p) + q ** t) - p * p
    distinct = m * p
    spread = math.sqrt(max(0.0, m * (p * (1 - p) - c1))) * en
    return (rows, rows_max), (distinct, min(float(m), rows_max, distinct + spread))


def expert_wait_seconds(cfg: ModelConfig, seqs: list, hw: HardwareSpec, dtypes: tuple, ep: int,
                        num_logits: Optional[int] = None, distinct_experts: Optional[float] = None,
                        desync: float = 0.0) -> float:
    """A rank's expected wait per step for the busiest rank's experts, over the step's sparse layers: the cost
    model's step at the busiest rank's load less at the mean rank's (0 at EP = 1, for a dense model, for an
    empty step), with desync > 0 (LinkSpec.desync) the ranks' spread on equal work added (the module
    docstring). cfg: the rank's model (collectives.shard_config); dtypes (weight, kv, activation);
    distinct_experts: the step's measured distinct experts per layer over every rank (None: uniform routing's)."""
    if ep <= 1 or cfg.moe is None:
        return 0.0
    tokens = sum(n for n, _ in seqs)
    if tokens <= 0:
        return 0.0
    e = cfg.moe.experts
    (rows, rows_max), (distinct, distinct_max) = busiest_rank_load(e.num_experts, e.top_k, tokens, ep)
    if distinct_experts is not None:  # the measured mean, the spread uniform routing's
        distinct_max = min(float(e.num_experts // ep), rows_max, distinct_max - distinct + distinct_experts / ep)
        distinct = distinct_experts / ep
    wdt, kdt, adt = dtypes
    share = e.top_k * tokens / rows_max  # the busiest rank priced as a rank of share N' = kT / its rows

    def ops(n: float, total_distinct: float) -> dict:
        cost = step_cost(cfg, seqs, hw, wdt, kdt, adt, num_logits=num_logits, distinct_experts=total_distinct,
                         expert_parallel=n)
        return {o.name: o.seconds for o in cost.ops}

    mean = ops(ep, distinct * ep)
    load = max(0.0, ops(share, distinct_max * share)["mlp"] - mean["mlp"])
    if desync <= 0:
        return load
    spread = expected_max_normal(ep) * desync  # the expected maximum's excess per second of every rank's work
    # the layers' own work besides the experts: not the head (rank 0's alone, before the next step's plan)
    rest = sum(t for name, t in mean.items() if name not in ("mlp", "lm_head", "embedding"))
    return math.hypot(load, spread * mean["mlp"]) + spread * rest
