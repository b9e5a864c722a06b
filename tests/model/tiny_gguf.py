"""Write tiny GGUF files from an HF state dict, the way llama.cpp's converter does.

For arch "llama" the Q and K rows are permuted (llama.cpp's `permute`), so a loader that forgets
to reverse the permutation gets different weights. 2-D weights are stored in `qtype`; 1-D tensors
(norms, biases) stay F32 as llama.cpp keeps them.
"""

from __future__ import annotations

import numpy as np

HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# Gemma's four norms a layer (llama.cpp's Gemma2/Gemma3 tensor map): post_attention_layernorm is the attention
# output's norm there, ffn_norm the MLP input's
GEMMA_TO_GGUF_LAYER = {**HF_TO_GGUF_LAYER, "post_attention_layernorm": "post_attention_norm",
                       "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA_GGUF_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3"}


def hf_to_gguf_name(name: str, layer_names: dict = HF_TO_GGUF_LAYER) -> str:
    if name in HF_TO_GGUF_GLOBAL:
        return HF_TO_GGUF_GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.<module>.<param>
    module, param = rest.rsplit(".", 1)
    return f"blk.{layer}.{layer_names[module]}.{param}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_stored_values(name: str, w: np.ndarray, config, arch: str, qtype) -> np.ndarray:
    """What a loader should get back for HF tensor `name`: quantised then dequantised (unpermuted)."""
    import gguf

    if w.ndim == 2:
        w = gguf.quants.dequantize(gguf.quants.quantize(_permute(name, w, config, arch), qtype), qtype)
        w = _unpermute(name, w.reshape(-1, w.shape[-1]), config, arch)
    return np.asarray(w, dtype=np.float32)


def _permute(name, w, config, arch):
    if arch != "llama":
        return w
    if ".q_proj." in name:
        return llama_cpp_permute(w, config.num_attention_heads)
    if ".k_proj." in name:
        return llama_cpp_permute(w, config.num_key_value_heads)
    return w


def _unpermute(name, w, config, arch):
    if arch != "llama" or not (".q_proj." in name or ".k_proj." in name):
        return w
    n = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
    d_half = w.shape[0] // n // 2
    return w.reshape(n, d_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, config, state_dict: dict, arch: str = "llama", qtype=None, name: str = "tiny",
                    drop: tuple = (), replace: dict | None = None, chat_template: str | None = None,
                    token_count: int | None = None, extra_tensors: dict | None = None,
                    rope_scaling: tuple | None = None, raw_tensors: dict | None = None,
                    extra_metadata: dict | None = None, quantised_tensors: dict | None = None,
                    layer_names: dict = HF_TO_GGUF_LAYER, gguf_raw: dict | None = None) -> str:
    """Write `state_dict` (HF names) with `config` (a servescope ModelConfig) as a GGUF file.

    drop: HF names to leave out; replace: {HF name: array} written instead of the real tensor.
    extra_tensors: {GGUF name: array} added as is (e.g. rope_freqs.weight);
    rope_scaling: (type, factor) written as {arch}.rope.scaling.type / .factor metadata.
    raw_tensors: {HF name: (uint8 blocks [rows, bytes], GGML type)} written as they are, in the file's row
    order, instead of the tensor (the K-quants, which gguf-py cannot write from floats).
    extra_metadata: {key: int, float or list} metadata written as uint32 / float32 / an array (e.g.
    llama.attention.sliding_window).
    quantised_tensors: {GGUF name: float array} written in `qtype` like the 2-D weights (a MoE's stacked
    experts [E, rows, K]). layer_names: {HF module: GGUF name} of the layers' tensors. gguf_raw: {GGUF name:
    (bytes, GGML type)} written as they are (gpt-oss's MXFP4 experts).
    """
    import gguf

    qtype = qtype if qtype is not None else gguf.GGMLQuantizationType.F32
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    if f"{arch}.attention.value_length" not in (extra_metadata or {}):
        w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    if not token_count:  # with a token list the loader must take the vocabulary size from it
        w.add_vocab_size(config.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if rope_scaling:
        w.add_string(f"{arch}.rope.scaling.type", rope_scaling[0])
        w.add_float32(f"{arch}.rope.scaling.factor", rope_scaling[1])
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    if token_count:
        w.add_token_list([f"t{i}" for i in range(token_count)])
    if chat_template:
        w.add_chat_template(chat_template)
    for hf_name, t in state_dict.items():
        if hf_name in drop:
            continue
        gname = hf_to_gguf_name(hf_name, layer_names)
        if hf_name in (raw_tensors or {}):
            blocks, raw_type = raw_tensors[hf_name]
            w.add_tensor(gname, np.ascontiguousarray(blocks, dtype=np.uint8), raw_dtype=raw_type)
            continue
        a = np.asarray((replace or {}).get(hf_name, t.numpy() if hasattr(t, "numpy") else t), dtype=np.float32)
        a = _permute(hf_name, a, config, arch)
        if a.ndim == 2 and qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, a.astype(np.float16))
        elif a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    for gguf_name, a in (extra_tensors or {}).items():
        w.add_tensor(gguf_name, np.asarray(a, dtype=np.float32))
    for gguf_name, (blocks, raw_type) in (gguf_raw or {}).items():
        w.add_tensor(gguf_name, np.ascontiguousarray(blocks, dtype=np.uint8), raw_dtype=raw_type)
    for gguf_name, a in (quantised_tensors or {}).items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, a)
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# llama.cpp's general.architecture of each MoE family (Mixtral's GGUFs say "llama" with experts)
MOE_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def write_tiny_moe_gguf(path, source, qtype=None, **kw) -> str:
    """A MoE LoadedSource (HF per-expert names) as llama.cpp's converter writes it: each sparse layer's
    experts stacked per projection (blk.N.ffn_{gate,up,down}_exps [E, rows, K], in `qtype`), the router
    blk.N.ffn_gate_inp in float32 (llama-quantize leaves it so), Qwen2-MoE's shared expert and its 1-D gate,
    and the expert metadata. expert_types: {stacked tensor's GGUF name: GGML type} written in that type instead."""
    cfg, sd = source.config, source.state_dict
    arch, e = MOE_GGUF_ARCH[cfg.architecture], cfg.moe.experts
    block = "block_sparse_moe" if cfg.architecture == "mixtral" else "mlp"
    parts = (("gate", "w1"), ("up", "w3"), ("down", "w2")) if block == "block_sparse_moe" else \
        (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
    drop, stacked, floats = set(), {}, {}
    for i, sparse in enumerate(cfg.moe.sparse_layers[:cfg.num_hidden_layers]):
        if not sparse:
            continue
        p = f"model.layers.{i}.{block}."
        for part, hf in parts:
            keys = [f"{p}experts.{x}.{hf}.weight" for x in range(e.num_experts)]
            stacked[f"blk.{i}.ffn_{part}_exps.weight"] = np.stack([sd[k].numpy() for k in keys])
            drop.update(keys)
        floats[f"blk.{i}.ffn_gate_inp.weight"] = sd[p + "gate.weight"].numpy()
        drop.add(p + "gate.weight")
        if e.shared_intermediate_size:
            floats[f"blk.{i}.ffn_gate_inp_shexp.weight"] = sd[p + "shared_expert_gate.weight"].numpy()[0]
            drop.add(p + "shared_expert_gate.weight")
    meta = {f"{arch}.expert_count": e.num_experts, f"{arch}.expert_used_count": e.top_k,
            **({} if arch in ("llama", "olmoe")
               else {f"{arch}.expert_feed_forward_length": e.intermediate_size}),
            **({f"{arch}.expert_shared_feed_forward_length": e.shared_intermediate_size}
               if e.shared_intermediate_size else {})}
    dense = {k: v for k, v in sd.items() if k not in drop}
    meta.update(kw.pop("extra_metadata", {}))
    import gguf

    raw = {name: (gguf.quants.quantize(np.ascontiguousarray(stacked.pop(name), dtype=np.float32), t), t)
           for name, t in kw.pop("expert_types", {}).items()}
    return write_tiny_gguf(path, cfg, dense, arch=arch, qtype=qtype, extra_tensors=floats,
                           quantised_tensors=stacked, extra_metadata=meta, gguf_raw=raw, **kw)


def write_tiny_gemma_gguf(path, source, qtype=None, **kw) -> str:
    """A Gemma 2 / Gemma 3 LoadedSource as llama.cpp's converter writes it (Gemma2Model / Gemma3Model): the
    sandwich norms under their GGUF names, every norm weight with Gemma's 1 added (the converter's
    `data_torch + 1`), no output.weight when tied, and the metadata those converters write: key and value length,
    the sliding window, Gemma 2's two soft-caps, Gemma 3's global and local rotary bases, final soft-cap and the
    global layers' rope scaling.
    The layer pattern is llama.cpp's default (Gemma 2: 2, Gemma 3: 6) unless extra_metadata says
    `{arch}.attention.sliding_window_pattern`."""
    cfg, sd = source.config, source.state_dict
    arch = GEMMA_GGUF_ARCH[cfg.architecture]
    one = np.float32(1.0)
    replace = {k: v.numpy() + one for k, v in sd.items() if k.endswith("norm.weight")}
    replace.update(kw.pop("replace", {}))
    meta = {}
    if cfg.sliding_window:
        meta[f"{arch}.attention.sliding_window"] = int(cfg.sliding_window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key) is not None:
            meta[f"{arch}.{key}"] = float(getattr(cfg, key))
    if cfg.rope_local_theta is not None:
        meta[f"{arch}.rope.freq_base_swa"] = float(cfg.rope_local_theta)
    meta.update(kw.pop("extra_metadata", {}))
    if cfg.rope_scaling is not None:  # the global layers' (Gemma 3 4B and up: linear)
        kw.setdefault("rope_scaling", (cfg.rope_scaling.rope_type, float(cfg.rope_scaling.factor)))
    drop = tuple(kw.pop("drop", ())) + (("lm_head.weight",) if cfg.tie_word_embeddings else ())
    return write_tiny_gguf(path, cfg, sd, arch=arch, qtype=qtype, replace=replace, extra_metadata=meta, drop=drop,
                           layer_names=GEMMA_TO_GGUF_LAYER, **kw)


# DeepSeek's latent attention and experts under llama.cpp's deepseek2 names (its converter's DeepseekV2Model)
DEEPSEEK_TO_GGUF_LAYER = {
    **HF_TO_GGUF_LAYER, "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def deepseek_gguf_metadata(cfg, split_kv_b: bool = True) -> dict:
    """The deepseek2.* keys llama.cpp's converter writes for `cfg` (a DeepSeek ModelConfig) beyond write_tiny_gguf's:
    one KV head, the absorbed form's key / value lengths beside the per-head ones (none of those in an older file,
    whose key_length / value_length are the per-head sizes), the experts, yarn's log multiplier."""
    m, e, a = cfg.mla, cfg.moe.experts if cfg.moe else None, "deepseek2"
    meta = {f"{a}.attention.head_count_kv": 1, f"{a}.attention.kv_lora_rank": m.kv_lora_rank,
            f"{a}.rope.dimension_count": m.qk_rope_head_dim,
            f"{a}.leading_dense_block_count": cfg.moe.sparse_layers.index(True) if cfg.moe else cfg.num_hidden_layers}
    if split_kv_b:
        meta.update({f"{a}.attention.key_length": m.latent_dim, f"{a}.attention.value_length": m.kv_lora_rank,
                     f"{a}.attention.key_length_mla": m.qk_head_dim, f"{a}.attention.value_length_mla": m.v_head_dim})
    else:
        meta.update({f"{a}.attention.key_length": m.qk_head_dim, f"{a}.attention.value_length": m.v_head_dim})
    if m.q_lora_rank:
        meta[f"{a}.attention.q_lora_rank"] = m.q_lora_rank
    if e:
        meta.update({f"{a}.expert_count": e.num_experts, f"{a}.expert_used_count": e.top_k,
                     f"{a}.expert_feed_forward_length": e.intermediate_size,
                     f"{a}.expert_shared_count": e.shared_intermediate_size // e.intermediate_size,
                     f"{a}.expert_group_count": e.n_group, f"{a}.expert_group_used_count": e.topk_group,
                     f"{a}.expert_gating_func": 2 if e.router == "deepseek_v3" else 1,
                     f"{a}.expert_weights_scale": float(e.routed_scaling_factor)})
        if e.norm_topk_prob:
            meta[f"{a}.expert_weights_norm"] = True
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "yarn":
        meta.update({f"{a}.rope.scaling.original_context_length": rs.original_max_position_embeddings,
                     f"{a}.rope.scaling.yarn_beta_fast": float(rs.beta_fast),
                     f"{a}.rope.scaling.yarn_beta_slow": float(rs.beta_slow)})
        if rs.mscale_all_dim:
            meta[f"{a}.rope.scaling.yarn_log_multiplier"] = float(0.1 * rs.mscale_all_dim)
    return meta


def write_tiny_deepseek_gguf(path, source, qtype=None, split_kv_b: bool = True, **kw) -> str:
    """A DeepSeek-V2/V3 LoadedSource as llama.cpp's converter writes it: kv_b_proj split per head into attn_k_b
    (W_UK transposed, [H, r, n]) and attn_v_b ([H, v, r]) (split_kv_b; else one attn_kv_b, as older converters
    wrote it), the experts stacked, the router in float32, V3's correction bias as blk.N.exp_probs_b.bias, and
    deepseek_gguf_metadata's keys. The split tensors are stored in `qtype` where their rows are whole blocks."""
    import gguf

    cfg, sd = source.config, source.state_dict
    m, heads = cfg.mla, cfg.num_attention_heads
    q = qtype if qtype is not None else gguf.GGMLQuantizationType.F32
    drop, stacked, floats = set(), {}, {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if split_kv_b:
            kv_b = sd[p + "self_attn.kv_b_proj.weight"].numpy().reshape(heads, -1, m.kv_lora_rank)
            for name, t in ((f"blk.{i}.attn_k_b.weight", kv_b[:, :m.qk_nope_head_dim].transpose(0, 2, 1)),
                            (f"blk.{i}.attn_v_b.weight", kv_b[:, m.qk_nope_head_dim:])):
                whole = q == gguf.GGMLQuantizationType.F32 or t.shape[-1] % 32 == 0
                (stacked if whole else floats)[name] = np.ascontiguousarray(t)
            drop.add(p + "self_attn.kv_b_proj.weight")
        if not (cfg.moe and cfg.moe.sparse_layers[i]):
            continue
        for part in ("gate", "up", "down"):
            keys = [f"{p}mlp.experts.{x}.{part}_proj.weight" for x in range(cfg.moe.experts.num_experts)]
            stacked[f"blk.{i}.ffn_{part}_exps.weight"] = np.stack([sd[k].numpy() for k in keys])
            drop.update(keys)
        floats[f"blk.{i}.ffn_gate_inp.weight"] = sd[p + "mlp.gate.weight"].numpy()
        drop.add(p + "mlp.gate.weight")
        if p + "mlp.gate.e_score_correction_bias" in sd:
            floats[f"blk.{i}.exp_probs_b.bias"] = sd[p + "mlp.gate.e_score_correction_bias"].numpy()
            drop.add(p + "mlp.gate.e_score_correction_bias")
    meta = {**deepseek_gguf_metadata(cfg, split_kv_b), **kw.pop("extra_metadata", {})}
    rs = cfg.rope_scaling
    if rs is not None:
        kw.setdefault("rope_scaling", (rs.rope_type, float(rs.factor)))
    drop.update(kw.pop("drop", ()))
    floats.update(kw.pop("extra_tensors", {}))
    return write_tiny_gguf(path, cfg, sd, arch="deepseek2", qtype=qtype, drop=tuple(drop), extra_tensors=floats,
                           quantised_tensors=stacked, extra_metadata=meta, layer_names=DEEPSEEK_TO_GGUF_LAYER, **kw)


# gpt-oss under llama.cpp's names (its converter's GptOssModel): the MLP's input norm is post_attention_norm
GPT_OSS_TO_GGUF_LAYER = {**HF_TO_GGUF_LAYER, "post_attention_layernorm": "post_attention_norm"}


def write_tiny_gpt_oss_gguf(path, source, qtype=None, expert_qtype=None, **kw) -> tuple:
    """A gpt-oss LoadedSource (a float HF directory's) as llama.cpp's converter writes it: the sinks as
    blk.N.attn_sinks.weight, the router (weight and bias, float32) as ffn_gate_inp, each layer's experts stacked
    per projection with gate and up apart (ffn_gate_exps / ffn_up_exps [E, I, Dm], ffn_down_exps [E, Dm, I], in
    `expert_qtype`: MXFP4 as the releases' files, or float32) and their biases, the window, yarn and expert
    metadata (and `swiglu_clamp_exp` where the limit is not llama.cpp's 7). Returns (path, the HF state dict of
    what the file holds: its quantised tensors dequantised)."""
    import gguf

    cfg, sd = source.config, source.state_dict
    q = qtype if qtype is not None else gguf.GGMLQuantizationType.F32
    eq = expert_qtype if expert_qtype is not None else gguf.GGMLQuantizationType.F32
    a, e = "gpt-oss", cfg.moe.experts
    floats, raw, drop = {}, {}, set()
    stored = {k: torch_tensor(gguf_stored_values(k, v.numpy(), cfg, a, q)) for k, v in sd.items()}
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        stored[p + "mlp.router.weight"] = sd[p + "mlp.router.weight"]  # (kept in float32, as llama-quantize does)
        ex = p + "mlp.experts."
        gate_up, bias = sd[ex + "gate_up_proj"].transpose(1, 2).numpy(), sd[ex + "gate_up_proj_bias"].numpy()
        parts = {"gate": gate_up[:, 0::2], "up": gate_up[:, 1::2], "down": sd[ex + "down_proj"].transpose(1, 2).numpy()}
        back = {}
        for part, w in parts.items():
            w = np.ascontiguousarray(w, dtype=np.float32)
            if eq == gguf.GGMLQuantizationType.F32:
                floats[f"{b}ffn_{part}_exps.weight"], back[part] = w, w
            else:
                raw[f"{b}ffn_{part}_exps.weight"] = (gguf.quants.quantize(w, eq), eq)
                back[part] = gguf.quants.dequantize(raw[f"{b}ffn_{part}_exps.weight"][0], eq).reshape(w.shape)
        stored[ex + "gate_up_proj"] = torch_tensor(np.stack([back["gate"], back["up"]], 2)
                                                   .reshape(e.num_experts, -1, cfg.hidden_size).transpose(0, 2, 1))
        stored[ex + "down_proj"] = torch_tensor(back["down"].transpose(0, 2, 1))
        floats.update({f"{b}ffn_gate_exps.bias": bias[:, 0::2], f"{b}ffn_up_exps.bias": bias[:, 1::2],
                       f"{b}ffn_down_exps.bias": sd[ex + "down_proj_bias"].numpy(),
                       f"{b}attn_sinks.weight": sd[p + "self_attn.sinks"].numpy(),
                       f"{b}ffn_gate_inp.weight": sd[p + "mlp.router.weight"].numpy(),
                       f"{b}ffn_gate_inp.bias": sd[p + "mlp.router.bias"].numpy()})
        drop.update(ex + n for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))
        drop.update((p + "self_attn.sinks", p + "mlp.router.weight", p + "mlp.router.bias"))
    meta = {f"{a}.expert_count": e.num_experts, f"{a}.expert_used_count": e.top_k,
            f"{a}.expert_feed_forward_length": e.intermediate_size, f"{a}.attention.sliding_window": cfg.sliding_window}
    if e.swiglu_limit != 7.0:
        meta[f"{a}.swiglu_clamp_exp"] = float(e.swiglu_limit)
    rs = cfg.rope_scaling
    if rs is not None:
        kw.setdefault("rope_scaling", (rs.rope_type, float(rs.factor)))
        meta.update({f"{a}.rope.scaling.original_context_length": rs.original_max_position_embeddings,
                     f"{a}.rope.scaling.yarn_beta_fast": float(rs.beta_fast),
                     f"{a}.rope.scaling.yarn_beta_slow": float(rs.beta_slow)})
    meta.update(kw.pop("extra_metadata", {}))
    floats = {k: v for k, v in floats.items() if k not in kw.get("drop_gguf", ())}
    raw = {k: v for k, v in raw.items() if k not in kw.pop("drop_gguf", ())}
    raw.update(kw.pop("gguf_raw", {}))
    floats.update(kw.pop("extra_tensors", {}))
    out = write_tiny_gguf(path, cfg, {k: v for k, v in sd.items() if k not in drop}, arch=a, qtype=q,
                          extra_tensors=floats, extra_metadata=meta, layer_names=GPT_OSS_TO_GGUF_LAYER,
                          gguf_raw=raw, **kw)
    return out, stored


def torch_tensor(a):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
