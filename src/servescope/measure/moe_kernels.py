"""A MoE's sparse MLP blocks timed at the loaded model's own shapes, for its KernelTable (analysis/kernel_table.py's
`moe` and `moe_distinct`; measure/shape_kernels.py measures the rest of the table and calls this)."""

from __future__ import annotations

import math
import statistics

import torch

from servescope.measure.shape_kernels import ALL_LAYER_ROWS, LARGE_RUNS, PASS_BUDGET_S, RUNS, _timed
from servescope.model.moe import moe_blocks

MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # a sparse block's rows


def measure_moe_table(model, cfg, dtype, plan=None) -> tuple:
    """([[tokens, seconds per sparse layer]], [[tokens, distinct experts per layer]]) of the model's own sparse
    MLP blocks on MOE_TOKENS rows of random activations, in layer order (all of them up to ALL_LAYER_ROWS rows,
    as many as PASS_BUDGET_S takes beyond); ([], []) for a model without experts. plan: the executor's C++
    decode plan (model/transforms.DecodePlanLayers) or None; up to its rows the sparse MLPs are timed as it runs
    them (decode steps: `plan.sparse`, without the modules' host work), above them the blocks' forward (their
    experts' fused op where it serves those rows, model/moe_fused.py, else grouped_experts), so packed, float
    and int8 experts are timed on the kernels their steps run."""
    found = moe_blocks(model)
    blocks = [b for _, b in found]
    planned = [plan.sparse[i].run for i, _ in found] if plan is not None and plan.sparse else None
    times, distinct = [], []
    with torch.inference_mode():
        for rows in MOE_TOKENS if blocks else ():
            x = (torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows)) * 0.5).to(dtype)
            calls = planned if planned and rows <= plan.max_rows else blocks
            one = _timed(lambda: calls[0](x))  # warm-up, and the size of a pass
            subset = calls if rows <= ALL_LAYER_ROWS else calls[:max(2, math.ceil(PASS_BUDGET_S / max(one, 1e-9)))]
            for b in blocks:
                b.take_routing()

            def run(subset=subset, x=x):
                for b in subset:
                    b(x)
            runs = RUNS if rows <= ALL_LAYER_ROWS else LARGE_RUNS
            times.append([rows, statistics.median(_timed(run) for _ in range(runs)) / len(subset)])
            # the same rows every run: each block's routing is the same, its counts `runs` times over
            distinct.append([rows, statistics.mean(int((b.take_routing() > 0).sum()) for b in blocks[:len(subset)])])
    return times, distinct
