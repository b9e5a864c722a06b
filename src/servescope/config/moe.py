"""Mixture-of-experts as data: the experts of a model (MoeConfig, on ModelConfig.moe) and of one layer
(ExpertsSpec, on MlpSpec kind "moe"), read from and written back to each family's config.json fields.

A sparse layer routes every token to `top_k` of `num_experts` gated MLPs of width `intermediate_size`:
softmax over the router's logits, the top k kept (renormalised to sum to 1 where `norm_topk_prob`), the
experts' outputs summed with those weights. Qwen2-MoE adds a shared expert that every token runs, scaled
by sigmoid(shared_expert_gate(x)). Which layers are sparse is each family's rule (`sparse_layers`);
the others are the dense MLP of `ModelConfig.intermediate_size`. DeepSeek's routers (sigmoid scores,
grouped top-k, bias correction, routed scaling) and gpt-oss's wait for their attention kinds (MLA,
sinks): their configs are refused by the family table, not run as something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servescope.errors import InvalidParameterError

ROUTERS = ("softmax_topk",)

# config.json fields of the MoE families that only training reads (auxiliary losses, jitter noise)
TRAINING_ONLY = frozenset({"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"})
# the fields read by moe_from_hf, per family style (config/families.py's hf_fields adds them)
MIXTRAL_FIELDS = frozenset({"num_local_experts", "num_experts_per_tok"}) | TRAINING_ONLY
# (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts: its attribute map)
QWEN_MOE_FIELDS = frozenset({
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias"}) | TRAINING_ONLY
OLMOE_FIELDS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
                          "clip_qkv"}) | TRAINING_ONLY


@dataclass(frozen=True)
class ExpertsSpec:
    """The experts of one sparse layer."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's MLP width
    norm_topk_prob: bool = False  # renormalise the kept top-k probabilities to sum to 1
    shared_intermediate_size: int = 0  # a shared expert every token runs (0: none), gated by sigmoid(x . g)
    router: str = "softmax_topk"

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise InvalidParameterError("router", f"router {self.router!r} is not implemented "
                                                  f"(implemented: {', '.join(ROUTERS)})")
        if not 0 < self.top_k <= self.num_experts or self.intermediate_size <= 0:
            raise InvalidParameterError("num_experts_per_tok",
                                        f"{self.top_k} experts per token of {self.num_experts} "
                                        f"(width {self.intermediate_size}): need 0 < k <= E")
        if self.shared_intermediate_size < 0:
            raise InvalidParameterError("shared_expert_intermediate_size", "must not be negative")


@dataclass(frozen=True)
class MoeConfig:
    """A model's experts: the spec of its sparse layers and which layers are sparse."""

    experts: ExpertsSpec
    sparse_layers: tuple  # one bool per layer: True where the MLP is the experts

    def num_sparse(self, num_layers: int) -> int:
        return sum(self.sparse_layers[:num_layers])


def moe_from_hf(family_name: str, d: dict, num_layers: int) -> Optional[MoeConfig]:
    """The MoeConfig of a config.json dict of a MoE family (None for a dense family)."""
    if family_name == "mixtral":
        e = ExpertsSpec(int(d["num_local_experts"]), int(d.get("num_experts_per_tok", 2)),
                        int(d["intermediate_size"]), norm_topk_prob=True)
        return MoeConfig(e, (True,) * num_layers)
    if family_name not in ("qwen2_moe", "qwen3_moe", "olmoe"):
        return None
    if d.get("clip_qkv") is not None:
        raise InvalidParameterError("clip_qkv", f"config.json field 'clip_qkv' = {d['clip_qkv']!r} "
                                                "(clamping q, k and v) is not implemented")
    num = int(d.get("num_experts", d.get("num_local_experts", 0)))
    if num <= 0:
        raise InvalidParameterError("num_experts", f"num_experts {num}: a {family_name} model needs experts")
    width = int(d.get("moe_intermediate_size") or d["intermediate_size"])
    e = ExpertsSpec(num, int(d.get("num_experts_per_tok", 1)), width,
                    norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                    shared_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0))
    step = int(d.get("decoder_sparse_step", 1))
    dense = set(d.get("mlp_only_layers") or ())
    if step <= 0:
        raise InvalidParameterError("decoder_sparse_step", f"decoder_sparse_step must be positive: {step}")
    # transformers' rule (Qwen2MoeDecoderLayer): sparse unless listed in mlp_only_layers, every step-th layer
    return MoeConfig(e, tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)))


def moe_to_hf(family_name: str, moe: Optional[MoeConfig], num_layers: int) -> dict:
    """The config.json fields that give `moe` back under its family (inverse of moe_from_hf)."""
    if moe is None:
        return {}
    e = moe.experts
    if family_name == "mixtral":
        return {"num_local_experts": e.num_experts, "num_experts_per_tok": e.top_k}
    out = {"num_experts": e.num_experts, "num_experts_per_tok": e.top_k, "norm_topk_prob": e.norm_topk_prob}
    if family_name == "olmoe":
        return out
    out.update(moe_intermediate_size=e.intermediate_size, decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(num_layers) if not moe.sparse_layers[i]])
    if family_name == "qwen2_moe":
        out["shared_expert_intermediate_size"] = e.shared_intermediate_size
    return out


def expert_parameters(e: ExpertsSpec, hidden: int) -> tuple:
    """(all, active per token) parameters of one sparse layer's MLP: router, routed and shared experts."""
    per_expert = 3 * hidden * e.intermediate_size
    shared = 3 * hidden * e.shared_intermediate_size + (hidden if e.shared_intermediate_size else 0)
    router = e.num_experts * hidden
    return router + e.num_experts * per_expert + shared, router + e.top_k * per_expert + shared
