"""The CPU per-layer op extension (csrc/cpu_ops.cpp over the kernels of csrc/kernels.h, written once
against the vector layer csrc/simd.h; csrc/prefill_attention.cpp, csrc/quant_ops.cpp; bound to Python in
csrc/bindings.cpp), compiled on first use for the CPU's instruction set (extension.py) and cached.

One C++ call each for rms_norm, add_rms_norm, rotary, silu_mul (dispatched from kernels/fused_ops.py)
and store_kv, paged decode attention, causal prefill attention (from model/attention/cpu.py), and an MoE
layer's routed experts over packed weights (`moe_packed`) or float / per-channel int8 ones (`moe_dense`), from
model/moe.py: at batch 1 their eager
PyTorch versions are dozens of tiny ops per layer whose dispatch overhead exceeds their arithmetic.
`load()` is None where the extension cannot be built (no compiler, SERVESCOPE_CPU_KERNELS=0, read
once at the first call); callers then use the torch references, which the tests compare against.
`kernel_path()` says which path runs ("avx2 C++ kernels", "eager PyTorch").
"""

from __future__ import annotations

import logging

import torch

from servescope.kernels.cpu.extension import CpuExtension

logger = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16)
# KV cache element types the kernels read: the float ones and the quantised int8 / fp8 e4m3 caches
# (rows of D values then a float32 scale: csrc/kv_quant.h)
KV_DTYPES = DTYPES + (torch.int8,) + ((torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ())
# -ffp-contract=off: no fused multiply-adds where the torch reference rounds each step
# the extension's translation units (csrc/ops.h says why several): ninja compiles them in parallel
SOURCES = ["bindings.cpp", "cpu_ops.cpp", "prefill_attention.cpp", "quant_ops.cpp", "onednn_linear.cpp",
           "moe_dense.cpp", "host_cache.cpp"]
_EXT = CpuExtension("servescope_cpu_ops", SOURCES, "CPU op kernels", extra_cflags=["-ffp-contract=off"])
_EMPTY = torch.empty(0)
load = _EXT.load  # the compiled module, or None (see extension.py)
load_in_background = _EXT.load_in_background  # start the first build while the caller loads weights
available = _EXT.available
kernel_path = _EXT.describe


def isa() -> str:
    """The instruction set of the kernels in use (avx512 | avx2 | neon | scalar), "eager" without them."""
    _EXT.load()
    return _EXT.isa


def loaded_kernel_path():
    """kernel_path() if the extension was loaded in this process (a CPU engine loads it at build),
    else None: never builds (a GPU server's /metrics must not compile CPU kernels)."""
    return _EXT.describe() if _EXT.isa is not None else None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _EXT.mod.rms_norm(x, w, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> tuple:
    y, h = _EXT.mod.add_rms_norm(x, residual, w, eps)
    return y, h


HOST_CACHE_BYTES = 1 << 30  # the freed large blocks kept for the next step's tensors (csrc/host_cache.cpp)


def cache_host_memory(limit_bytes: int = HOST_CACHE_BYTES) -> bool:
    """Install the caching allocator of csrc/host_cache.cpp for torch's CPU tensors of 1 MiB and more, once
    per process (a later call sets the limit): each step's large activations then reuse the blocks the step
    before freed instead of faulting fresh pages in. False where the extension is not built."""
    mod = load()
    if mod is None:
        return False
    mod.host_cache_install(int(limit_bytes))
    return True


def host_cache_stats() -> dict:
    """{installed, limit_bytes, cached_bytes, in_use_bytes, hits, misses, dropped (blocks given back to the OS:
    the oldest kept ones past the limit)} of the caching allocator ({} where the extension is not built)."""
    mod = load()
    return {} if mod is None else {k: int(v) for k, v in mod.host_cache_stats().items()}


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    qo, ko = _EXT.mod.rotary(q, k, cos, sin)
    return qo, ko


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _EXT.mod.silu_mul(gate_up)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation of [n, 2I] float32 | bfloat16 -> [n, I] (kernels/fused_ops.clamped_swiglu's), in
    float32 with one rounding to the dtype at the end; a row's bits do not depend on the rows beside it."""
    return _EXT.mod.clamped_swiglu(gate_up, limit, alpha)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    _EXT.mod.store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, out=None,
                 window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
    """q [B, H, D]; caches [N, S, Hkv, D] (int8 / fp8: [..., D + 4]); block_tables [>=B, M] int32;
    context_lens [>=B] int32 -> [B, H, D]. window > 0: each row reads its last `window` positions only;
    softcap > 0 and sinks [H] (any float dtype): model/attention/scores.attend's."""
    sinks = _EMPTY if sinks is None else sinks.float().contiguous()
    return _EXT.mod.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                 _EMPTY if out is None else out, window, float(softcap), sinks)


def latent_decode(q, cache, block_tables, context_lens, scale: float, v_dim: int) -> torch.Tensor:
    """MLA's absorbed decode: q [B, H, d] over the latent cache [N, S, 1, d] (int8 / fp8: d + 4), the rows as
    the keys and their first v_dim features as the values -> [B, H, v_dim]: paged_decode(q, cache, cache, ...)
    [..., :v_dim] bit for bit, without reading the other d - v_dim features as values."""
    return _EXT.mod.latent_decode(q, cache, block_tables, context_lens, scale, v_dim)


def prefill_attention_supported(group: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether prefill_attention has a kernel for this GQA group, head dim and dtype on this CPU (bfloat16: AVX-512
    BF16; float32: every ISA path)."""
    return _EXT.mod is not None and _EXT.mod.prefill_attention_supported(group, head_dim, dtype == torch.float32)


def prefill_attention(q, k_cache, v_cache, block_table, ctx: int, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's T prefill tokens (positions ctx - T .. ctx - 1) over its
    keys 0 .. ctx - 1 in the paged cache (this step's already stored). q [T, H, D] bfloat16 or float32, the
    caches q's dtype; block_table [>= ceil(ctx / S)] int32 -> [T, H, D]."""
    return _EXT.mod.prefill_attention(q, k_cache, v_cache, block_table, ctx, scale)


def moe_packed(gate_up: list, down: list, first: int = 0, gate_up_bias=(), down_bias=(), act: int = 0,
               alpha: float = 0.0, limit: float = 0.0):
    """One MoE layer's routed experts over packed group-32 weights as one C++ op (csrc/moe_experts.h), or None
    without the extension. gate_up / down: per local expert (qweight, scales) of its [2I, H] gate | up and
    [H, I] down matrices (quant/packed.py's form: int4 or int8, symmetric or asymmetric), local expert e being
    the router's expert first + e (a subset of the experts, for expert parallelism). The handle's
    `run(x [T, H] float32 | bfloat16, ids [T, k] int64, weights [T, k])` -> (out [T, H] in x's dtype, tokens
    per local expert [E] int64): model/moe.py's grouped_experts bit for bit, pairs routed outside the local
    experts skipped. MXFP4 experts (uint8 E8M0 scales, quant/mxfp4.py) too. gate_up_bias / down_bias: per local
    expert float32 [2I] / [H] biases or empty; act 0: silu(gate) * up, 1: gpt-oss's clamped SwiGLU (alpha,
    limit). Raises RuntimeError for weights outside that form (other groups, mixed formats)."""
    if _EXT.load() is None:
        return None
    return _EXT.mod.MoePacked([w for w, _ in gate_up], [s for _, s in gate_up], [w for w, _ in down],
                              [s for _, s in down], first, list(gate_up_bias), list(down_bias), act, alpha, limit)


def moe_dense(gate_up: list, down: list, gemv_rows: int, first: int = 0, scales=None, biases=None, act: int = 0,
              alpha: float = 0.0, limit: float = 0.0):
    """One MoE layer's routed experts over float32 / bfloat16 or per-channel int8 weights as one C++ op
    (csrc/moe_dense.cpp), or None without the extension. gate_up / down: per local expert its [2I, H] gate | up
    and [H, I] down matrix (contiguous), local expert e being the router's expert first + e; scales (int8 only):
    (gate_up float32, down float32, gate_up in the activation dtype, down likewise), a list of [N] per expert
    each (Int8Linear's `_scale_f32` and `scale`). Each expert's rows run the GEMV up to gemv_rows rows, ATen's
    linear above, as its module does (Int8Linear: cpu_linear.MAX_ROWS; float experts: model/moe_fused.py's).
    The handle's `run(x [T, H], ids [T, k] int64, weights [T, k])` -> (out [T, H] in x's dtype, tokens per
    local expert [E] int64): grouped_experts over those modules bit for bit. biases: (gate_up [E, 2I], down
    [E, H]) in the activation dtype, each added after its projection's rounding to that dtype (gpt-oss's
    ClampedExperts, and PackedClampedExperts of Int8Linears); act 0: silu(gate) * up, 1: the clamped SwiGLU
    (alpha, limit: the kernel of `clamped_swiglu`, which the modules call). Raises RuntimeError for other weights
    or shapes."""
    if _EXT.load() is None:
        return None
    s = [list(p) for p in scales] if scales is not None else [[], [], [], []]
    b = list(biases) if biases is not None else [_EMPTY, _EMPTY]
    return _EXT.mod.MoeDense(list(gate_up), list(down), *s, first, gemv_rows, *b, act, alpha, limit)
