"""Which config.json fields change a model's maths, and the refusal of those the model does not implement.

Every key of a config.json is one of:
- read by ModelConfig.from_hf_dict (READ, plus a family's own `hf_fields`, config/families.py);
- bookkeeping that does not change the forward pass (BOOKKEEPING: dtypes, token ids, training-only
  settings such as dropout, transformers' own serialisation fields);
- a field that changes the maths where it is set, accepted only at the values that mean "off"
  (NEUTRAL: mlp_bias false, attn_logit_softcapping null, ...).
Any other key, or a NEUTRAL key at another value, is a load error naming the field: a field we do not
know may change the maths, and a refusal is better than a silently different model.
"""

from __future__ import annotations

from servescope.errors import InvalidParameterError

# read by ModelConfig.from_hf_dict for every family (each one implemented, or refused there by value)
READ = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "tie_word_embeddings",
    "attention_bias", "qk_norm", "hidden_act", "bos_token_id", "eos_token_id",
})

BOOKKEEPING = frozenset({
    "_name_or_path", "_source", "dtype", "torch_dtype", "transformers_version", "use_cache", "initializer_range",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "attention_dropout", "embd_pdrop", "resid_pdrop",
    "hidden_dropout", "mlp_dropout", "id2label", "label2id", "output_attentions", "output_hidden_states",
    "return_dict", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward", "auto_map",
    "pretraining_tp",  # Llama: a training-time split of the projections, the same maths
    "tokenizer_class", "task_specific_params", "finetuning_task", "prefix", "generation_config",
})

# field -> the values at which it changes nothing (every family unless the family reads it itself)
NEUTRAL = {
    "mlp_bias": (False, None),
    "use_mrope": (False, None),
    "use_bidirectional_attention": (False, None),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "sliding_window": (None,),
    "use_sliding_window": (False, None),
    "max_window_layers": None,  # any value: it only selects layers once use_sliding_window is true
    "layer_types": None,  # checked against the family's pattern where the family reads it
    "original_max_position_embeddings": None,  # read by the rope scaling where one is set
}


def check_fields(d: dict, family_fields: frozenset, family_name: str) -> None:
    """Raise InvalidParameterError naming the first config.json field that would change the maths and that
    this family does not implement (an unknown key included)."""
    for key, value in d.items():
        if key in READ or key in BOOKKEEPING or key in family_fields:
            continue
        if key == "quantization_config":
            method = value.get("quant_method") if isinstance(value, dict) else None
            if method == "servescope":  # our own packed checkpoint (loader/quantized.py)
                continue
            if method == "mxfp4" and family_name == "gpt_oss":  # gpt-oss's released experts (loader/hf_mxfp4.py)
                continue
            raise InvalidParameterError(key, f"config.json field {key!r}: quant_method {method!r} is not "
                                             "supported for " + family_name + " (servescope's own quantised "
                                             "checkpoints, and gpt-oss's mxfp4 experts)")
        if key in NEUTRAL:
            allowed = NEUTRAL[key]
            if allowed is None or value in allowed:
                continue
            raise InvalidParameterError(key, f"config.json field {key!r} = {value!r} changes the model's maths "
                                             f"and is not implemented for {family_name} (accepted: "
                                             f"{', '.join(repr(a) for a in allowed)})")
        raise InvalidParameterError(key, f"config.json field {key!r} is not known to servescope for "
                                         f"{family_name}: it may change the model's maths, so the checkpoint "
                                         "is refused rather than run as a different model")


def window_layers(pattern: str, d: dict, num_layers: int) -> tuple:
    """(sliding_window or None, per-layer kinds "full" / "sliding") of a config.json dict, as transformers
    builds the family: `pattern` is the family's window_pattern (config/families.py). A window at least as
    long as max_position_embeddings masks nothing and is read as full attention. An explicit
    `layer_types` (transformers 5 writes it) is the pattern where the family reads it."""
    window = d.get("sliding_window")
    if pattern == "max_window_layers" and not d.get("use_sliding_window", False):
        window = None
    if window is not None and int(window) >= int(d.get("max_position_embeddings", 4096)):
        window = None
    if pattern == "none" or window is None:
        kinds = ("full",) * num_layers
    elif pattern == "all":
        kinds = ("sliding",) * num_layers
    elif pattern == "max_window_layers":
        first = int(d.get("max_window_layers", num_layers))
        kinds = tuple("sliding" if i >= first else "full" for i in range(num_layers))
    elif pattern == "alternate":
        kinds = tuple("sliding" if (i + 1) % 2 else "full" for i in range(num_layers))
    elif pattern == "every_nth":  # Gemma 3: n - 1 local layers, then one global (n = sliding_window_pattern)
        n = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        kinds = tuple("sliding" if (i + 1) % n else "full" for i in range(num_layers))
    else:
        raise ValueError(f"unknown window pattern {pattern!r}")
    given = d.get("layer_types")
    if given is not None:
        named = {"full_attention": "full", "sliding_attention": "sliding"}
        if len(given) != num_layers or any(t not in named for t in given):
            raise InvalidParameterError("layer_types", f"config.json field 'layer_types' = {given!r}: expected "
                                                       f"{num_layers} of {', '.join(named)}")
        kinds = tuple(named[t] for t in given)
        if window is None:  # transformers attends over the whole context without a window
            kinds = ("full",) * num_layers
    return (int(window) if "sliding" in kinds else None), kinds
