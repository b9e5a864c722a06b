"""The config.json fields of the attention and layer variants beyond Llama's: Gemma 2/3's soft-caps, query
scalar, GELU-tanh activation and local rotary base, gpt-oss's sinks. Read here into ModelConfig fields and
written back for to_hf_dict, so that config/model.py keeps one line for each direction.

Each family names the fields it reads in its `hf_fields` (config/families.py); a field read here for one
family stays a load error for the others (config/hf_fields.NEUTRAL), never a silently different model.
"""

from __future__ import annotations

from servescope.errors import InvalidParameterError

# fields a Gemma config.json carries besides Llama's (hf_fields of the Gemma rows)
GEMMA_FIELDS = frozenset({
    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation",
    "sliding_window", "layer_types", "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern",
    "cache_implementation",  # transformers' choice of cache class ("hybrid"): no maths
})


def variant_fields(d: dict) -> dict:
    """The ModelConfig fields of a config.json dict's attention variants (only those the dict sets)."""
    out = {}
    act = d.get("hidden_activation") or d.get("hidden_act")
    if act is not None:
        out["hidden_act"] = str(act)
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            out[key] = float(d[key])
    if d.get("initial_context_length") is not None:  # gpt-oss (OpenAI's name; transformers reads the rope's)
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if int(d["initial_context_length"]) != int(rope.get("original_max_position_embeddings", 4096)):
            raise InvalidParameterError("initial_context_length", "initial_context_length "
                                        f"{d['initial_context_length']} differs from the rope's "
                                        "original_max_position_embeddings")
    local = _local_rope_theta(d)
    if local is not None:
        out["rope_local_theta"] = local
    return out


def global_rope_dict(d: dict) -> dict:
    """d with transformers 5's per-layer-type `rope_parameters` ({"full_attention": ..., "sliding_attention":
    ...}, Gemma 3) replaced by the full layers' entry, which the model's rope_theta / rope_scaling read."""
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:
        return {**d, "rope_parameters": rp["full_attention"]}
    return d


def _local_rope_theta(d: dict):
    """The sliding layers' own rotary base (plain rope), or None where they share the model's."""
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and "sliding_attention" in rp:
        local = rp["sliding_attention"] or {}
        if local.get("rope_type", "default") != "default":
            raise InvalidParameterError("rope_parameters", "rope_parameters.sliding_attention of type "
                                                           f"{local.get('rope_type')!r} is not implemented "
                                                           "(the local layers take plain rope)")
        return float(local.get("rope_theta", 10000.0))
    if d.get("rope_local_base_freq") is not None:
        return float(d["rope_local_base_freq"])
    return None


def variant_to_hf(cfg) -> dict:
    """The config.json fields that give a ModelConfig's attention variants back (empty for Llama's maths)."""
    out = {}
    if cfg.hidden_act != "silu":
        out["hidden_activation"] = cfg.hidden_act
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key) is not None:
            out[key] = getattr(cfg, key)
    if cfg.rope_local_theta is not None:
        out["rope_local_base_freq"] = cfg.rope_local_theta
    return out
