"""FLOP and byte counts of a model's ops: dtypes, weight and KV sizes, matmul and attention FLOPs,
and the per-op-group (FLOPs, activation bytes, weight bytes) of one engine step, no timing.

A step is a list of sequences, each `(num_new_tokens, num_context_tokens_before)`: a prefill chunk
has many new tokens, a decode token has one. Legend: T = total new tokens, B = sequences,
L layers, d hidden, q = H*D query width, kv = Hkv*D key (and value) width, i intermediate, V vocab.
cost_model.py turns these counts into time on a HardwareSpec.

Counting rules (the invariants the tests check):
- Linear layers ("qkv_proj", "attn_out_proj", "mlp", "lm_head") count 2*M*N*K FLOPs per matmul,
  exactly what torch.utils.flop_counter.FlopCounterMode counts for aten.mm/addmm; bias adds are
  not matmul FLOPs (they go to "norms_rope_misc"). `matmul_flops` returns these alone.
- "attention" counts QK^T and PV exactly causally: a new token at position p attends to p + 1
  keys, so a sequence with n new tokens after c cached ones attends n*c + n(n+1)/2 keys, and each
  key costs 4*H*D FLOPs (2 for the score, 2 for the weighted value). FlopCounterMode counts
  differently: SDPA on CUDA and eager attention as a full (non-causal) T x (c+T) product, and the
  CPU flash kernel not at all; `attention_flops_noncausal` gives the full-product figure.
- Weights are read once per step whatever the batch (the whole point of batching decode); the
  embedding table is the exception: only the T rows looked up are read.
- "kv_read" reads each sequence's cached context (c tokens, all layers; a sliding layer min(c, window),
  and attention counts each layer's keys over its own window); the new tokens' K/V come
  from activations and are counted once in "kv_write".
- "lm_head" runs only for tokens whose logits are needed: one per sequence in the engine.
- int8 means weight-only quantisation: linear weights in decoder layers are 1 byte per parameter
  plus one scale per output channel (activation dtype); embeddings, norms and lm_head stay in the
  activation dtype; matmuls run in the activation dtype.
- Packed formats (analysis/packed_weights.py: int4, int8-g32, ..., a GGUF's q4_0 / q4_1 / q8_0) count
  their stored bytes, scales included; the head is packed too (8 bits beside 4-bit weights), the
  embedding table is the packed head for a GGUF and the activation dtype otherwise.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

from servescope.analysis.hardware import DTYPE_BYTES, DTYPES
from servescope.analysis.moe import expected_distinct_experts
from servescope.analysis import mla as mla_costs
from servescope.analysis.packed_weights import MXFP4_BITS_PER_WEIGHT, packed_format
from servescope.config import ModelConfig
from servescope.config.layers import window_of
from servescope.errors import InvalidParameterError

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# KV cache dtypes: the float ones, or int8 / fp8 e4m3 values with one float32 scale per row of head_dim
# (per token and KV head; model/attention/kv_quant.py): bytes per element and per row's scale
KV_DTYPES = FLOAT_DTYPES + ("int8", "fp8_e4m3")
KV_SCALE_BYTES = 4
_KV_ELEMENT_BYTES = {"int8": 1, "fp8_e4m3": 1}
LINEAR_OPS = ("qkv_proj", "attn_out_proj", "mlp", "lm_head")
# weights of one byte with a scale per output channel: int8 (weight-only: multiplied in the activation dtype) and
# fp8 (e4m3, multiplied on FP8 tensor cores with the activations rounded to FP8 per token: cost_model.py)
BYTE_WEIGHTS = ("int8", "fp8")
WEIGHT_DTYPES = DTYPES + ("fp8",)  # and the packed formats (analysis/packed_weights.py)
OP_NAMES = ("embedding", "qkv_proj", "attention", "kv_write", "kv_read", "attn_out_proj", "mlp",
            "norms_rope_misc", "lm_head")

# Rough per-element FLOP costs of the small elementwise ops (they never dominate).
_RMSNORM_FLOPS = 4  # square, sum, scale by rsqrt, multiply by weight
_ROPE_FLOPS = 3  # two multiplies and an add per element
_SILU_MUL_FLOPS = 5  # x * sigmoid(x) * up
_SOFTMAX_FLOPS = 5  # max, subtract, exp, sum, divide per score


# --------------------------------------------------------------------------- dtypes and sizes

def resolve_dtypes(weight_dtype: str, act_dtype: Optional[str] = None,
                   kv_dtype: Optional[str] = None) -> tuple[str, str, str]:
    """(weight, activation, kv) dtypes. Activations default to the weight dtype (bfloat16 for int8 and fp8);
    the KV cache defaults to the activation dtype."""
    packed = packed_format(weight_dtype) is not None
    if weight_dtype not in WEIGHT_DTYPES and not packed:
        raise InvalidParameterError("weight_dtype", f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)} or a "
                                    f"packed format (int4, int8-g32, q4_0, q4_1, q8_0, ...), got {weight_dtype!r}")
    act = act_dtype or ("bfloat16" if weight_dtype in BYTE_WEIGHTS else "float32" if packed else weight_dtype)
    kv = kv_dtype or act
    if act not in FLOAT_DTYPES:
        raise InvalidParameterError("act_dtype",
                                    f"activation dtype must be one of {', '.join(FLOAT_DTYPES)}, got {act!r}")
    kv = "fp8_e4m3" if kv == "fp8" else kv
    if kv not in KV_DTYPES:
        raise InvalidParameterError("kv_dtype", f"KV cache dtype must be one of {', '.join(KV_DTYPES)}, got {kv!r}")
    return weight_dtype, act, kv


def kv_cache_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bfloat16") -> int:
    """K and V for one token in every layer: 2 * L * Hkv * D * bytes (Llama-3-8B bf16: 131072), and for
    int8 / fp8_e4m3 a 4-byte scale per row of D (Llama-3-8B int8: 2 * 32 * 8 * (128 + 4) = 67584)."""
    if kv_dtype not in KV_DTYPES:
        raise InvalidParameterError("kv_dtype",
                                    f"KV cache dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    heads, k_dim, v_dim = cfg.kv_cache_geometry  # latent attention: one row of r + R, no V (config/mla.py)
    if kv_dtype in _KV_ELEMENT_BYTES:
        rows = sum(w * _KV_ELEMENT_BYTES[kv_dtype] + KV_SCALE_BYTES for w in (k_dim, v_dim) if w)
    else:
        rows = (k_dim + v_dim) * DTYPE_BYTES[kv_dtype]
    return cfg.num_hidden_layers * heads * rows


def _linear_weight_bytes(out_features: int, in_features: int, wdt: str, adt: str, bias: bool = False) -> int:
    """One nn.Linear's weight bytes; int8 and fp8 add one scale per output channel in the activation dtype;
    a packed format counts its blocks and scales."""
    fmt = packed_format(wdt)
    if fmt is not None:
        return out_features * fmt.row_bytes(in_features) + (out_features * DTYPE_BYTES[adt] if bias else 0)
    n = out_features * in_features * DTYPE_BYTES[wdt]
    if wdt in BYTE_WEIGHTS:
        n += out_features * DTYPE_BYTES[adt]
    if bias:
        n += out_features * DTYPE_BYTES[adt if wdt in BYTE_WEIGHTS else wdt]
    return n


def dense_dtype(wdt: str, adt: str) -> str:
    """Embeddings, norms and lm_head stay unquantised: the activation dtype under int8 and fp8 (and the norms
    under a packed format: table_bytes says what its embedding and head take)."""
    return adt if wdt in BYTE_WEIGHTS or packed_format(wdt) is not None else wdt


def table_bytes(cfg: ModelConfig, wdt: str, adt: str) -> tuple[int, int, int]:
    """(bytes of one embedding row looked up, bytes of the output head, bytes of both tables in memory,
    a tied pair once). A packed format's head is packed (a separate copy of a tied float table, except a
    GGUF's, whose table is the packed head)."""
    d, V = cfg.hidden_size, cfg.vocab_size
    eb = DTYPE_BYTES[dense_dtype(wdt, adt)]
    fmt = packed_format(wdt)
    if fmt is None:
        return d * eb, V * d * eb, V * d * eb * (1 if cfg.tie_word_embeddings else 2)
    head = V * fmt.head().row_bytes(d)
    row = fmt.head().row_bytes(d) if fmt.gguf else d * eb
    return row, head, head + (0 if fmt.gguf and cfg.tie_word_embeddings else V * row)


def _layer_linear_bytes(cfg: ModelConfig, wdt: str, adt: str) -> dict[str, int]:
    d, i = cfg.hidden_size, cfg.intermediate_size
    if cfg.mla:  # latent attention's projections (analysis/mla.py); its kv_b_proj stays float
        lin = mla_costs.linear_bytes(cfg, lambda o, k: _linear_weight_bytes(o, k, wdt, adt))
        lin["qkv_proj"] += mla_costs.kv_b_elements(cfg) * DTYPE_BYTES[dense_dtype(wdt, adt)]
        return {**lin, "mlp": 2 * _linear_weight_bytes(i, d, wdt, adt) + _linear_weight_bytes(d, i, wdt, adt)}
    return {
        "qkv_proj": _linear_weight_bytes(cfg.q_size + 2 * cfg.kv_size, d, wdt, adt, cfg.attention_bias),
        "attn_out_proj": _linear_weight_bytes(d, cfg.q_size, wdt, adt),
        "mlp": 2 * _linear_weight_bytes(i, d, wdt, adt) + _linear_weight_bytes(d, i, wdt, adt),
    }


@functools.lru_cache(maxsize=64)  # a config is frozen; every step's counts read these
def _weight_sizes(cfg: ModelConfig, wdt: str, adt: str, kdt: str) -> tuple:
    """(_layer_linear_bytes, table_bytes, kv_cache_bytes_per_token) of the config in these dtypes."""
    return _layer_linear_bytes(cfg, wdt, adt), table_bytes(cfg, wdt, adt), kv_cache_bytes_per_token(cfg, kdt)


def mlp_counts(cfg: ModelConfig, num_tokens: int, wdt: str, adt: str,
               distinct: Optional[float] = None, expert_parallel: int = 1) -> tuple[int, int, int]:
    """(FLOPs, activation bytes, weight bytes) of every layer's MLP for `num_tokens` tokens. A dense layer:
    the gated MLP. A sparse layer (config/moe.py): the router, k experts per token, the weights of the
    distinct experts the step reads (`distinct` per layer: measured, else E(1 - (1 - k/E)^T), analysis/moe.py)
    and the shared expert. Routed experts are in the weights' format, packed or float, as the projections.
    expert_parallel N: one rank's share of an expert-parallel step, 1/N of the routed experts' rows and of the
    distinct experts read (uniform routing: every rank's experts as busy); router and shared expert whole."""
    T, ab, d = int(num_tokens), DTYPE_BYTES[adt], cfg.hidden_size
    L, i = cfg.num_hidden_layers, cfg.intermediate_size
    sparse = cfg.moe.num_sparse(L) if cfg.moe else 0
    dense = L - sparse
    flops, act = dense * 2 * T * 3 * d * i, dense * T * (3 * d + 3 * i) * ab
    weights = dense * (2 * _linear_weight_bytes(i, d, wdt, adt) + _linear_weight_bytes(d, i, wdt, adt))
    if not sparse:
        return flops, act, weights
    e = cfg.moe.experts
    n = expected_distinct_experts(e.num_experts, e.top_k, T) if distinct is None else float(distinct)
    width, shared = e.intermediate_size, e.shared_intermediate_size
    fb = DTYPE_BYTES[dense_dtype(wdt, adt)]
    expert_w = routed_expert_bytes(cfg, wdt, adt)
    shared_w = (2 * _linear_weight_bytes(shared, d, wdt, adt) + _linear_weight_bytes(d, shared, wdt, adt)
                + d * fb) if shared else 0
    routed = e.top_k / expert_parallel  # routed (token, expert) rows per token on this rank
    flops += round(sparse * 2 * T * d * (e.num_experts + routed * 3 * width + (3 * shared + 1 if shared else 0)))
    per_token = d + e.num_experts + routed * (3 * d + 3 * width) + (3 * d + 3 * shared if shared else 0)
    act += round(sparse * T * per_token * ab)
    weights += sparse * (e.num_experts * d * fb + round(n / expert_parallel * expert_w) + shared_w)
    return flops, act, weights


def routed_expert_bytes(cfg: ModelConfig, wdt: str, adt: str) -> int:
    """Weight bytes of one routed expert (gate, up and down) in the weights' format."""
    d, width = cfg.hidden_size, cfg.moe.experts.intermediate_size
    if cfg.moe.experts.weight_format == "mxfp4":  # gpt-oss as released: its experts' own 4.25 bits per weight
        return round(3 * width * d * MXFP4_BITS_PER_WEIGHT / 8)
    return 2 * _linear_weight_bytes(width, d, wdt, adt) + _linear_weight_bytes(d, width, wdt, adt)


def _norm_weight_elems_per_layer(cfg: ModelConfig) -> int:
    latent = cfg.mla.q_lora_rank + cfg.mla.kv_lora_rank if cfg.mla else 0  # q_a_layernorm, kv_a_layernorm
    return 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0) + latent


def weight_bytes(cfg: ModelConfig, weight_dtype: str = "bfloat16", act_dtype: Optional[str] = None) -> int:
    """Bytes of all parameters (tied embeddings counted once). For float dtypes this is
    cfg.num_parameters() * bytes; for int8 see the module docstring."""
    wdt, adt, _ = resolve_dtypes(weight_dtype, act_dtype)
    eb = DTYPE_BYTES[dense_dtype(wdt, adt)]
    lin = _layer_linear_bytes(cfg, wdt, adt)
    per_layer = lin["qkv_proj"] + lin["attn_out_proj"] + _norm_weight_elems_per_layer(cfg) * eb
    every_expert = cfg.moe.experts.num_experts if cfg.moe else 0
    mlp = mlp_counts(cfg, 0, wdt, adt, distinct=every_expert)[2]
    return cfg.num_hidden_layers * per_layer + mlp + table_bytes(cfg, wdt, adt)[2] + cfg.hidden_size * eb


# --------------------------------------------------------------------------- FLOP counts

def matmul_flops(cfg: ModelConfig, num_tokens: int, num_logits: Optional[int] = None) -> dict[str, int]:
    """Linear-layer FLOPs (2*M*N*K per matmul) for `num_tokens` tokens through every layer and
    `num_logits` rows through lm_head (default: all tokens, as a plain HF forward computes).
    Equals what FlopCounterMode counts for aten.mm/addmm in such a forward."""
    proj = _projection_flops(cfg, int(num_tokens), num_logits)
    mlp = mlp_counts(cfg, int(num_tokens), "float32", "float32")[0]  # dense or sparse layers
    return {"qkv_proj": proj["qkv_proj"], "attn_out_proj": proj["attn_out_proj"], "mlp": mlp,
            "lm_head": proj["lm_head"]}


def _projection_flops(cfg: ModelConfig, T: int, num_logits: Optional[int]) -> dict[str, int]:
    """matmul_flops less the MLP (which mlp_counts gives, with its bytes, where a step needs both)."""
    n_logits = T if num_logits is None else int(num_logits)
    L, d = cfg.num_hidden_layers, cfg.hidden_size
    proj = mla_costs.projection_flops(cfg, T) if cfg.mla else {  # (latent attention's kv_b_proj: its attention)
        "qkv_proj": 2 * T * d * (cfg.q_size + 2 * cfg.kv_size) * L, "attn_out_proj": 2 * T * cfg.q_size * d * L}
    return {
        **proj,
        "lm_head": 2 * n_logits * d * cfg.vocab_size,
    }


def check_seqs(seqs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for s in seqs:
        n, c = int(s[0]), int(s[1])
        if n < 1 or c < 0:
            raise InvalidParameterError("seqs", f"each sequence needs >= 1 new token and >= 0 context, got {tuple(s)}")
        out.append((n, c))
    if not out:
        raise InvalidParameterError("seqs", "a step needs at least one sequence")
    return out


def attended_keys(num_new: int, context_before: int, window: int = 0) -> int:
    """Sum over the new tokens of the keys each attends to, causally: sum_{p=c}^{c+n-1} (p + 1), each
    term capped at `window` for a sliding layer (window > 0)."""
    n, c = num_new, context_before
    if not window:
        return n * c + n * (n + 1) // 2
    k = max(0, min(c + n, window) - c)  # the first k tokens see all their keys, the rest `window` each
    return k * c + k * (k + 1) // 2 + (n - k) * window


def layer_windows(cfg: ModelConfig) -> dict:
    """{window: number of layers} over the model's layer specs (0: full attention)."""
    return dict(_layer_windows(cfg))


@functools.lru_cache(maxsize=64)  # a config is frozen; every step's prediction asks this several times
def _layer_windows(cfg: ModelConfig) -> tuple:
    out: dict = {}
    for spec in cfg.layer_specs():
        out[spec.attention.window] = out.get(spec.attention.window, 0) + 1
    return tuple(out.items())


def layer_keys(cfg: ModelConfig, seqs: Sequence[tuple[int, int]], read_only: bool = False) -> int:
    """Keys attended, summed over the layers and the sequences: each layer kind over its own window.
    read_only: the cached keys a step reads instead (each sequence's context, min(context, window) for a
    sliding layer), per layer."""
    return layer_keys_and_reads(cfg, seqs)[1 if read_only else 0]


def layer_keys_and_reads(cfg: ModelConfig, seqs: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(layer_keys(cfg, seqs), layer_keys(cfg, seqs, read_only=True)) in one pass over the rows per layer kind
    (a step's cost asks for both)."""
    keys = reads = 0
    for window, count in _layer_windows(cfg):
        k = r = 0
        for n, c in seqs:
            k += attended_keys(n, c, window)
            r += min(c, window) if window else c
        keys += count * k
        reads += count * r
    return keys, reads


def kv_cache_bytes_held(cfg: ModelConfig, kv_dtype: str, context: int) -> int:
    """KV bytes one sequence of `context` tokens holds in the engine's cache (block rounding aside): every
    layer's whole context, or with every layer windowed (the manager gives the rest back) the window's."""
    window = window_of(cfg.layer_specs())
    return kv_cache_bytes_per_token(cfg, kv_dtype) * (min(context, window) if window else context)


def attention_flops(cfg: ModelConfig, seqs: Sequence[tuple[int, int]]) -> int:
    """QK^T + PV FLOPs, counted exactly causally (see module docstring), each layer over its window (latent
    attention: analysis/mla.py's, with the absorbed and expanded matmuls)."""
    if cfg.mla:
        return mla_costs.attention_flops(cfg, check_seqs(seqs), attended_keys)
    return 4 * cfg.num_attention_heads * cfg.head_dim * layer_keys(cfg, check_seqs(seqs))


def attention_flops_noncausal(cfg: ModelConfig, seqs: Sequence[tuple[int, int]]) -> int:
    """What a counter sees when every new token is scored against all c + n keys (eager attention,
    SDPA on CUDA under FlopCounterMode): 4*H*D*n*(c+n) per sequence per layer."""
    keys = sum(n * (c + n) for n, c in check_seqs(seqs))
    return 4 * cfg.num_attention_heads * cfg.head_dim * keys * cfg.num_hidden_layers


# --------------------------------------------------------------------------- one step's op groups

def step_op_counts(cfg: ModelConfig, seqs: Sequence[tuple[int, int]], wdt: str, adt: str, kdt: str,
                   n_logits: int, distinct_experts: Optional[float] = None, expert_parallel: int = 1) -> list:
    """(name, FLOPs, activation and KV bytes, weight bytes) of each op group of one step over checked
    `seqs`, in OP_NAMES order: weight, activation and KV dtypes resolved; `n_logits` rows through
    lm_head; distinct_experts: per sparse layer, as measured (None: expected under uniform routing);
    expert_parallel: one expert-parallel rank's share of the routed experts (mlp_counts)."""
    ab, eb = DTYPE_BYTES[adt], DTYPE_BYTES[dense_dtype(wdt, adt)]
    L, d, i, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, q, kv = cfg.num_attention_heads, cfg.q_size, cfg.kv_size
    T = sum(n for n, _ in seqs)
    # keys summed over the layers, each over its own window; cached tokens read, summed over the layers
    keys, read_per_layer = layer_keys_and_reads(cfg, seqs)
    attn_flops = attention_flops(cfg, seqs) if cfg.mla else 4 * H * cfg.head_dim * keys
    mm = _projection_flops(cfg, T, n_logits)
    lin_w, (emb_row, head_w, _), kv_tok = _weight_sizes(cfg, wdt, adt, kdt)

    # (name, flops, activation/KV bytes, weight bytes)
    raw = [
        # only the T looked-up rows of the table are read; T*d activations are written
        ("embedding", 0, T * d * ab, T * emb_row),
        # read x [T, d], write q, k, v [T, q + 2kv]
        ("qkv_proj", mm["qkv_proj"], L * T * (d + q + 2 * kv) * ab, L * lin_w["qkv_proj"]),
        # read q and the new k, v [T, q + 2kv], write out [T, q]; cached K/V are in kv_read
        ("attention", attn_flops, L * T * (2 * q + 2 * kv) * ab, 0),
        ("kv_write", 0, T * kv_tok, 0),
        ("kv_read", 0, read_per_layer * (kv_tok // L), 0),  # a sliding layer reads min(context, window)
        # read attn [T, q], write [T, d]
        ("attn_out_proj", mm["attn_out_proj"], L * T * (q + d) * ab, L * lin_w["attn_out_proj"]),
        # gate and up each read x [T, d] and write [T, i]; down reads [T, i], writes [T, d]
        ("mlp", *mlp_counts(cfg, T, wdt, adt, distinct_experts, expert_parallel)),
    ]
    # Small ops: 2 RMSNorms + 2 residual adds + RoPE (+ q/k norm, + bias adds) per layer, SiLU*up,
    # softmax (fused in SDPA: FLOPs only), and the final norm.
    qk = q + kv
    misc_flops = (L * (2 * _RMSNORM_FLOPS * T * d + 2 * T * d + _ROPE_FLOPS * T * qk + _SILU_MUL_FLOPS * T * i)
                  + _SOFTMAX_FLOPS * H * keys)
    misc_bytes = L * (2 * 2 * T * d + 2 * 3 * T * d + 2 * T * qk + 3 * T * i) * ab
    if cfg.qk_norm:
        misc_flops += L * _RMSNORM_FLOPS * T * qk
        misc_bytes += L * 2 * T * qk * ab
    if cfg.attention_bias:
        misc_flops += L * T * (q + 2 * kv)
    misc_flops += _RMSNORM_FLOPS * T * d
    misc_bytes += 2 * T * d * ab
    misc_w = (L * _norm_weight_elems_per_layer(cfg) + d) * eb
    raw.append(("norms_rope_misc", misc_flops, misc_bytes, misc_w))
    # read the selected hidden rows [n_logits, d], write logits [n_logits, V]; the full table is read
    raw.append(("lm_head", mm["lm_head"], n_logits * (d + V) * ab, head_w))
    return raw
