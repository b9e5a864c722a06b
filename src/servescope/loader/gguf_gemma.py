"""Gemma 2 and Gemma 3 (text) from GGUF files, as llama.cpp's converter writes them (convert_hf_to_gguf.py's
Gemma2Model / Gemma3Model) and as llama.cpp itself reads them (src/models/gemma2.cpp, gemma3.cpp).

Tensors: the four norms of a layer are blk.N.attn_norm (transformers' input_layernorm), post_attention_norm
(the attention output's: post_attention_layernorm), ffn_norm (the MLP input's: pre_feedforward_layernorm) and
post_ffw_norm (post_feedforward_layernorm), plus Gemma 3's attn_q_norm / attn_k_norm; Gemma 2's files have no
output.weight (the head is the embedding). The converter stores every `*norm.weight` with Gemma's 1 already
added ((1 + w) becomes a plain RMSNorm weight): loader/gguf.py subtracts Family.norm_offset from them, so the
state dict is in transformers' convention (as transformers' own GGUF loader does) and the build adds it back
once, as for an HF directory. Q and K rows are not permuted (llama.cpp runs Gemma with NEOX rope).

Metadata, with llama.cpp's defaults where a key is absent:
- `attention.sliding_window` (Gemma 2: 4096 when absent; Gemma 3: no window when absent or 0) over the layers
  of `attention.sliding_window_pattern`: a per-layer array of flags, or n (Gemma 2: 2, Gemma 3: 6 when absent):
  layer i is windowed when i % n < n - 1 (n = 0: every layer). A window as long as the context is none.
- soft-caps: Gemma 2 `attn_logit_softcapping` (50 when absent) and `final_logit_softcapping` (30); Gemma 3
  applies no attention soft-cap (its key is refused) and a final one only where the key is set and non-zero.
- rotary bases: `rope.freq_base` for the global layers (and its linear `rope.scaling.*`); Gemma 3's windowed
  layers take `rope.freq_base_swa`, else 10000, plain; Gemma 2's take the model's (with its scaling) unless
  `rope.freq_base_swa` says another base.
- the attention scale: no key holds query_pre_attn_scalar; llama.cpp takes head_dim, and hidden / heads for the
  27B models, which it recognises by their layer count (46: Gemma 2, 62: Gemma 3), as gemma_pytorch's configs.
- GELU-tanh, scaled embeddings, sandwich norms (and Gemma 3's q/k norms): the family's row.
Any other `{arch}.` key (an attention scale, a yarn parameter, a per-layer head count, ...) is refused with a
ModelLoadError naming it: maths llama.cpp might apply that the model would not.
"""

from __future__ import annotations

from servescope.errors import ModelLoadError
from servescope.loader.gguf_file import f32_value

# GGUF general.architecture -> family (config/families.py rows gemma2 / gemma3_text name the same)
FAMILIES = {"gemma2": "gemma2", "gemma3": "gemma3_text"}
# layer tensors whose name differs from the llama mapping (loader/gguf._LAYER_NAMES: there ffn_norm is the
# MLP's only norm, post_attention_layernorm)
SANDWICH_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# {arch}.<key> read by loader/gguf.py for every family
COMMON_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
})
# {arch}.<key> read here, per architecture
OWN_KEYS = {
    "gemma2": frozenset({"attention.value_length", "attention.sliding_window", "attention.sliding_window_pattern",
                         "rope.freq_base_swa", "attn_logit_softcapping", "final_logit_softcapping"}),
    "gemma3": frozenset({"attention.value_length", "attention.sliding_window", "attention.sliding_window_pattern",
                         "rope.freq_base_swa", "final_logit_softcapping"}),
}
# llama.cpp's defaults when a key is absent (llama-hparams.h, src/models/gemma2.cpp, gemma3.cpp)
_DEFAULT_WINDOW = {"gemma2": 4096, "gemma3": None}
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
_DEFAULT_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}
_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa when the file says none
# the layer counts of the 27B models, whose attention scale llama.cpp takes from hidden / heads
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def config_fields(meta, fields: dict) -> dict:
    """The ModelConfig fields of a Gemma GGUF's own maths; `fields`: what loader/gguf.py read already (sizes,
    context, rotary). meta: loader/gguf._Metadata. Raises ModelLoadError naming an unread key."""
    arch, path = meta.raw_arch, meta.path
    prefix = f"{arch}."
    unread = sorted(k for k in meta.reader.fields if k.startswith(prefix)
                    and k[len(prefix):] not in COMMON_KEYS | OWN_KEYS[arch])
    if unread:
        raise ModelLoadError(f"{path}: GGUF metadata {unread[0]} is not implemented for {arch} (its maths would "
                             "be ignored)")
    head_dim, layers = fields["head_dim"], fields["num_hidden_layers"]
    value_length = meta.arch_key("attention.value_length")
    if value_length is not None and int(value_length) != head_dim:
        raise ModelLoadError(f"{path}: {arch}.attention.value_length {value_length} != key_length {head_dim} "
                             "is not implemented")
    window, kinds = windows(meta, layers, fields["max_position_embeddings"])
    attn_cap, final_cap = _softcaps(meta)
    local = _local_rope_base(meta, fields, window is not None)
    large = layers == _LAYERS_27B[arch]
    scalar = fields["hidden_size"] // fields["num_attention_heads"] if large else head_dim
    return dict(hidden_act="gelu_pytorch_tanh", sliding_window=window,
                layer_types=kinds if len(set(kinds)) > 1 else (), attn_logit_softcapping=attn_cap,
                final_logit_softcapping=final_cap, rope_local_theta=local, query_pre_attn_scalar=float(scalar))


def windows(meta, layers: int, context: int) -> tuple:
    """(sliding_window or None, per-layer kinds) as llama.cpp's load_swa_pattern / set_swa_pattern."""
    arch, path = meta.raw_arch, meta.path
    window = meta.arch_key("attention.sliding_window", _DEFAULT_WINDOW.get(arch))
    if window is None or int(window) <= 0 or int(window) >= context:
        return None, ("full",) * layers
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _DEFAULT_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer
        if len(pattern) < layers or not all(isinstance(f, bool) for f in pattern):
            raise ModelLoadError(f"{path}: {arch}.attention.sliding_window_pattern must be one flag per layer "
                                 f"({layers}), got {pattern[:8]}")
        flags = pattern[:layers]
    else:
        n = int(pattern)
        if n < 0:
            raise ModelLoadError(f"{path}: {arch}.attention.sliding_window_pattern must not be negative, got {n}")
        flags = [n == 0 or i % n < n - 1 for i in range(layers)]
    kinds = tuple("sliding" if f else "full" for f in flags)
    return (int(window) if "sliding" in kinds else None), kinds


def _softcaps(meta) -> tuple:
    """(attention soft-cap, final soft-cap), None for none."""
    arch, path = meta.raw_arch, meta.path
    attn_default, final_default = _DEFAULT_SOFTCAPS[arch]
    caps = []
    for key, default in (("attn_logit_softcapping", attn_default), ("final_logit_softcapping", final_default)):
        v = meta.arch_key(key, default) if key in OWN_KEYS[arch] else None
        if v is not None and float(v) == 0.0 and arch == "gemma3":  # llama.cpp: a cap of 0 is no cap
            v = None
        if v is not None and not float(v) > 0.0:  # Gemma 2 divides by it
            raise ModelLoadError(f"{path}: {arch}.{key} must be positive, got {v}")
        caps.append(f32_value(v) if v is not None else None)
    return tuple(caps)


def _local_rope_base(meta, fields: dict, windowed: bool):
    """The windowed layers' own plain rotary base, None where they take the model's rotary."""
    arch, path = meta.raw_arch, meta.path
    base = meta.arch_key("rope.freq_base_swa")
    if not windowed:
        return None
    if arch == "gemma3":  # llama.cpp: rope_freq_base_train_swa, scale 1
        return f32_value(base) if base is not None else _LOCAL_ROPE_BASE
    if base is None or f32_value(base) == fields["rope_theta"]:
        return None  # Gemma 2: the local layers share the global base and scaling
    if fields["rope_scaling"] is not None:  # llama.cpp scales Gemma 2's local base like the global one
        raise ModelLoadError(f"{path}: {arch}.rope.freq_base_swa with rope scaling is not implemented")
    return f32_value(base)
