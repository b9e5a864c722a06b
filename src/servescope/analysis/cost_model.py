"""Roofline cost model of one engine step: predicted time per op group, from op_counts' FLOPs and bytes.

A step is a list of sequences, each `(num_new_tokens, num_context_tokens_before)` (op_counts.py
counts each op group's FLOPs and bytes, and states the counting rules). Per op group we predict
    time = max(flops / (peak[act_dtype] * eff["compute"]), bytes / (bandwidth * eff["memory"]))
and, for the linear ops on a spec with measured kernel rates (the local CPU probe), no faster than
    weight_bytes / linear_rate(weight_dtype, M)
(a GEMV or a matmul of a few rows reaches neither ceiling; see hardware.py), and decode attention
no faster than attention FLOPs / the measured FLOP/s of the decode-attention kernel. Linear ops over
group-32 packed weights with float32 activations run the engine's integer kernels (activations rounded
to int8 per 32-block, int8 dot products): their compute peak is the probe's `packed_gemm_flops` where
it was measured, not the float32 matmul's.
The step's prediction is the sum over ops plus the host overhead (hw.step_overhead_s +
L * hw.layer_overhead_s + B * hw.seq_overhead_s for B sequences, or `overhead_s`). Summing per-op
times assumes ops do not overlap, which is how an unfused engine runs (the torch attention backend
gathers KV, then calls SDPA).

The counting functions are re-exported here: this module is the cost model's public face.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from servescope.analysis.bandwidth import rescaled_seconds
from servescope.analysis.hardware import HardwareSpec
from servescope.analysis.spec import FP8
from servescope.analysis.kernel_table import KernelTable, lookup, table_key
from servescope.analysis.packed_weights import packed_format
from servescope.analysis.op_counts import (
    FLOAT_DTYPES, LINEAR_OPS, OP_NAMES, attended_keys, attention_flops, attention_flops_noncausal, check_seqs,
    kv_cache_bytes_per_token, layer_keys, layer_windows, matmul_flops, resolve_dtypes, routed_expert_bytes,
    step_op_counts, weight_bytes,
)
from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError

__all__ = [
    "FLOAT_DTYPES", "OP_NAMES", "OpCost", "StepCost", "attended_keys", "attention_flops",
    "attention_flops_noncausal", "critical_batch_size", "decode_cost", "integer_gemm_flops",
    "kv_cache_bytes_per_token", "matmul_flops", "predict_tpot", "predict_ttft", "prefill_cost", "resolve_dtypes",
    "step_cost", "weight_bytes",
]


# --------------------------------------------------------------------------- step cost

class OpCost(NamedTuple):
    """One op group in one step. `bytes` includes `weight_bytes`. A named tuple: immutable like a frozen
    dataclass and several times cheaper to build (a step builds one per op group; the simulator predicts
    every distinct step shape)."""

    name: str
    flops: float
    bytes: float
    weight_bytes: float
    compute_seconds: float
    memory_seconds: float
    kernel_seconds: float = 0.0  # weight bytes / the measured linear-kernel rate (hw.linear_rates), or 0
    measured: bool = False  # kernel_seconds is the kernel timed at this model's shapes (a KernelTable)

    @property
    def seconds(self) -> float:
        if self.measured:
            return self.kernel_seconds
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
                "kernel_seconds": self.kernel_seconds, "measured": self.measured, "bound": self.bound}


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
        t_compute = t_memory = 0.0  # (one pass, each sum in op order)
        for o in self.ops:
            if o.compute_seconds > o.memory_seconds:
                t_compute += o.seconds
            else:
                t_memory += o.seconds
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
    distinct_experts: Optional[float] = None,
    expert_parallel: int = 1,
) -> StepCost:
    """Predicted cost of one step over `seqs` [(num_new_tokens, num_context_tokens_before), ...].

    efficiency: {"compute": f, "memory": g}, fractions of peak FLOP/s and bandwidth achievable
    (default 1.0 each), for calibrating against measured steps.
    overhead_s: host seconds added to the step; default hw.step_overhead_s + L * hw.layer_overhead_s
    + B * hw.seq_overhead_s (B = len(seqs): a verification handed in as 1 + k rows counts 1 + k).
    distinct_experts: a MoE's experts read per sparse layer, as measured (None: expected, analysis/moe.py).
    expert_parallel: N, one expert-parallel rank's step (1/N of the routed experts' work; op_counts.mlp_counts).
    num_logits: rows through lm_head; default one per sequence (what the engine computes).
    """
    seqs = check_seqs(seqs)
    wdt, adt, kdt = resolve_dtypes(weight_dtype, act_dtype, kv_dtype)
    eff_c, eff_m = _efficiency(efficiency)
    peak = hw.flops(adt) * eff_c  # weight-only int8 still multiplies in the activation dtype
    linear_peak = (hw.flops(FP8) if wdt == FP8 else integer_gemm_flops(hw, wdt, adt)) * eff_c or peak
    bw = hw.memory_bandwidth * eff_m
    L = cfg.num_hidden_layers
    T, B = sum(n for n, _ in seqs), len(seqs)
    n_logits = B if num_logits is None else int(num_logits)
    raw = step_op_counts(cfg, seqs, wdt, adt, kdt, n_logits, distinct_experts, expert_parallel)

    # Linear ops also cannot beat the measured rate of the engine's kernel at their row count, where
    # the spec has one (the local probe): weight bytes / rate(M), M = tokens (lm_head: logit rows).
    # Decode attention (one query per sequence) likewise cannot beat its kernel's measured FLOP/s.
    # (asked only for ops the kernel table, where there is one, did not time)
    def attention_kernel_s() -> float:
        dec_rate = hw.decode_attention_flops.get(adt)
        dec_keys = layer_keys(cfg, [s for s in seqs if s[0] == 1])  # the decode sequences' share, all layers
        if not (dec_rate and dec_keys):
            return 0.0
        attn_flops = next(f for name, f, _, _ in raw if name == "attention")
        dec_flops = 4 * cfg.num_attention_heads * cfg.head_dim * dec_keys
        return dec_flops / (dec_rate * eff_c) + (attn_flops - dec_flops) / peak

    def kernel_s(name: str, w: float) -> float:
        if name == "attention":
            return attention_kernel_s()
        if name not in LINEAR_OPS:
            return 0.0
        rate = hw.linear_rate(wdt, n_logits if name == "lm_head" else T)
        return w / (rate * eff_m) if rate else 0.0

    table = lookup(hw.kernel_tables, table_key(cfg, wdt, adt, kdt)) if hw.kernel_tables else None
    timed = _timed_ops(cfg, seqs, table, hw, raw, (wdt, adt), (T, n_logits), distinct_experts) if table else {}
    # kernel_s is 0 for every op on a spec without measured linear or decode-attention rates (a datasheet's)
    rated = bool(hw.linear_rates.get(wdt) or hw.decode_attention_flops.get(adt))
    ops = [OpCost(name, float(f), float(a + w), float(w), f / (linear_peak if name in LINEAR_OPS else peak),
                  (a + w) / bw, timed[name] if name in timed else kernel_s(name, w) if rated else 0.0, name in timed)
           for name, f, a, w in raw]
    if overhead_s is None:
        overhead_s = hw.step_overhead_s + L * hw.layer_overhead_s + B * hw.seq_overhead_s
    return StepCost(ops=ops, num_tokens=T, num_seqs=B, overhead_seconds=float(overhead_s),
                    peak_flops=peak, memory_bandwidth=bw)


def _timed_ops(cfg: ModelConfig, seqs: list, table: KernelTable, hw: HardwareSpec, raw: list, dtypes: tuple,
               rows: tuple, distinct_experts: Optional[float]) -> dict:
    """measured_op_seconds at the spec's bandwidth: each op's time re-priced from the bandwidth the table was
    timed at (analysis/bandwidth.rescaled_seconds: its bytes' part moves, overlapped with the rest, so a batch-1
    GEMV follows the bandwidth and a many-row step barely moves; a table without one is priced as timed). The
    table's attention holds the KV reads and its small ops the KV store, so their bytes count there."""
    measured_at = table.bandwidth or hw.memory_bandwidth
    read_s = routed_expert_bytes(cfg, *dtypes) / measured_at if cfg.moe else 0.0
    timed = measured_op_seconds(cfg, seqs, table, *rows, distinct_experts, read_s,
                                cfg.num_hidden_layers * hw.layer_overhead_s)
    if measured_at == hw.memory_bandwidth:
        return timed
    op_bytes = {name: a + w for name, _, a, w in raw}
    op_bytes["attention"] = op_bytes.get("attention", 0.0) + op_bytes.get("kv_read", 0.0)
    op_bytes["norms_rope_misc"] = op_bytes.get("norms_rope_misc", 0.0) + op_bytes.get("kv_write", 0.0)
    return {name: rescaled_seconds(t, op_bytes.get(name, 0.0), measured_at, hw.memory_bandwidth)
            for name, t in timed.items()}


def measured_op_seconds(cfg: ModelConfig, seqs: list, table: KernelTable, T: int, n_logits: int,
                        distinct_experts: Optional[float] = None, expert_read_s: float = 0.0,
                        layers_host_s: float = 0.0) -> dict:
    """{op group: seconds} of the op groups a KernelTable times at this model's shapes: the linear
    layers at the step's rows, a MoE's sparse blocks at its rows (their weight reads scaled by the step's
    measured distinct experts: expert_read_s, one expert at the bandwidth), attention by rows and attended
    keys per layer kind (its reads of the cached KV included, so kv_read is 0), the small per-layer ops with
    the KV store (kv_write 0), the head with the sampler's pick over its logits (lm_head). A MoE table without
    its block times leaves the MLP to the roofline. The layers of a prefill step (the Python layer forward) have
    their linear ops scaled by the table's prefill_factor, those of a decode-only step on the C++ decode plan all
    their ops by its decode factor (kernel_table.py; layers_host_s: the host overhead added for the step's layers,
    which the plan's measured time holds)."""
    L = cfg.num_hidden_layers
    sparse = cfg.moe.num_sparse(L) if cfg.moe else 0
    g = table.layers_factor(seqs, layers_host_s)  # the decode plan's layers together against their kernels
    f = g * table.linear_factor(T, any(n > 1 for n, _ in seqs))  # the Python layer forward of a prefill step
    lin = {name: f * table.linear_seconds(name, T)
           for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    attention = g * sum(count * table.attention_seconds(seqs, lambda s, w=window: attended_keys(s[0], s[1], w))
                        for window, count in layer_windows(cfg).items())
    out = {"qkv_proj": L * lin["qkv_proj"], "attention": attention, "kv_write": 0.0, "kv_read": 0.0,
           "attn_out_proj": L * lin["o_proj"],
           "mlp": (L - sparse) * (lin["gate_up_proj"] + lin["down_proj"])
           + sparse * f * table.moe_seconds(T, distinct_experts, expert_read_s),
           "norms_rope_misc": g * L * table.misc_seconds(T),
           "lm_head": table.linear_seconds("lm_head", n_logits) + table.sample_seconds(n_logits)}
    if sparse and not table.moe:
        del out["mlp"]
    return out


def integer_gemm_flops(hw: HardwareSpec, weight_dtype: str, act_dtype: str) -> float:
    """The measured FLOP/s of the engine's integer matmul for these weights, or 0 where its linear ops
    multiply in the activation dtype: the integer kernels take group-32 packed weights (int4, int8-g32,
    q4_0 / q4_1 / q8_0) with float32 activations on the CPU, and bfloat16 ones where the CPU's kernels run
    them on the panel GEMM too (hw.packed_gemm_bfloat16); other groups, bfloat16 activations elsewhere and
    the GPU's Triton kernels dequantise and multiply in the activation dtype."""
    fmt = packed_format(weight_dtype)
    if hw.kind != "cpu" or fmt is None or fmt.group != 32:
        return 0.0
    if act_dtype == "float32" or (act_dtype == "bfloat16" and hw.packed_gemm_bfloat16):
        return float(hw.packed_gemm_flops)
    return 0.0


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
    compute-bound (long contexts: KV reads grow as fast as FLOPs). The result is fractional. The same
    solve runs on the ops' compute and memory seconds (each op at its own peak: packed linear ops on the
    integer GEMM's, integer_gemm_flops), which reduces to the formula above when one peak prices all.
    """
    kw = dict(efficiency=efficiency, overhead_s=0.0)
    s1 = decode_cost(cfg, 1, context_len, hw, weight_dtype, kv_dtype, act_dtype, **kw)
    s2 = decode_cost(cfg, 2, context_len, hw, weight_dtype, kv_dtype, act_dtype, **kw)
    c1, m1 = s2.compute_seconds - s1.compute_seconds, s2.memory_seconds - s1.memory_seconds
    c0, m0 = s1.compute_seconds - c1, s1.memory_seconds - m1
    denom = c1 - m1
    if denom <= 0:
        return math.inf
    return max((m0 - c0) / denom, 0.0)
