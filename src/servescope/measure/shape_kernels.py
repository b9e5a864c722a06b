"""The engine's kernels timed at one loaded model's own shapes (analysis/kernel_table.py says what the
table holds and how the cost model reads it); measure/kernel_cache.py assembles the table (with a MoE's
sparse blocks: measure/moe_kernels.py, and the C++ decode plan's layers together: measure/decode_plan.py)
and caches it once per CPU, model shape and dtypes.

All on the engine's own objects, so the table follows the kernels whatever they become:
- the projections, the head and the sampler: measure/linear_kernels.py (with this module's timing settings);
- attention: the engine's backend on caches of the model's KV heads (decode batches, prefills over
  cached prefixes), cycling over enough cache copies, every page written (written_cache), that the KV
  comes from memory, fitted to seconds = a + b * rows + c * keys per path (kernel_table.fit_linear_model);
- the small per-layer ops (two add+RMSNorms, rotary, SiLU*up, the KV store) at MISC_TOKENS tokens;
- the model's own layer forward over a prefill of LAYER_TOKENS tokens (prefill_factor).
The same call on a tiny shape (its dispatch: the probe's host overhead per layer has it) is subtracted.
docs/VALIDATION.md has how long it takes per shape.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch

from servescope.analysis.kernel_table import KernelTable, fit_linear_model
from servescope.analysis.op_counts import attended_keys, layer_windows
from servescope.kernels import fused_ops
from servescope.model.attention import kv_quant
from servescope.model.attention.backend import AttentionMetadata
from servescope.model.attention.cpu import PAGED_PREFILL_MAX_CONTEXT, TILED_F32_MIN_TOKENS, TILED_PREFILL_MIN_TOKENS

logger = logging.getLogger(__name__)

ALL_LAYER_ROWS = 16  # up to this many rows every layer is timed (memory-bound: the caches matter)
PASS_BUDGET_S = 0.3
RUNS = 5
LARGE_RUNS = 3  # passes above ALL_LAYER_ROWS rows (each PASS_BUDGET_S)
MISC_TOKENS = (1, 8, 64, 512)
LAYER_TOKENS = (16, 64, 65, 128, 256, 320, 512, 1024, 2048)  # prefills through the model's own layer forward
PAGED_GRID = ((1, 128), (1, 2048), (8, 512), (32, 128), (32, 1024))  # (decode rows, context each)
# bfloat16 prefill chunks the paged kernel takes: (tokens, context before)
SHORT_GRID = ((16, 0), (32, 0), (32, 256), (64, 512))
# float32 prefill chunks below the tiled kernel's tokens (SDPA, each over its gathered context): (tokens, context)
SHORT_F32_GRID = tuple((n, c) for c in (0, 128, 512) for n in (2, TILED_F32_MIN_TOKENS // 2, TILED_F32_MIN_TOKENS - 1))
# one prefill: (tokens, context before)
LONG_GRID = ((128, 0), (512, 0), (256, 512), (128, 1536), (512, 1024), (2048, 0))
KV_COPIES_BYTES = 1 << 30  # caches cycled so that attention reads its KV from memory, as a step's layers do
BLOCK = 16
FILL_BYTE = 0x20  # read as a normal number in every KV dtype: bfloat16, float16, float32, fp8 e4m3, int8 + scale


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_of(fn, runs: int = RUNS) -> float:
    fn()  # warm-up: the kernel's first call at this shape (allocations, oneDNN's primitive)
    return statistics.median(_timed(fn) for _ in range(runs))


# --------------------------------------------------------------------------- attention

def written_cache(shape: tuple, kv_dtype) -> torch.Tensor:
    """A KV cache [N, S, Hkv, D] with every page written. kv_quant.allocate's cache is calloc's zero pages: until
    written they all map one physical page, so a kernel reading a never-written context reads it from L1 (a
    135M model's decode attention at 32 rows timed 2.3x faster than over a written cache here), while the
    engine's steps read what their prefills wrote."""
    t = kv_quant.allocate(*shape, kv_dtype, torch.device("cpu"))
    t.view(torch.uint8).fill_(FILL_BYTE)
    return t


def _meta(seqs: list, blocks_per_seq: int, first_block: int = 0) -> AttentionMetadata:
    """The metadata of a step over seqs [(new, context before)], decodes first, each sequence's blocks
    contiguous from first_block."""
    qlens = [n for n, _ in seqs]
    ctx = [n + c for n, c in seqs]
    tables = torch.tensor([[first_block + j * blocks_per_seq + b for b in range(blocks_per_seq)]
                           for j in range(len(seqs))], dtype=torch.int32)
    slots = torch.cat([torch.arange(c, c + n) + (first_block + j * blocks_per_seq) * BLOCK
                       for j, (n, c) in enumerate(seqs)])
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             context_lens=torch.tensor(ctx, dtype=torch.int32),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32), query_lens_cpu=qlens,
                             context_lens_cpu=ctx, max_query_len=max(qlens), max_context_len=max(ctx),
                             num_decode_seqs=sum(1 for n in qlens if n == 1))


def _attention_seconds(backend, cfg, caches: list, seqs: list, dtype) -> float:
    """Seconds of one layer's backend.forward over seqs, the layers cycling over `caches`."""
    tokens = sum(n for n, _ in seqs)
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, cfg.num_attention_heads, cfg.head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, cfg.num_key_value_heads, cfg.head_dim, generator=gen).to(dtype)
    v = torch.randn_like(k)
    bps = -(-max(n + c for n, c in seqs) // BLOCK)
    scale = cfg.head_dim ** -0.5

    def one_pass():
        meta = _meta(seqs, bps)  # per pass, as per step: the backend's per-step scratch is rebuilt once
        for kc, vc in caches:
            backend.forward(q, k, v, kc, vc, meta, scale)

    with torch.inference_mode():
        return _median_of(one_pass) / len(caches)


def measure_attention(backend, cfg, dtype, kv_dtype) -> dict:
    """The paged (decode rows), short (bfloat16's short chunks on the paged kernel, float32's on SDPA) and long
    fits (kernel_table.AttentionFit as dicts), the routing limits and the grid."""
    bf16 = dtype == torch.bfloat16 and kv_dtype == torch.bfloat16
    f32 = dtype == torch.float32 and kv_dtype == torch.float32
    long_min = TILED_PREFILL_MIN_TOKENS if bf16 else TILED_F32_MIN_TOKENS if f32 else 2
    paged_pts = [(b, [(1, c)] * b) for b, c in PAGED_GRID]
    short_pts = [(n, [(n, c)]) for n, c in (SHORT_GRID if bf16 else SHORT_F32_GRID if f32 else ())]
    long_pts = [(n, [(n, c)]) for n, c in LONG_GRID]
    most = max(sum(n + c for n, c in s) for _, s in paged_pts + short_pts + long_pts)
    blocks = -(-most // BLOCK) + 64
    shape = (blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    per_copy = 2 * kv_quant.allocate(*shape, kv_dtype, torch.device("cpu")).nbytes
    copies = max(1, min(cfg.num_hidden_layers, KV_COPIES_BYTES // per_copy))
    caches = [(written_cache(shape, kv_dtype), written_cache(shape, kv_dtype)) for _ in range(copies)]
    tiny = _attention_seconds(backend, cfg, caches[:1], [(1, 15)], dtype)

    def timed(points, context: bool = False):  # [rows, keys, (context before, where asked,) seconds]
        out = []
        for _, seqs in points:
            t = _attention_seconds(backend, cfg, caches, seqs, dtype)
            rows = sum(n for n, _ in seqs)
            keys = sum(attended_keys(n, c) for n, c in seqs)
            out.append([rows, keys, *([sum(c for _, c in seqs)] if context else []), max(t - tiny, 0.2 * t)])
        return out

    paged, short, long = timed(paged_pts), timed(short_pts, context=f32), timed(long_pts)
    short_fit = vars(fit_linear_model(short, per_context=f32)) if short else None
    return {"paged": vars(fit_linear_model(paged)), "long": vars(fit_linear_model(long)),
            "short": short_fit if short_fit and any(short_fit.values()) else None,  # none: priced as decode rows
            "short_per_sequence": f32,  # float32's short chunks: an SDPA call each
            "long_min_tokens": long_min, "paged_max_context": PAGED_PREFILL_MAX_CONTEXT if bf16 else 0,
            "grid": {"paged": paged, "short": short, "long": long}}


# --------------------------------------------------------------------------- small ops

def _misc_seconds(model, cfg, backend, tokens: int, dtype, kv_dtype, width: int = 0) -> float:
    """One layer's small ops at `tokens` tokens: two add+RMSNorms, rotary, SiLU*up, the KV store.
    width > 0: the widths that small and one head each (the tiny call whose dispatch is subtracted)."""
    d, i = (width, width) if width else (cfg.hidden_size, cfg.intermediate_size)
    hq, hkv = (1, 1) if width else (cfg.num_attention_heads, cfg.num_key_value_heads)
    hd = cfg.head_dim
    gen = torch.Generator().manual_seed(tokens)
    x, res = (torch.randn(tokens, d, generator=gen).to(dtype) for _ in range(2))
    w = torch.ones(d, dtype=dtype)
    q = torch.randn(tokens, hq, hd, generator=gen).to(dtype)
    k = torch.randn(tokens, hkv, hd, generator=gen).to(dtype)
    gate_up = torch.randn(tokens, 2 * i, generator=gen).to(dtype)
    pos = torch.arange(tokens) % model.rotary.cos.shape[0]
    cos_sin = model.rotary.table(pos)
    shape = (-(-tokens // BLOCK) + 1, BLOCK, hkv, hd)
    kc, vc = (kv_quant.allocate(*shape, kv_dtype, torch.device("cpu")) for _ in range(2))
    meta = _meta([(tokens, 0)], shape[0])
    rotary = type(model.rotary).apply

    def layer():
        fused_ops.add_rms_norm(x, res, w, 1e-5)
        rotary(cos_sin, q, k)
        backend.store_kv(k, k, kc, vc, meta)
        fused_ops.add_rms_norm(x, res, w, 1e-5)
        fused_ops.silu_mul(gate_up)

    with torch.inference_mode():
        for _ in range(3):
            layer()
        return statistics.median(_timed(layer) for _ in range(20))


def measure_misc(model, cfg, backend, dtype, kv_dtype) -> list:
    tiny = _misc_seconds(model, cfg, backend, 1, dtype, kv_dtype, width=32)
    out = []
    for t in MISC_TOKENS:
        s = _misc_seconds(model, cfg, backend, t, dtype, kv_dtype)
        out.append([t, max(s - tiny, 0.2 * s)])
    return out


# --------------------------------------------------------------------------- the layer forward

def _layer_seconds(model, cfg, backend, tokens: int, dtype, kv_dtype) -> float:
    """Seconds per layer of the model's own layer forward over one prefill of `tokens` tokens (nothing
    cached before), layers in order, as many as PASS_BUDGET_S takes (all of them at a few tokens)."""
    layers = list(model.model.layers)
    gen = torch.Generator().manual_seed(tokens)
    h = (torch.randn(tokens, cfg.hidden_size, generator=gen) * 0.5).to(dtype)
    cos_sin = model.rotary.table(torch.arange(tokens) % model.rotary.cos.shape[0])
    blocks = -(-tokens // BLOCK) + 1
    shape = (blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)

    def run(subset, caches):
        x, meta = h, _meta([(tokens, 0)], blocks)  # once per pass, as the engine builds it once per step
        for layer, kv in zip(subset, caches):
            x, _ = layer(cos_sin, x, h, kv, meta, backend)

    def caches_for(n):
        return [(kv_quant.allocate(*shape, kv_dtype, torch.device("cpu")),
                 kv_quant.allocate(*shape, kv_dtype, torch.device("cpu"))) for _ in range(n)]

    with torch.inference_mode():
        one = caches_for(1)
        run(layers[:1], one)  # warm-up
        per_layer = _timed(lambda: run(layers[:1], one))
        n = max(1, min(len(layers), math.ceil(PASS_BUDGET_S / max(per_layer, 1e-9))))
        caches = caches_for(n)
        return statistics.median(_timed(lambda: run(layers[:n], caches)) for _ in range(LARGE_RUNS)) / n


def measure_prefill_factor(model, cfg, backend, partial: dict, dtype, kv_dtype) -> list:
    """[[tokens, f]]: a prefill's layer forward over what the table's parts add up to (kernel_table.py)."""
    parts = KernelTable.from_dict({**partial, "key": "partial", "prefill_factor": [[1, 1.0]]})
    out = []
    L = cfg.num_hidden_layers
    sparse = cfg.moe.num_sparse(L) if cfg.moe else 0
    for t in LAYER_TOKENS:
        layer = _layer_seconds(model, cfg, backend, t, dtype, kv_dtype)
        lin = (parts.linear_seconds("qkv_proj", t) + parts.linear_seconds("o_proj", t)
               + (L - sparse) / L * (parts.linear_seconds("gate_up_proj", t) + parts.linear_seconds("down_proj", t))
               + sparse / L * parts.moe_seconds(t))  # per layer, as measured_op_seconds prices a step
        attention = sum(count * parts.attention_seconds([(t, 0)], lambda s, w=w: attended_keys(s[0], s[1], w))
                        for w, count in layer_windows(cfg).items())  # as the cost model prices it
        rest = attention / cfg.num_hidden_layers + parts.misc_seconds(t)
        out.append([t, max((layer - rest) / lin, 0.5) if lin > 0 else 1.0])
    return out
