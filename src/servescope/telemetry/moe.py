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
