"""Mixture-of-experts as data: the experts of a model (MoeConfig, on ModelConfig.moe) and of one layer
(ExpertsSpec, on MlpSpec kind "moe"), read from and written back to each family's config.json fields.

A sparse layer routes every token to `top_k` of `num_experts` gated MLPs of width `intermediate_size`:
softmax over the router's logits, the top k kept (renormalised to sum to 1 where `norm_topk_prob`), the
experts' outputs summed with those weights. Qwen2-MoE adds a shared expert that every token runs, scaled
by sigmoid(shared_expert_gate(x)). Which layers are sparse is each family's rule (`sparse_layers`);
the others are the dense MLP of `ModelConfig.intermediate_size`. DeepSeek's routers: V2 softmax scores, top-k
greedy or within the best `topk_group` of `n_group` expert groups (a group scored by its best expert),
times routed_scaling_factor; V3 sigmoid scores plus a correction bias for the choice only, groups scored by
their two best, the chosen scores renormalised and scaled. Their shared experts (n_shared_experts of
moe_intermediate_size, one MLP) are ungated, and the first first_k_dense_replace layers dense. gpt-oss
(router "gpt_oss"): the router has a bias, the top k of its logits are kept and softmaxed over those k; its
experts have biases on gate|up and down and a clamped SwiGLU (gate clamped above at swiglu_limit, up to
[-limit, limit], out = (up + 1) * gate * sigmoid(swiglu_alpha * gate)); every layer is sparse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servescope.errors import InvalidParameterError

ROUTERS = ("softmax_topk", "deepseek_v2", "deepseek_v3", "gpt_oss")

# config.json fields of the MoE families that only training reads (auxiliary losses, jitter noise)
TRAINING_ONLY = frozenset({"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"})
# the fields read by moe_from_hf, per family style (config/families.py's hf_fields adds them)
MIXTRAL_FIELDS = frozenset({"num_local_experts", "num_experts_per_tok"}) | TRAINING_ONLY
# (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts: its attribute map)
QWEN_MOE_FIELDS = frozenset({
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias"}) | TRAINING_ONLY
DEEPSEEK_FIELDS = frozenset({
    "n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
    "routed_scaling_factor", "n_group", "topk_group", "topk_method", "norm_topk_prob", "first_k_dense_replace",
    "moe_layer_freq", "scoring_func", "aux_loss_alpha", "seq_aux", "ep_size",
    "num_nextn_predict_layers", "num_mtp_layers"}) | TRAINING_ONLY  # (the multi-token-prediction layers are unused)
OLMOE_FIELDS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
                          "clip_qkv"}) | TRAINING_ONLY
# (experts_per_token and initial_context_length: OpenAI's own names, in the released config.json files, which
# transformers does not read; accepted where they agree with the fields it does read)
GPT_OSS_FIELDS = frozenset({"num_local_experts", "num_experts", "num_experts_per_tok", "swiglu_alpha",
                            "swiglu_limit", "experts_per_token", "initial_context_length"}) | TRAINING_ONLY


@dataclass(frozen=True)
class ExpertsSpec:
    """The experts of one sparse layer."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's MLP width
    norm_topk_prob: bool = False  # renormalise the kept top-k probabilities to sum to 1
    shared_intermediate_size: int = 0  # a shared expert every token runs (0: none), gated by sigmoid(x . g)
    router: str = "softmax_topk"
    shared_gated: bool = True  # the shared expert scaled by sigmoid(x . g) (Qwen2-MoE); DeepSeek's is not
    # DeepSeek: experts in n_group groups, only the best topk_group groups' experts eligible; the routed
    # weights times routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # gpt-oss (router "gpt_oss"): the clamped SwiGLU's limit and sigmoid gain (its experts and router have biases)
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # the routed experts' own stored format where the checkpoint fixes it: "mxfp4" (gpt-oss as released:
    # quant/mxfp4.py, 4.25 bits per weight, whatever the rest of the model is in); "" follows the model's
    weight_format: str = ""

    @property
    def biased(self) -> bool:
        """The router and the experts' gate|up and down have biases (gpt-oss)."""
        return self.router == "gpt_oss"

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise InvalidParameterError("router", f"router {self.router!r} is not implemented "
                                                  f"(implemented: {', '.join(ROUTERS)})")
        if not 0 < self.top_k <= self.num_experts or self.intermediate_size <= 0:
            raise InvalidParameterError("num_experts_per_tok",
                                        f"{self.top_k} experts per token of {self.num_experts} "
                                        f"(width {self.intermediate_size}): need 0 < k <= E")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise InvalidParameterError("n_group", f"{self.num_experts} experts in {self.n_group} groups, "
                                                   f"{self.topk_group} kept: need equal groups and 0 < kept <= groups")
        if self.shared_intermediate_size < 0:
            raise InvalidParameterError("shared_expert_intermediate_size", "must not be negative")
        if self.biased and not self.swiglu_limit > 0:
            raise InvalidParameterError("swiglu_limit", f"swiglu_limit {self.swiglu_limit}: gpt-oss's clamped "
                                                        "SwiGLU needs a positive limit")


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
    if family_name in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe(family_name, d, num_layers)
    if family_name == "gpt_oss":  # (transformers' GptOssConfig defaults)
        e = ExpertsSpec(int(d.get("num_local_experts", d.get("num_experts", 128))),
                        int(d.get("num_experts_per_tok", 4)), int(d["intermediate_size"]), router="gpt_oss",
                        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                        weight_format="mxfp4" if (d.get("quantization_config") or {}).get("quant_method") == "mxfp4"
                        else "")
        if d.get("experts_per_token", e.top_k) != e.top_k:
            raise InvalidParameterError("experts_per_token", f"experts_per_token {d['experts_per_token']} differs "
                                                             f"from num_experts_per_tok {e.top_k}")
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


def _deepseek_moe(family_name: str, d: dict, num_layers: int) -> Optional[MoeConfig]:
    """DeepSeek-V2/V3's experts as transformers builds them (layers from first_k_dense_replace on are sparse;
    moe_layer_freq is not read by transformers either); None when every layer is dense."""
    first = int(d.get("first_k_dense_replace") or 0)
    num = int(d.get("n_routed_experts") or d.get("num_local_experts") or 0)
    if first >= num_layers or not num:
        return None
    v3 = family_name == "deepseek_v3"
    method = d.get("topk_method", "noaux_tc" if v3 else "greedy")
    if method not in (("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")):
        raise InvalidParameterError("topk_method", f"topk_method {method!r} is not implemented for {family_name}")
    if d.get("scoring_func", "sigmoid" if v3 else "softmax") != ("sigmoid" if v3 else "softmax"):
        raise InvalidParameterError("scoring_func", f"scoring_func {d['scoring_func']!r} is not implemented "
                                                    f"for {family_name}")
    grouped = v3 or method == "group_limited_greedy"
    e = ExpertsSpec(num, int(d.get("num_experts_per_tok") or 1), int(d["moe_intermediate_size"]),
                    norm_topk_prob=v3 and bool(d.get("norm_topk_prob", True)),  # V2's router never renormalises
                    shared_intermediate_size=int(d["moe_intermediate_size"]) * int(d.get("n_shared_experts") or 0),
                    router=family_name, shared_gated=False,
                    n_group=int(d.get("n_group") or 1) if grouped else 1,
                    topk_group=int(d.get("topk_group") or 1) if grouped else 1,
                    routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)))
    return MoeConfig(e, tuple(i >= first for i in range(num_layers)))


def moe_to_hf(family_name: str, moe: Optional[MoeConfig], num_layers: int) -> dict:
    """The config.json fields that give `moe` back under its family (inverse of moe_from_hf)."""
    if moe is None:
        return {}
    e = moe.experts
    if family_name == "mixtral":
        return {"num_local_experts": e.num_experts, "num_experts_per_tok": e.top_k}
    if e.router == "gpt_oss":
        mxfp4 = {"quantization_config": {"quant_method": "mxfp4"}} if e.weight_format == "mxfp4" else {}
        return {"num_local_experts": e.num_experts, "num_experts_per_tok": e.top_k,
                "swiglu_limit": e.swiglu_limit, "swiglu_alpha": e.swiglu_alpha, **mxfp4}
    if e.router in ("deepseek_v2", "deepseek_v3"):
        return {"n_routed_experts": e.num_experts, "num_experts_per_tok": e.top_k,
                "moe_intermediate_size": e.intermediate_size,
                "n_shared_experts": e.shared_intermediate_size // e.intermediate_size,
                "first_k_dense_replace": moe.sparse_layers.index(True), "norm_topk_prob": e.norm_topk_prob,
                "n_group": e.n_group, "topk_group": e.topk_group, "routed_scaling_factor": e.routed_scaling_factor,
                **({} if e.router == "deepseek_v3" else
                   {"topk_method": "group_limited_greedy" if e.n_group > 1 else "greedy"})}
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
    per_expert = 3 * hidden * e.intermediate_size + (2 * e.intermediate_size + hidden if e.biased else 0)
    shared = 3 * hidden * e.shared_intermediate_size + (hidden if e.shared_intermediate_size and e.shared_gated else 0)
    router = e.num_experts * (hidden + 1 if e.biased else hidden)
    return router + e.num_experts * per_expert + shared, router + e.top_k * per_expert + shared


def expert_layout_problem(moe: Optional[MoeConfig], tp: int, ep: int) -> Optional[str]:
    """The first rule a layout of tp tensor-parallel and ep expert-parallel ranks breaks over a model's experts
    (None: it keeps them all). The engine (parallel/layout.py), `explain` and the simulator apply this one rule:
    EP over a mixture's experts only, running over the tensor-parallel ranks (X = T) or with the attention
    replicated (T = 1), X dividing the experts; without EP, T > 1 shards each expert (T dividing its width);
    T divides a shared expert's width either way."""
    if moe is None:
        return None if ep == 1 else f"expert_parallel_size {ep}: the model has no experts to split"
    e = moe.experts
    if ep > 1 and tp not in (1, ep):
        return (f"expert_parallel_size {ep} at tensor_parallel_size {tp}: needs EP = TP (attention sharded) or "
                f"TP = 1 (attention replicated)")
    if e.num_experts % ep:
        return f"expert_parallel_size {ep} does not divide the {e.num_experts} experts"
    if tp > 1 and ep == 1 and e.intermediate_size % tp:
        return (f"tensor_parallel_size {tp} does not divide the experts' width {e.intermediate_size} (or split "
                f"the experts over the ranks: expert parallelism)")
    if tp > 1 and e.shared_intermediate_size % tp:
        return f"tensor_parallel_size {tp} does not divide the shared expert's width {e.shared_intermediate_size}"
    return None
