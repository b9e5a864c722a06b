"""A mixture-of-experts step's routing in its StepRecord: the experts each sparse layer read, the tokens
per expert, their imbalance and the routed experts' bytes (from model/moe.take_step_routing)."""

from __future__ import annotations

from servescope.telemetry.step_record import StepRecord


def record_routing(rec: StepRecord, per_layer: list, expert_bytes: int) -> None:
    """per_layer: tokens routed to each expert, one list per sparse layer; expert_bytes: one expert's
    weights."""
    if not per_layer or not any(sum(c) for c in per_layer):
        return
    rec.moe_experts_active = [sum(1 for n in counts if n) for counts in per_layer]
    rec.moe_tokens_per_expert = [sum(col) for col in zip(*per_layer)]
    # max / mean tokens per expert in each layer, averaged over the layers (1.0: every expert equally busy)
    ratios = [max(c) * len(c) / sum(c) for c in per_layer if sum(c)]
    rec.moe_imbalance = sum(ratios) / len(ratios)
    rec.moe_expert_bytes = sum(rec.moe_experts_active) * expert_bytes


def record_expert_parallel(rec: StepRecord, rows_per_rank: list, a2a_seconds: float, a2a_bytes: int) -> None:
    """rows_per_rank: the (token, expert) rows each expert-parallel rank's experts ran in the step."""
    rec.moe_rows_per_rank = list(rows_per_rank)
    total = sum(rows_per_rank)
    rec.moe_rank_imbalance = max(rows_per_rank) * len(rows_per_rank) / total if total else None
    rec.all_to_all_seconds, rec.all_to_all_bytes = a2a_seconds, a2a_bytes
