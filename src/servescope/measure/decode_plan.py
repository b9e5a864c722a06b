"""The loaded engine's C++ decode plan timed over whole decode steps' layers, beside what the kernel table prices
those layers at: the table's `decode_plan`, whence the cost model's decode factor (analysis/kernel_table.py).

The table times each kernel on its own (measure/shape_kernels.py). A decode-only step runs them back to back in one
C++ call (model/transforms.DecodePlanLayers), and at two threads and a few dozen rows the layers ran slower together
than their kernels one at a time (the threads' wake-ups and joins in each parallel region, cache traffic between
kernels: whatever it is, the plan's own time holds it). Here the plan runs its layers as a decode step does: the
engine's own plan on random hidden states at DECODE_ROWS sequences of DECODE_CONTEXT cached tokens each, over caches
whose every page is written (shape_kernels.written_cache), cycling over as many copies as KV_COPIES_BYTES allows so
that each layer reads its KV from memory, as a step's layers do. Beside each time: the table's sum of the same
layers' kernels at those rows and keys, as the cost model adds them up.
"""

from __future__ import annotations

import statistics

import torch

from servescope.analysis.cost_model import measured_op_seconds
from servescope.analysis.kernel_table import KernelTable
from servescope.measure.shape_kernels import (BLOCK, KV_COPIES_BYTES, LARGE_RUNS, PASS_BUDGET_S, RUNS, _meta, _timed,
                                              written_cache)
from servescope.model.attention import kv_quant

DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode-only steps' sequences
DECODE_CONTEXT = 256  # cached tokens of each sequence (a serving step's decodes: a few hundred)
LAYER_OPS = ("qkv_proj", "attention", "attn_out_proj", "mlp", "norms_rope_misc")  # the op groups the plan runs


def layers_seconds(cfg, table: KernelTable, rows: int, context: int) -> float:
    """What the table prices the layers of a decode-only step of `rows` sequences at `context` tokens each at (the
    cost model's own sum: cost_model.measured_op_seconds; the head and the sampler are not the plan's)."""
    ops = measured_op_seconds(cfg, [(1, context)] * rows, table, rows, rows)
    return sum(ops.get(name, 0.0) for name in LAYER_OPS)


def _caches(cfg, rows: int, blocks_per_seq: int, kv_dtype) -> list:
    """A (K, V) pair per layer for `rows` sequences of blocks_per_seq blocks: written copies, the layers cycling
    over them."""
    heads, k_dim, v_dim = cfg.kv_cache_geometry
    blocks = rows * blocks_per_seq
    shapes = ((blocks, BLOCK, heads, k_dim), (blocks, BLOCK, heads, v_dim))
    per_copy = sum(kv_quant.allocate(*s, kv_dtype, torch.device("cpu")).nbytes for s in shapes)
    copies = max(1, min(cfg.num_hidden_layers, KV_COPIES_BYTES // max(per_copy, 1)))
    pairs = [tuple(written_cache(s, kv_dtype) for s in shapes) for _ in range(copies)]
    return [pairs[i % copies] for i in range(cfg.num_hidden_layers)]


def plan_seconds(plan, cfg, backend, rows: int, context: int, caches: list, dtype) -> float:
    """Seconds of the plan's run_layers over a decode-only step of `rows` sequences at `context` cached tokens, or
    None where the plan does not serve such a step (the model's forward runs it)."""
    seqs = [(1, context)] * rows
    meta = _meta(seqs, -(-(context + 1) // BLOCK))
    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, cfg.hidden_size, generator=gen) * 0.5).to(dtype)
    positions = torch.full((rows,), context, dtype=torch.long)

    def step():
        plan.run_layers(h, None, positions, caches, meta, backend)

    with torch.inference_mode():  # (serves asks for it, as the engine's steps run)
        if not plan.serves(meta, rows, caches, backend):
            return None
        one = _timed(step)  # warm-up, and the size of a pass
        runs = RUNS if one < PASS_BUDGET_S else LARGE_RUNS
        return statistics.median(_timed(step) for _ in range(runs))


def measure_decode_plan(plan, cfg, backend, partial: dict, dtype, kv_dtype) -> tuple:
    """([[rows, seconds of the plan's layers, the table's seconds of their kernels]] at the DECODE_ROWS the plan
    serves, the most rows it serves): ([], 0) without a plan (every decode step runs the model's forward, which the
    table's kernels price as they are)."""
    if plan is None:
        return [], 0
    parts = KernelTable.from_dict({**partial, "key": "partial"})
    blocks_per_seq = -(-(DECODE_CONTEXT + 1) // BLOCK)
    caches = _caches(cfg, max(DECODE_ROWS), blocks_per_seq, kv_dtype)  # the smaller steps use its first blocks
    out = []
    for rows in DECODE_ROWS:
        t = plan_seconds(plan, cfg, backend, rows, DECODE_CONTEXT, caches, dtype)
        if t is None:
            break
        out.append([rows, t, layers_seconds(cfg, parts, rows, DECODE_CONTEXT)])
    return (out, plan.max_rows) if out else ([], 0)
