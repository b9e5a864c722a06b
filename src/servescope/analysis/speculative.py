"""What speculative decoding should gain: expected tokens per step and the predicted speed-up.

With per-draft acceptance rate a (each draft accepted with probability a, independently, until the first
rejection) and k drafts, a verification step emits E = (1 - a^(k+1)) / (1 - a) tokens (the accepted drafts
plus the target's own token; k + 1 when a = 1). It costs one target step over B(1 + k) rows instead of B
rows, plus the proposer: a draft model costs k of its own one-token decode steps over the B rows (exactly
k for a self-draft on the target's KV cache, spec/draft.py; a draft with its own cache also prefills each
prompt once), n-gram lookup nothing worth counting. So

    speed-up = E * t_target(B) / (t_target(B (1 + k)) + t_propose(B, k))

It pays while decode is memory-bound (t_target(B (1 + k)) ~ t_target(B): the weights are read once
whatever the rows) and stops paying as the batch approaches the compute crossover, where each extra row
costs its full FLOPs. Pure functions of numbers: the caller brings the step times (the cost model's).
"""

from __future__ import annotations

from typing import Callable

from servescope.analysis.cost_model import step_cost


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
           propose_seconds: Callable[[int], float] = lambda k: 0.0, min_gain: float = 1.05) -> tuple:
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


BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def explain_speculative(cfg, hw, method: str, k: int, acceptance: float, context_len: int,
                        weight_dtype: str = "bfloat16", kv_dtype=None, act_dtype=None, draft_cfg=None,
                        draft_weight_dtype: str = "int8", batches=BATCHES) -> dict:
    """When speculation pays on `hw`: per batch size the predicted step times without and with k drafts
    (the target's step over B (1 + k) rows; a draft model's k decode steps over B rows), the speed-up at
    per-draft acceptance `acceptance`, and the best k. The draft defaults to the target's own shape in
    draft_weight_dtype (self-speculation with a quantised copy). crossover_batch: the first batch size
    where k drafts stop paying (None: they pay at every batch listed)."""
    if k < 1 or not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"need k >= 1 and 0 <= acceptance <= 1, got k={k}, acceptance={acceptance}")

    def target(rows: int) -> float:
        return step_cost(cfg, [(1, context_len)] * rows, hw, weight_dtype, kv_dtype, act_dtype).predicted_seconds

    def draft(rows: int) -> float:
        if method != "draft":
            return 0.0
        d = draft_cfg or cfg
        return step_cost(d, [(1, context_len)] * rows, hw, draft_weight_dtype, kv_dtype, act_dtype).predicted_seconds

    rows, crossover = [], None
    for b in batches:
        t_base, t_verify, t_prop = target(b), target(b * (1 + k)), k * draft(b)
        gain = predicted_speedup(acceptance, k, t_base, t_verify, t_prop)
        kb, gb = best_k(acceptance, k, target, b, lambda j: j * draft(b))
        rows.append({"batch": b, "base_step_seconds": t_base, "verify_step_seconds": t_verify,
                     "propose_seconds": t_prop, "speedup": gain, "best_k": kb, "best_speedup": gb})
        if crossover is None and gain < 1.0:
            crossover = b
    return {"method": method, "k": k, "acceptance": acceptance, "context_len": context_len,
            "expected_tokens_per_step": expected_tokens_per_step(acceptance, k),
            "draft_weight_dtype": draft_weight_dtype if method == "draft" else None,
            "crossover_batch": crossover, "rows": rows}
