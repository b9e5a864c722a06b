"""The mixture-of-experts roofline: which experts a step reads.

A sparse layer's step reads the weights of the distinct experts its tokens chose. With B tokens each
choosing k of E experts uniformly at random (without repeats per token), an expert is missed by one token
with probability 1 - k/E, by all B with (1 - k/E)^B, so the expected number of distinct experts read is
    E(B) = E * (1 - (1 - k/E)^B):
k at B = 1, approaching E as B grows (about E - E * e^(-kB/E)). Skewed routing reads fewer (the popular
experts repeat). The cost model prices a sparse layer's expert weights at E(B) experts, or at the count
the engine measured (analysis/op_counts.mlp_counts' `distinct`); the FLOPs at k experts per token either
way. The lab `moe` (labs/moe.py) puts both beside the measured counts.
"""

from __future__ import annotations

from typing import Optional

from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """E * (1 - (1 - k/E)^B): distinct experts read by `tokens` tokens under uniform top-k routing."""
    if not 0 < top_k <= num_experts or tokens < 0:
        raise InvalidParameterError("experts", f"{top_k} of {num_experts} experts for {tokens} tokens")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def imbalance(counts: list) -> float:
    """max / mean of the tokens per expert (1.0: perfectly even; E / k... when one expert takes all)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 0.0


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token uses: all of a dense model's; a sparse layer's router, k routed experts and its
    shared expert instead of all E."""
    if cfg.moe is None:
        return cfg.num_parameters()
    e, d = cfg.moe.experts, cfg.hidden_size
    unused = (e.num_experts - e.top_k) * 3 * d * e.intermediate_size
    return cfg.num_parameters() - cfg.moe.num_sparse(cfg.num_hidden_layers) * unused


def moe_summary(cfg: ModelConfig, tokens: Optional[int] = None) -> Optional[dict]:
    """What explain shows of a MoE model (None for a dense one): experts, k, the sparse layers, the active
    parameters, and the expected distinct experts per sparse layer at `tokens` tokens."""
    if cfg.moe is None:
        return None
    e = cfg.moe.experts
    out = {"num_experts": e.num_experts, "top_k": e.top_k, "expert_width": e.intermediate_size,
           "shared_expert_width": e.shared_intermediate_size, "expert_format": e.weight_format or None,
           "sparse_layers": cfg.moe.num_sparse(cfg.num_hidden_layers),
           "total_parameters": cfg.num_parameters(), "active_parameters": active_parameters(cfg)}
    if tokens is not None:
        out["expected_distinct_experts"] = expected_distinct_experts(e.num_experts, e.top_k, tokens)
    return out
