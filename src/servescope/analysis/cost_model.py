"""Roofline cost model of one engine step: FLOPs, bytes and predicted time per op group.

A step is a list of sequences, each `(num_new_tokens, num_context_tokens_before)`: a prefill chunk
has many new tokens, a decode token has one. Legend: T = total new tokens, B = sequences,
L layers, d hidden, q = H*D query width, kv = Hkv*D key (and value) width, i intermediate, V vocab.

Per op group we count FLOPs and bytes moved, and predict
    time = max(flops / (peak[act_dtype] * eff["compute"]), bytes / (bandwidth * eff["memory"]))
and, for the linear ops on a spec with measured kernel rates (the local CPU probe), no faster than
    weight_bytes / linear_rate(weight_dtype, M)
(a GEMV or a matmul of a few rows reaches neither ceiling; see hardware.py), and decode attention
no faster than attention FLOPs / the measured FLOP/s of the decode-attention kernel.
The step's prediction is the sum over ops plus a fixed overhead (hw.step_overhead_s +
L * hw.layer_overhead_s, or `overhead_s`). Summing per-op times assumes ops do not overlap, which
is how an unfused engine runs (the torch attention backend gathers KV, then calls SDPA).

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
- "kv_read" reads each sequence's cached context (c tokens, all layers); the new tokens' K/V come
  from activations and are counted once in "kv_write".
- "lm_head" runs only for tokens whose logits are needed: one per sequence in the engine.
- int8 means weight-only quantisation: linear weights in decoder layers are 1 byte per parameter
  plus one scale per output channel (activation dtype); embeddings, norms and lm_head stay in the
  activation dtype; matmuls run in the activation dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from servescope.analysis.hardware import DTYPE_BYTES, DTYPES, HardwareSpec
from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_LINEAR_OPS = ("qkv_proj", "attn_out_proj", "mlp", "lm_head")
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
    """(weight, activation, kv) dtypes. Activations default to the weight dtype (bfloat16 for int8);
    the KV cache defaults to the activation dtype."""
    if weight_dtype not in DTYPES:
        raise InvalidParameterError("weight_dtype", f"weight dtype must be one of {', '.join(DTYPES)}, got {weight_dtype!r}")
    act = act_dtype or ("bfloat16" if weight_dtype == "int8" else weight_dtype)
    kv = kv_dtype or act
    if act not in FLOAT_DTYPES:
        raise InvalidParameterError("act_dtype", f"activation dtype must be one of {', '.join(FLOAT_DTYPES)}, got {act!r}")
    if kv not in FLOAT_DTYPES:
        raise InvalidParameterError("kv_dtype", f"KV cache dtype must be one of {', '.join(FLOAT_DTYPES)}, got {kv!r}")
    return weight_dtype, act, kv


def kv_cache_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bfloat16") -> int:
    """K and V for one token in every layer: 2 * L * Hkv * D * bytes (Llama-3-8B bf16: 131072)."""
    if kv_dtype not in FLOAT_DTYPES:
        raise InvalidParameterError("kv_dtype", f"KV cache dtype must be one of {', '.join(FLOAT_DTYPES)}, got {kv_dtype!r}")
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * DTYPE_BYTES[kv_dtype]


def _linear_weight_bytes(out_features: int, in_features: int, wdt: str, adt: str, bias: bool = False) -> int:
    """One nn.Linear's weight bytes; int8 adds one scale per output channel in the activation dtype."""
    n = out_features * in_features * DTYPE_BYTES[wdt]
    if wdt == "int8":
        n += out_features * DTYPE_BYTES[adt]
    if bias:
        n += out_features * DTYPE_BYTES[adt if wdt == "int8" else wdt]
    return n


def _dense_dtype(wdt: str, adt: str) -> str:
    """Embeddings, norms and lm_head stay unquantised: the activation dtype under int8."""
    return adt if wdt == "int8" else wdt


def _layer_linear_bytes(cfg: ModelConfig, wdt: str, adt: str) -> dict[str, int]:
    d, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv_proj": _linear_weight_bytes(cfg.q_size + 2 * cfg.kv_size, d, wdt, adt, cfg.attention_bias),
        "attn_out_proj": _linear_weight_bytes(d, cfg.q_size, wdt, adt),
        "mlp": 2 * _linear_weight_bytes(i, d, wdt, adt) + _linear_weight_bytes(d, i, wdt, adt),
    }


def _norm_weight_elems_per_layer(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)


def weight_bytes(cfg: ModelConfig, weight_dtype: str = "bfloat16", act_dtype: Optional[str] = None) -> int:
    """Bytes of all parameters (tied embeddings counted once). For float dtypes this is
    cfg.num_parameters() * bytes; for int8 see the module docstring."""
    wdt, adt, _ = resolve_dtypes(weight_dtype, act_dtype)
    eb = DTYPE_BYTES[_dense_dtype(wdt, adt)]
    per_layer = sum(_layer_linear_bytes(cfg, wdt, adt).values()) + _norm_weight_elems_per_layer(cfg) * eb
    emb = cfg.vocab_size * cfg.hidden_size * eb * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_hidden_layers * per_layer + emb + cfg.hidden_size * eb


# --------------------------------------------------------------------------- FLOP counts

def matmul_flops(cfg: ModelConfig, num_tokens: int, num_logits: Optional[int] = None) -> dict[str, int]:
    """Linear-layer FLOPs (2*M*N*K per matmul) for `num_tokens` tokens through every layer and
    `num_logits` rows through lm_head (default: all tokens, as a plain HF forward computes).
    Equals what FlopCounterMode counts for aten.mm/addmm in such a forward."""
    T = int(num_tokens)
    n_logits = T if num_logits is None else int(num_logits)
    L, d, i = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv_proj": 2 * T * d * (cfg.q_size + 2 * cfg.kv_size) * L,
        "attn_out_proj": 2 * T * cfg.q_size * d * L,
        "mlp": 2 * T * 3 * d * i * L,
        "lm_head": 2 * n_logits * d * cfg.vocab_size,
    }


def _check_seqs(seqs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for s in seqs:
        n, c = int(s[0]), int(s[1])
        if n < 1 or c < 0:
            raise InvalidParameterError("seqs", f"each sequence needs >= 1 new token and >= 0 context, got {tuple(s)}")
        out.append((n, c))
    if not out:
        raise InvalidParameterError("seqs", "a step needs at least one sequence")
    return out


def attended_keys(num_new: int, context_before: int) -> int:
    """Sum over the new tokens of the keys each attends to, causally: sum_{p=c}^{c+n-1} (p + 1)."""
    n, c = num_new, context_before
    return n * c + n * (n + 1) // 2


def attention_flops(cfg: ModelConfig, seqs: Sequence[tuple[int, int]]) -> int:
    """QK^T + PV FLOPs, counted exactly causally (see module docstring)."""
    keys = sum(attended_keys(n, c) for n, c in _check_seqs(seqs))
    return 4 * cfg.num_attention_heads * cfg.head_dim * keys * cfg.num_hidden_layers


def attention_flops_noncausal(cfg: ModelConfig, seqs: Sequence[tuple[int, int]]) -> int:
    """What a counter sees when every new token is scored against all c + n keys (eager attention,
    SDPA on CUDA under FlopCounterMode): 4*H*D*n*(c+n) per sequence per layer."""
    keys = sum(n * (c + n) for n, c in _check_seqs(seqs))
    return 4 * cfg.num_attention_heads * cfg.head_dim * keys * cfg.num_hidden_layers


# --------------------------------------------------------------------------- step cost

@dataclass(frozen=True)
class OpCost:
    """One op group in one step. `bytes` includes `weight_bytes`."""

    name: str
    flops: float
    bytes: float
    weight_bytes: float
    compute_seconds: float
    memory_seconds: float
    kernel_seconds: float = 0.0  # weight bytes / the measured linear-kernel rate (hw.linear_rates), or 0

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds, self.kernel_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds > self.memory_seconds else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0  # an empty op (kv_read of no context)

    def to_dict(self) -> dict:
        return {"name": self.name, "flops": self.flops, "bytes": self.bytes, "weight_bytes": self.weight_bytes,
                "arithmetic_intensity": self.arithmetic_intensity, "predicted_seconds": self.seconds,
                "compute_seconds": self.compute_seconds, "memory_seconds": self.memory_seconds,
                "kernel_seconds": self.kernel_seconds, "bound": self.bound}


@dataclass(frozen=True)
class StepCost:
    """The predicted cost of one step: per-op costs, their sum, and a fixed overhead."""

    ops: list = field(default_factory=list)  # list[OpCost], in execution order
    num_tokens: int = 0
    num_seqs: int = 0
    overhead_seconds: float = 0.0
    peak_flops: float = 0.0  # effective (after efficiency) peak used for the prediction
    memory_bandwidth: float = 0.0  # effective bandwidth used

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.ops)

    @property
    def bytes(self) -> float:
        return sum(o.bytes for o in self.ops)

    @property
    def weight_bytes(self) -> float:
        return sum(o.weight_bytes for o in self.ops)

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def compute_seconds(self) -> float:
        return sum(o.compute_seconds for o in self.ops)

    @property
    def memory_seconds(self) -> float:
        return sum(o.memory_seconds for o in self.ops)

    @property
    def predicted_seconds(self) -> float:
        return sum(o.seconds for o in self.ops) + self.overhead_seconds

    @property
    def bound(self) -> str:
        """The bound of the ops that dominate time: compare the time spent in compute-bound ops
        with the time spent in memory-bound ops."""
        t_compute = sum(o.seconds for o in self.ops if o.bound == "compute")
        t_memory = sum(o.seconds for o in self.ops if o.bound == "memory")
        return "compute" if t_compute > t_memory else "memory"

    def op(self, name: str) -> OpCost:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"num_tokens": self.num_tokens, "num_seqs": self.num_seqs, "flops": self.flops,
                "bytes": self.bytes, "weight_bytes": self.weight_bytes,
                "arithmetic_intensity": self.arithmetic_intensity,
                "predicted_seconds": self.predicted_seconds, "overhead_seconds": self.overhead_seconds,
                "bound": self.bound, "ops": [o.to_dict() for o in self.ops]}


def _efficiency(efficiency: Optional[dict]) -> tuple[float, float]:
    eff = {"compute": 1.0, "memory": 1.0}
    for k, v in (efficiency or {}).items():
        if k not in eff:
            raise InvalidParameterError("efficiency", f"efficiency keys are 'compute' and 'memory', got {k!r}")
        if not 0 < float(v) <= 1:
            raise InvalidParameterError("efficiency", f"efficiency[{k!r}] must be in (0, 1], got {v}")
        eff[k] = float(v)
    return eff["compute"], eff["memory"]


def step_cost(
    cfg: ModelConfig,
    seqs: Sequence[tuple[int, int]],
    hw: HardwareSpec,
    weight_dtype: str = "bfloat16",
    kv_dtype: Optional[str] = None,
    act_dtype: Optional[str] = None,
    *,
    num_logits: Optional[int] = None,
    efficiency: Optional[dict] = None,
    overhead_s: Optional[float] = None,
) -> StepCost:
    """Predicted cost of one step over `seqs` [(num_new_tokens, num_context_tokens_before), ...].

    efficiency: {"compute": f, "memory": g}, fractions of peak FLOP/s and bandwidth achievable
    (default 1.0 each), for calibrating against measured steps.
    overhead_s: fixed seconds added to the step; default hw.step_overhead_s + L * hw.layer_overhead_s.
    num_logits: rows through lm_head; default one per sequence (what the engine computes).
    """
    seqs = _check_seqs(seqs)
    wdt, adt, kdt = resolve_dtypes(weight_dtype, act_dtype, kv_dtype)
    ab, eb = DTYPE_BYTES[adt], DTYPE_BYTES[_dense_dtype(wdt, adt)]
    eff_c, eff_m = _efficiency(efficiency)
    peak = hw.flops(adt) * eff_c  # weight-only int8 still multiplies in the activation dtype
    bw = hw.memory_bandwidth * eff_m

    L, d, i, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, D, q, kv = cfg.num_attention_heads, cfg.head_dim, cfg.q_size, cfg.kv_size
    T, B = sum(n for n, _ in seqs), len(seqs)
    n_logits = B if num_logits is None else int(num_logits)
    keys = sum(attended_keys(n, c) for n, c in seqs)
    dec_keys = sum(c + 1 for n, c in seqs if n == 1)  # attended_keys(1, c): the decode sequences' share
    flops_per_key = 4 * H * D * L  # q.k and p.v over all layers, per attended key
    attn_flops = flops_per_key * keys  # = attention_flops(cfg, seqs), from the keys counted once
    context = sum(c for _, c in seqs)
    mm = matmul_flops(cfg, T, n_logits)
    lin_w = _layer_linear_bytes(cfg, wdt, adt)
    kv_tok = kv_cache_bytes_per_token(cfg, kdt)

    # (name, flops, activation/KV bytes, weight bytes)
    raw = [
        # only the T looked-up rows of the table are read; T*d activations are written
        ("embedding", 0, T * d * ab, T * d * eb),
        # read x [T, d], write q, k, v [T, q + 2kv]
        ("qkv_proj", mm["qkv_proj"], L * T * (d + q + 2 * kv) * ab, L * lin_w["qkv_proj"]),
        # read q and the new k, v [T, q + 2kv], write out [T, q]; cached K/V are in kv_read
        ("attention", attn_flops, L * T * (2 * q + 2 * kv) * ab, 0),
        ("kv_write", 0, T * kv_tok, 0),
        ("kv_read", 0, context * kv_tok, 0),
        # read attn [T, q], write [T, d]
        ("attn_out_proj", mm["attn_out_proj"], L * T * (q + d) * ab, L * lin_w["attn_out_proj"]),
        # gate and up each read x [T, d] and write [T, i]; down reads [T, i], writes [T, d]
        ("mlp", mm["mlp"], L * T * (3 * d + 3 * i) * ab, L * lin_w["mlp"]),
    ]
    # Small ops: 2 RMSNorms + 2 residual adds + RoPE (+ q/k norm, + bias adds) per layer, SiLU*up,
    # softmax (fused in SDPA: FLOPs only), and the final norm.
    qk = q + kv
    misc_flops = L * (2 * _RMSNORM_FLOPS * T * d + 2 * T * d + _ROPE_FLOPS * T * qk
                      + _SILU_MUL_FLOPS * T * i + _SOFTMAX_FLOPS * H * keys)
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
    raw.append(("lm_head", mm["lm_head"], n_logits * (d + V) * ab, V * d * eb))

    # Linear ops also cannot beat the measured rate of the engine's kernel at their row count, where
    # the spec has one (the local probe): weight bytes / rate(M), M = tokens (lm_head: logit rows).
    # Decode attention (one query per sequence) likewise cannot beat its kernel's measured FLOP/s.
    dec_rate = hw.decode_attention_flops.get(adt)
    attn_kernel = 0.0
    if dec_rate and dec_keys:
        dec_flops = flops_per_key * dec_keys
        attn_kernel = dec_flops / (dec_rate * eff_c) + (attn_flops - dec_flops) / peak

    def kernel_s(name: str, w: float) -> float:
        if name == "attention":
            return attn_kernel
        if name not in _LINEAR_OPS:
            return 0.0
        rate = hw.linear_rate(wdt, n_logits if name == "lm_head" else T)
        return w / (rate * eff_m) if rate else 0.0

    ops = [OpCost(name=name, flops=float(f), bytes=float(a + w), weight_bytes=float(w),
                  compute_seconds=f / peak, memory_seconds=(a + w) / bw, kernel_seconds=kernel_s(name, w))
           for name, f, a, w in raw]
    if overhead_s is None:
        overhead_s = hw.step_overhead_s + L * hw.layer_overhead_s
    return StepCost(ops=ops, num_tokens=T, num_seqs=B, overhead_seconds=float(overhead_s),
                    peak_flops=peak, memory_bandwidth=bw)


def prefill_cost(cfg: ModelConfig, prompt_len: int, batch: int = 1, hw: Optional[HardwareSpec] = None,
                 weight_dtype: str = "bfloat16", kv_dtype: Optional[str] = None,
                 act_dtype: Optional[str] = None, *, context_len: int = 0, **kw) -> StepCost:
    """One step prefilling `batch` prompts of `prompt_len` new tokens (after `context_len` cached)."""
    if hw is None:
        raise InvalidParameterError("hardware", "prefill_cost needs a HardwareSpec")
    return step_cost(cfg, [(prompt_len, context_len)] * batch, hw, weight_dtype, kv_dtype, act_dtype, **kw)


def decode_cost(cfg: ModelConfig, batch: int, context_len: int, hw: Optional[HardwareSpec] = None,
                weight_dtype: str = "bfloat16", kv_dtype: Optional[str] = None,
                act_dtype: Optional[str] = None, **kw) -> StepCost:
    """One decode step: `batch` sequences, one new token each, `context_len` tokens cached each."""
    if hw is None:
        raise InvalidParameterError("hardware", "decode_cost needs a HardwareSpec")
    return step_cost(cfg, [(1, context_len)] * batch, hw, weight_dtype, kv_dtype, act_dtype, **kw)


# --------------------------------------------------------------------------- derived predictions

def predict_ttft(cfg: ModelConfig, prompt_len: int, hw: HardwareSpec, weight_dtype: str = "bfloat16",
                 kv_dtype: Optional[str] = None, act_dtype: Optional[str] = None, *, batch: int = 1,
                 chunk_size: Optional[int] = None, **kw) -> float:
    """Seconds to prefill `batch` prompts together and produce each one's first token.
    With `chunk_size`, the prompt is prefilled in chunks, one step each (chunked prefill)."""
    if prompt_len < 1:
        raise InvalidParameterError("prompt_len", f"prompt_len must be at least 1, got {prompt_len}")
    chunk = prompt_len if not chunk_size else int(chunk_size)
    total, done = 0.0, 0
    while done < prompt_len:
        n = min(chunk, prompt_len - done)
        total += step_cost(cfg, [(n, done)] * batch, hw, weight_dtype, kv_dtype, act_dtype, **kw).predicted_seconds
        done += n
    return total


def predict_tpot(cfg: ModelConfig, batch: int, context_len: int, hw: HardwareSpec,
                 weight_dtype: str = "bfloat16", kv_dtype: Optional[str] = None,
                 act_dtype: Optional[str] = None, **kw) -> float:
    """Seconds per output token of each of `batch` sequences decoding at `context_len` cached tokens."""
    return decode_cost(cfg, batch, context_len, hw, weight_dtype, kv_dtype, act_dtype, **kw).predicted_seconds


def critical_batch_size(cfg: ModelConfig, hw: HardwareSpec, weight_dtype: str = "bfloat16",
                        context_len: int = 0, kv_dtype: Optional[str] = None,
                        act_dtype: Optional[str] = None, *, efficiency: Optional[dict] = None) -> float:
    """Decode batch size at which a step's total compute time equals its total memory time.

    In decode, FLOPs and bytes are both affine in the batch b: flops = f0 + f1*b (f0 = 0: every
    FLOP belongs to some token) and bytes = m0 + m1*b (m0 = weights, m1 = KV reads and
    activations of one sequence). Solving (f0 + f1 b)/P = (m0 + m1 b)/BW gives
        b* = (m0/BW - f0/P) / (f1/P - m1/BW).
    Below b* the step is memory-bound, above it compute-bound. Returns math.inf when it never turns
    compute-bound (long contexts: KV reads grow as fast as FLOPs). The result is fractional.
    """
    kw = dict(efficiency=efficiency, overhead_s=0.0)
    s1 = decode_cost(cfg, 1, context_len, hw, weight_dtype, kv_dtype, act_dtype, **kw)
    s2 = decode_cost(cfg, 2, context_len, hw, weight_dtype, kv_dtype, act_dtype, **kw)
    P, BW = s1.peak_flops, s1.memory_bandwidth
    f1, m1 = s2.flops - s1.flops, s2.bytes - s1.bytes
    f0, m0 = s1.flops - f1, s1.bytes - m1
    denom = f1 / P - m1 / BW
    if denom <= 0:
        return math.inf
    return max((m0 / BW - f0 / P) / denom, 0.0)
