"""A decode step's layers timed as the engine runs them, against the kernel table's parts (the table's
`decode_factor`: analysis/kernel_table.py).

The table times each projection, attention and the small ops one kernel at a time on the model's modules.
A decode-only step runs them differently: through the C++ decode plan where the executor has one (one call
for every layer, the kernels back to back, each projection on the kernel the plan picks for its rows), or
through the modules where not. At two threads the 135M model's plan took 15% more than its kernels timed
one by one at 32 rows (docs/VALIDATION.md, "With the per-sequence host cost"), a cost the parts do not
hold. So the probe also runs the executor's own layer path for a decode step of B sequences (B in
DECODE_ROWS, DECODE_CONTEXT tokens cached each, every layer on caches of its own with every page written)
and keeps f(B): that time per layer over what the parts add up to for the same step, as it does for a
prefill's layer forward (prefill_factor).
"""

from __future__ import annotations

import torch

from servescope.analysis.kernel_table import KernelTable
from servescope.measure.shape_kernels import BLOCK, _median_of, _meta, layer_factor, written_cache

DECODE_ROWS = (1, 4, 8, 16, 32, 64)
DECODE_CONTEXT = 128


def _decode_layers_seconds(executor, cfg, backend, rows: int, dtype, kv_dtype) -> float:
    """Seconds per layer of one decode step's layers over `rows` sequences, on the path the executor takes."""
    heads, k_dim, v_dim = cfg.kv_cache_geometry
    bps = -(-(DECODE_CONTEXT + 1) // BLOCK)
    caches = [(written_cache((rows * bps, BLOCK, heads, k_dim), kv_dtype),
               written_cache((rows * bps, BLOCK, heads, v_dim), kv_dtype)) for _ in range(cfg.num_hidden_layers)]
    meta = _meta([(1, DECODE_CONTEXT)] * rows, bps)
    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, cfg.hidden_size, generator=gen) * 0.5).to(dtype)
    positions = torch.full((rows,), DECODE_CONTEXT, dtype=torch.long)
    with torch.inference_mode():
        path = executor.layers_for(rows, meta, caches, backend)

        def step():
            path.run_layers(h, None, positions, caches, meta, backend)

        step()  # warm-up (the plan's scratch, the kernels' first touch)
        return _median_of(step) / cfg.num_hidden_layers


def measure_decode_factor(executor, cfg, backend, partial: dict, dtype, kv_dtype, max_rows: int) -> list:
    """[[rows, f]] for the rows of DECODE_ROWS up to max_rows (the engine's max_num_seqs)."""
    parts = KernelTable.from_dict({**partial, "key": "partial"})
    rows = [b for b in DECODE_ROWS if b <= max_rows] or [1]
    return [[b, layer_factor(parts, cfg, [(1, DECODE_CONTEXT)] * b,
                             _decode_layers_seconds(executor, cfg, backend, b, dtype, kv_dtype))] for b in rows]
