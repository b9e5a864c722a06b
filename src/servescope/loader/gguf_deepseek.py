"""DeepSeek-V2/V3 from GGUF files (general.architecture `deepseek2`), as llama.cpp's converter writes them
(convert_hf_to_gguf.py's DeepseekV2Model) and as llama.cpp reads them (src/models/deepseek2.cpp).

Tensors (per layer, beyond Llama's attn_norm / ffn_norm / attn_output and the dense leading layers' ffn_*):
  attn_q                      the query in one projection (q_lora_rank 0: DeepSeek-V2-Lite), or
  attn_q_a, attn_q_a_norm, attn_q_b   its low-rank pair and norm
  attn_kv_a_mqa, attn_kv_a_norm       the latent [c | k_pe] and c's norm
  attn_kv_b                   kv_b_proj as one tensor (older converters), or the split pair that the converter
  attn_k_b, attn_v_b          writes now: per head, W_UK stored transposed [H, r, n] and W_UV [H, v, r]; they
                              are joined back into kv_b_proj's rows ([H, n + v, r], head by head)
  ffn_gate_inp, exp_probs_b.bias      the router and V3's correction bias; ffn_{gate,up,down}_exps the stacked
                              experts (loader/gguf_experts.py); ffn_*_shexp the shared experts (one MLP)
Q and K rows are not permuted: llama.cpp's rope for deepseek2 rotates adjacent pairs, DeepSeek's interleave.

Metadata, with llama.cpp's defaults where a key is absent:
- `attention.kv_lora_rank`; `attention.q_lora_rank` (none: the query is one projection); the per-head sizes
  `attention.key_length_mla` (n + R) and `.value_length_mla` (v) beside `key_length` = r + R and
  `value_length` = r (the absorbed form's); files without the _mla keys give n + R and v in `key_length` and
  `value_length` and hold attn_kv_b. `rope.dimension_count` is R.
- experts: `leading_dense_block_count` (0) dense layers first; `expert_gating_func` softmax (1, also when
  absent) is DeepSeek-V2's router, sigmoid (2) V3's (the family deepseek_v3), with `exp_probs_b` for the choice
  (none: a zero bias); `expert_group_count` / `expert_group_used_count` the groups; `expert_weights_norm`
  (false) renormalises the kept weights; `expert_weights_scale` (0 or 1: none) is routed_scaling_factor;
  `expert_shared_count` shared experts of `expert_feed_forward_length`. A group is scored as DeepSeek's own
  routers score it (V2 its best expert, V3 its best two), not as llama.cpp's graph, which sums the best two for
  both: the file's V2 model is the one that was trained.
- rope: `rope.scaling.type` none or yarn (`factor`, `original_context_length`, `yarn_beta_fast` / `_slow`), and
  `rope.scaling.yarn_log_multiplier`, which the converter writes as 0.1 * mscale_all_dim. llama.cpp then takes
  mscale = mscale_all_dim (its deepseek2 rule), so cos and sin are unscaled and the softmax scale is
  (n + R) ** -0.5 * mscale(factor, mscale_all_dim) ** 2; yarn without the multiplier scales cos and sin by
  mscale(factor) and the softmax by its square, as llama.cpp's graph does.
Any other `deepseek2.` key (multi-token-prediction layers, an attention temperature, a yarn attention factor,
...) is refused with a ModelLoadError naming it: maths llama.cpp might apply that the model would not.
"""

from __future__ import annotations

import torch

from servescope.config import RopeScaling
from servescope.config.mla import MlaSpec, yarn_mscale
from servescope.config.moe import ExpertsSpec, MoeConfig
from servescope.errors import ModelLoadError
from servescope.loader.gguf_file import f32_value
from servescope.loader.gguf_gemma import COMMON_KEYS

ARCH = "deepseek2"
_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values
# llama.cpp's per-layer names -> transformers' (under model.layers.N.); attn_k_b / attn_v_b are joined (join_kv_b)
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight", "attn_q_a": "self_attn.q_a_proj.weight",
    "attn_q_a_norm": "self_attn.q_a_layernorm.weight", "attn_q_b": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b": "self_attn.kv_b_proj.weight", "attn_k_b": "self_attn.k_b_proj.weight",
    "attn_v_b": "self_attn.v_b_proj.weight", "attn_output": "self_attn.o_proj.weight",
    "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight", "ffn_down": "mlp.down_proj.weight",
    "ffn_gate_inp": "mlp.gate.weight", "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj.weight", "ffn_up_shexp": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_experts.down_proj.weight",
}
_BIASES = frozenset({"exp_probs_b"})  # the one tensor llama.cpp names `.bias`
# {arch}.<key> read for deepseek2 (beyond loader/gguf_gemma.COMMON_KEYS, read by loader/gguf.py)
OWN_KEYS = frozenset({
    "attention.value_length", "attention.kv_lora_rank", "attention.q_lora_rank", "attention.key_length_mla",
    "attention.value_length_mla", "leading_dense_block_count", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_shared_count", "expert_weights_scale", "expert_weights_norm",
    "expert_gating_func", "expert_group_count", "expert_group_used_count", "rope.scaling.original_context_length",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_log_multiplier",
})


def hf_name(layer: str, part: str, kind: str) -> str | None:
    """The transformers key of llama.cpp's `blk.{layer}.{part}.{kind}` in a deepseek2 file, None for another."""
    name = LAYER_NAMES.get(part)
    if name is None or (kind == "bias") != (part in _BIASES):
        return None
    return f"model.layers.{layer}.{name}"


def yarn_scaling(meta) -> RopeScaling:
    """The yarn RopeScaling of a deepseek2 file (module doc: mscale = mscale_all_dim, llama.cpp's rule)."""
    all_dim = _mscale_all_dim(meta)
    context = meta.arch_key("context_length", 4096)
    return RopeScaling(rope_type="yarn", factor=f32_value(meta.arch_key("rope.scaling.factor", 1.0)),
                       original_max_position_embeddings=int(meta.arch_key("rope.scaling.original_context_length",
                                                                          context)),
                       beta_fast=f32_value(meta.arch_key("rope.scaling.yarn_beta_fast", 32.0)),
                       beta_slow=f32_value(meta.arch_key("rope.scaling.yarn_beta_slow", 1.0)),
                       mscale=all_dim, mscale_all_dim=all_dim)


def _mscale_all_dim(meta):
    log_mul = meta.arch_key("rope.scaling.yarn_log_multiplier")
    return None if log_mul is None else f32_value(log_mul) / 0.1  # (the converter's 0.1 * mscale_all_dim)


def config_fields(meta, fields: dict, tensor_names: set) -> dict:
    """The ModelConfig fields of a deepseek2 file's own maths; `fields`: what loader/gguf.py read already (sizes,
    context, rotary). meta: loader/gguf._Metadata. Raises ModelLoadError naming a key it does not read."""
    prefix, path = f"{ARCH}.", meta.path
    unread = sorted(k for k in meta.reader.fields if k.startswith(prefix)
                    and k[len(prefix):] not in COMMON_KEYS | OWN_KEYS)
    if unread:
        raise ModelLoadError(f"{path}: GGUF metadata {unread[0]} is not implemented for {ARCH} (its maths would "
                             "be ignored)")
    scaling = fields["rope_scaling"]
    if scaling is not None and scaling.rope_type != "yarn":
        raise ModelLoadError(f"{path}: {ARCH}.rope.scaling.type {scaling.rope_type!r} is not implemented for "
                             f"{ARCH} (llama.cpp scales its softmax too; supported: none, yarn)")
    mla = _mla(meta, fields, tensor_names)
    moe = _moe(meta, fields["num_hidden_layers"], tensor_names)
    return dict(architecture="deepseek_v3" if moe and moe.experts.router == "deepseek_v3" else "deepseek_v2",
                num_key_value_heads=fields["num_attention_heads"], head_dim=mla.qk_rope_head_dim, mla=mla, moe=moe)


def _mla(meta, fields: dict, tensor_names: set) -> MlaSpec:
    """The latent attention's sizes and softmax scale (module doc)."""
    path = meta.path
    rank = int(meta.arch_key("attention.kv_lora_rank", required=True))
    rope = int(meta.arch_key("rope.dimension_count", fields["head_dim"]))
    key, value = fields["head_dim"], int(meta.arch_key("attention.value_length", fields["head_dim"]))
    key_mla, value_mla = meta.arch_key("attention.key_length_mla"), meta.arch_key("attention.value_length_mla")
    if (key_mla is None) != (value_mla is None):
        raise ModelLoadError(f"{path}: {ARCH}.attention.key_length_mla and .value_length_mla come together")
    if key_mla is not None:  # the absorbed form's sizes in key_length / value_length
        if (key, value) != (rank + rope, rank):
            raise ModelLoadError(f"{path}: {ARCH}.attention.key_length {key} / value_length {value} must be "
                                 f"kv_lora_rank + rope dims {rank + rope} / kv_lora_rank {rank}")
        key, value = int(key_mla), int(value_mla)
    if key - rope < 1:
        raise ModelLoadError(f"{path}: {ARCH}: a key of {key} features leaves none beside {rope} rope dims")
    q_lora = int(meta.arch_key("attention.q_lora_rank") or 0)
    if (q_lora > 0) != ("blk.0.attn_q_a.weight" in tensor_names):
        raise ModelLoadError(f"{path}: {ARCH}.attention.q_lora_rank is {q_lora} but the file "
                             f"{'lacks' if q_lora else 'has'} blk.0.attn_q_a.weight")
    scale = key ** -0.5
    scaling = fields["rope_scaling"]
    if scaling is not None:  # llama.cpp's kq_scale: mscale(factor, mscale_all_dim or 1) squared
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim or 1.0) ** 2
    return MlaSpec(kv_lora_rank=rank, qk_nope_head_dim=key - rope, qk_rope_head_dim=rope, v_head_dim=value,
                   q_lora_rank=q_lora, rope_interleave=True, softmax_scale=scale)


def _moe(meta, layers: int, tensor_names: set) -> MoeConfig | None:
    """DeepSeek's experts (module doc); None when every layer is dense."""
    path = meta.path
    dense = int(meta.arch_key("leading_dense_block_count", 0))
    sparse = tuple(i >= dense for i in range(layers))
    routers = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(layers))
    if routers != sparse:
        raise ModelLoadError(f"{path}: {ARCH}.leading_dense_block_count is {dense} but the layers with a router "
                             f"(blk.N.ffn_gate_inp) are {[i for i, r in enumerate(routers) if r]}")
    if not any(sparse):
        return None
    gating = int(meta.arch_key("expert_gating_func", _SOFTMAX))
    if gating not in (_SOFTMAX, _SIGMOID):
        raise ModelLoadError(f"{path}: {ARCH}.expert_gating_func {gating} is not implemented (softmax 1, "
                             "sigmoid 2)")
    biased = any(f"blk.{i}.exp_probs_b.bias" in tensor_names for i in range(layers))
    if biased and gating == _SOFTMAX:
        raise ModelLoadError(f"{path}: blk.N.exp_probs_b (a correction bias) with softmax gating is not "
                             "implemented")
    groups = int(meta.arch_key("expert_group_count") or 1)
    used_groups = int(meta.arch_key("expert_group_used_count", required=True)) if groups > 1 else 1
    scale = f32_value(meta.arch_key("expert_weights_scale", 0.0))
    width = int(meta.arch_key("expert_feed_forward_length", required=True))
    experts = ExpertsSpec(int(meta.arch_key("expert_count", required=True)),
                          int(meta.arch_key("expert_used_count", required=True)), width,
                          norm_topk_prob=bool(meta.arch_key("expert_weights_norm", False)),
                          shared_intermediate_size=width * int(meta.arch_key("expert_shared_count", required=True)),
                          router="deepseek_v3" if gating == _SIGMOID else "deepseek_v2", shared_gated=False,
                          n_group=groups, topk_group=used_groups, routed_scaling_factor=scale if scale else 1.0)
    return MoeConfig(experts, sparse)


def settle(state_dict: dict, config, path: str) -> None:
    """kv_b_proj from the split attn_k_b / attn_v_b (module doc), and a zero correction bias for a sigmoid
    router that the file gives none (llama.cpp then adds nothing)."""
    m, heads = config.mla, config.num_attention_heads
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        k_b, v_b = state_dict.pop(p + "k_b_proj.weight", None), state_dict.pop(p + "v_b_proj.weight", None)
        if k_b is None and v_b is None:
            continue
        if k_b is None or v_b is None or p + "kv_b_proj.weight" in state_dict:
            raise ModelLoadError(f"{path}: layer {i} needs attn_kv_b, or attn_k_b with attn_v_b")
        want_k, want_v = (heads, m.kv_lora_rank, m.qk_nope_head_dim), (heads, m.v_head_dim, m.kv_lora_rank)
        if tuple(k_b.shape) != want_k or tuple(v_b.shape) != want_v:
            raise ModelLoadError(f"{path}: blk.{i}.attn_k_b / attn_v_b have shapes {list(k_b.shape)} / "
                                 f"{list(v_b.shape)}, expected {list(want_k)} / {list(want_v)}")
        kv_b = torch.cat((k_b.transpose(1, 2), v_b), dim=1)  # [H, n + v, r]: W_UK's rows, then W_UV's, per head
        state_dict[p + "kv_b_proj.weight"] = kv_b.reshape(-1, m.kv_lora_rank).contiguous()
    if config.moe and config.moe.experts.router == "deepseek_v3":
        for i, sparse in enumerate(config.moe.sparse_layers[:config.num_hidden_layers]):
            key = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            if sparse and key not in state_dict:
                state_dict[key] = torch.zeros(config.moe.experts.num_experts)
