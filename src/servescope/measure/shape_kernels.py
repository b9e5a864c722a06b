"""The engine's kernels timed at one loaded model's own shapes (analysis/kernel_table.py says what the
table holds and how the cost model reads it); measure/kernel_cache.py assembles the table (with a MoE's
sparse blocks: measure/moe_kernels.py, and the C++ decode plan's layers together: measure/decode_plan.py)
and caches it once per CPU, model shape and dtypes.

All on the engine's own objects, so the table follows the kernels whatever they become:
- the projections (CpuLinear, QuantLinear, ... whatever the engine's transforms put there; a sparse layer's
  MLP is its block, timed whole by moe_kernels.py) at ROWS rows in
  layer order, so the weights come from where a step finds them: all layers at a few rows (a decode
  step streams them), enough for PASS_BUDGET_S at many (compute-bound); per-call times share out the
  calls' back-to-back time. The head at HEAD_ROWS, each call after a one-row pass over every layer;
- the sampler's pick of greedy tokens from the head's float32 logits over the vocabulary at HEAD_ROWS rows
  (measure_sampling: a tiny model's vocabulary makes it nothing in the probe's host overhead);
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

from servescope.analysis.busy import CpuMeter
from servescope.analysis.kernel_table import KernelTable, fit_linear_model
from servescope.analysis.op_counts import attended_keys, layer_windows
from servescope.config import SamplingParams
from servescope.kernels import fused_ops
from servescope.model.attention import kv_quant
from servescope.model.attention.backend import AttentionMetadata
from servescope.model.attention.cpu import PAGED_PREFILL_MAX_CONTEXT, TILED_F32_MIN_TOKENS, TILED_PREFILL_MIN_TOKENS
from servescope.model.moe import SparseMoeBlock
from servescope.sampling.sampler import Sampler, SamplingState

logger = logging.getLogger(__name__)

# oneDNN's GEMM steps up at some row counts (a 2048-wide bfloat16 one here: +30% from 64 to 65 rows, +45%
# from 257 to 320): points on both sides of the steps seen, since a mixed step may have any count
ROWS = (1, 2, 3, 4, 6, 8, 9, 12, 16, 24, 32, 48, 64, 65, 80, 96, 128, 129, 160, 192, 256, 257, 320, 384, 448,
        512, 768, 1024, 2048)  # the last three: a whole prompt in one step (chunked prefill off)
HEAD_ROWS = (1, 2, 4, 8, 9, 16, 32, 64)
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
TINY_VOCAB = 512  # the probe's host-overhead model's vocabulary (measure/overhead.py): its sampler's call


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_of(fn, runs: int = RUNS) -> float:
    fn()  # warm-up: the kernel's first call at this shape (allocations, oneDNN's primitive)
    return statistics.median(_timed(fn) for _ in range(runs))


# --------------------------------------------------------------------------- linear layers

def _layer_projections(layer) -> list:
    attn = [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj)]
    if isinstance(layer.mlp, SparseMoeBlock):  # its block is timed whole (measure_moe_table)
        return attn
    return attn + [("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]


def _inputs(cfg, rows: int, dtype) -> dict:
    gen = torch.Generator().manual_seed(rows)
    d, q, i = cfg.hidden_size, cfg.q_size, cfg.intermediate_size
    x = {w: (torch.randn(rows, w, generator=gen) * 0.5).to(dtype) for w in {d, q, i}}
    return {"qkv_proj": x[d], "o_proj": x[q], "gate_up_proj": x[d], "down_proj": x[i], "lm_head": x[d]}


def _pass(layers, xs: dict) -> list:
    """[(projection, seconds)] of one call per layer, each timed on its own, in layer order."""
    out = []
    for layer in layers:
        for name, mod in _layer_projections(layer):
            x = xs[name]
            out.append((name, _timed(lambda: mod(x))))
    return out


def _back_to_back(layers, xs: dict) -> float:
    """Seconds of one call per layer and projection, in layer order, with no timer between the calls."""
    calls = [(mod, xs[name]) for layer in layers for name, mod in _layer_projections(layer)]
    t0 = time.perf_counter()
    for mod, x in calls:
        mod(x)
    return time.perf_counter() - t0


def _per_call(runs: list) -> dict:
    """{projection: [seconds of each of its calls]}: each call's median over the runs (a time slice lost to
    another process on a shared machine hits one run of a call, not the median)."""
    out: dict = {}
    for j, (name, _) in enumerate(runs[0]):
        out.setdefault(name, []).append(statistics.median(r[j][1] for r in runs))
    return out


def call_overhead(dtype) -> float:
    """Seconds of one linear module's call on a 16 x 16 weight at one row: the dispatch a tiny call costs."""
    # lazy: CpuLinear packs panels with the extension, which measure_linear_tables has loaded by now
    from servescope.model.linears.cpu import CpuLinear

    lin = CpuLinear(torch.nn.Linear(16, 16, bias=False).to(dtype).requires_grad_(False))
    x = torch.randn(1, 16).to(dtype)
    for _ in range(20):
        lin(x)
    return statistics.median(_timed(lambda: lin(x)) for _ in range(200))


def measure_linear_tables(model, cfg, dtype) -> tuple:
    """({projection: [[rows, seconds per call], ...]} of the model's own linear modules, the CPUs its
    threads got while they ran: the share of the machine the measurement had)."""
    layers = list(model.model.layers)
    meter = CpuMeter()
    overhead = call_overhead(dtype)
    table = {n: [] for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    with torch.inference_mode():
        for rows in ROWS:
            xs = _inputs(cfg, rows, dtype)
            _pass(layers[:2], xs)  # warm-up: first calls at this row count
            if rows <= ALL_LAYER_ROWS:
                subset = layers
            else:
                per_layer = sum(t for _, t in _pass(layers[:1], xs))
                subset = layers[:max(2, min(len(layers), math.ceil(PASS_BUDGET_S / max(per_layer, 1e-9))))]
            runs = RUNS if rows <= ALL_LAYER_ROWS else min(RUNS, LARGE_RUNS)
            calls = _per_call([_pass(subset, xs) for _ in range(runs)])
            # the calls back to back, as a step makes them, took longer than each timed on its own
            # (about 10% at a 1B shape's one-row GEMVs here): the pass's time, shared out by the calls'
            whole = statistics.median(_back_to_back(subset, xs) for _ in range(runs))
            scale = whole / sum(sum(c) for c in calls.values())
            for name, times in calls.items():  # per call of that projection (a sparse layer has no MLP rows)
                t = sum(times) / len(times) * scale
                table[name].append([rows, max(t - overhead, 0.2 * t)])
        cpus = meter.window().cpus_got
        table["lm_head"] = _head_table(model, layers, cfg, dtype, overhead)
    for name, pts in table.items():
        if not pts:  # no layer has this projection (every MLP sparse): nothing of it runs
            table[name] = [[1, 0.0]]
    return table, cpus


def _head_table(model, layers, cfg, dtype, overhead: float) -> list:
    """The head at HEAD_ROWS, each call right after a one-row pass over every layer (untimed)."""
    head, one = model.lm_head, _inputs(cfg, 1, dtype)
    out = []
    for rows in HEAD_ROWS:
        x = _inputs(cfg, rows, dtype)["lm_head"]
        head(x)
        times = []
        for _ in range(RUNS):
            _pass(layers, one)
            times.append(_timed(lambda: head(x)))
        t = statistics.median(times)
        out.append([rows, max(t - overhead, 0.2 * t)])
    return out


# --------------------------------------------------------------------------- sampling

def _sample_seconds(vocab: int, rows: int) -> float:
    """Seconds of the engine's Sampler picking `rows` greedy tokens from float32 logits [rows, vocab]."""
    sampler = Sampler(vocab)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
    states = [SamplingState.new(SamplingParams(temperature=0.0), [1], "cpu") for _ in range(rows)]
    with torch.inference_mode():
        return _median_of(lambda: sampler(logits, states), 4 * RUNS)


def measure_sampling(cfg) -> list:
    """[[rows, seconds]] at HEAD_ROWS of the sampler over the model's vocabulary (greedy rows: the argmax every
    row pays; a sampled row's softmax and draw are not in it), less its call at one row of the probe's tiny
    vocabulary, which the host overhead per step already holds. At a 49152-token vocabulary, 32 rows took
    longer than the 135M model's attention."""
    tiny = _sample_seconds(TINY_VOCAB, 1)
    out = []
    for rows in HEAD_ROWS:
        t = _sample_seconds(cfg.vocab_size, rows)
        out.append([rows, max(t - tiny, 0.2 * t)])
    return out


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
