"""A loaded engine's KernelTable (analysis/kernel_table.py): measured by measure/shape_kernels.py (the projections,
attention, small ops, the layer forward, the sampler), measure/moe_kernels.py (a MoE's sparse blocks) and
measure/decode_plan.py (the C++ decode plan's layers together), cached once per CPU, thread count, kernels'
sources and the model's shape and dtypes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from servescope.analysis.bandwidth import default_spot_check
from servescope.analysis.kernel_table import table_key
from servescope.analysis.busy import CpuMeter, Window
from servescope.analysis.probe import cache_key, default_cache_path, torch_threads
from servescope.measure.decode_plan import measure_decode_plan
from servescope.measure.moe_kernels import measure_moe_table
from servescope.measure.linear_kernels import measure_linear_tables, measure_sampling
from servescope.measure.shape_kernels import measure_attention, measure_misc, measure_prefill_factor

logger = logging.getLogger(__name__)

CACHE_NAME = "kernel_tables.json"
_SOURCES = ("kernels/cpu/csrc", "kernels/cpu/linear.py", "model/linears", "model/attention/cpu.py", "model/moe.py",
            "model/transforms.py")


def kernels_digest() -> str:
    """A digest of the kernels' sources: a table measured on other kernels is measured again."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha1()
    for rel in _SOURCES:
        p = root / rel
        for f in sorted(p.rglob("*") if p.is_dir() else [p]):
            if f.is_file() and f.suffix in (".h", ".cpp", ".py"):
                h.update(f.name.encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:12]


def measure_kernel_table(engine) -> dict:
    """The KernelTable (as a dict) of a loaded CPU engine's model at its shapes and dtypes, with the read
    bandwidth spot-checked before and after timing it (their mean prices the table's times: see
    analysis/kernel_table.py; none where the spot check is switched off)."""
    pred = engine.step_cost_predictor.predictor
    wdt, kdt, adt, _ = pred.dtypes
    cfg, model, backend = engine.model_config, engine.model, engine.runner.backend
    spot = default_spot_check()
    bandwidth = [spot()] if spot is not None else []
    t0, meter = time.perf_counter(), CpuMeter()
    linear, cpus = measure_linear_tables(model, cfg, engine.dtype)
    moe, moe_distinct = measure_moe_table(model, cfg, engine.dtype, engine.executor.decode_plan)
    attention = measure_attention(backend, cfg, engine.dtype, engine.kv_dtype)
    misc = measure_misc(model, cfg, backend, engine.dtype, engine.kv_dtype)
    parts = {"linear": linear, "misc": misc, "moe": moe, "moe_distinct": moe_distinct, **attention}
    factor = measure_prefill_factor(model, cfg, backend, parts, engine.dtype, engine.kv_dtype)
    decode, decode_rows = measure_decode_plan(engine.executor.decode_plan, cfg, backend, parts, engine.dtype,
                                              engine.kv_dtype)
    sample = measure_sampling(cfg)
    took = time.perf_counter() - t0
    bandwidth += [spot()] if spot is not None else []
    logger.info("kernel table for %s measured in %.0f s", table_key(cfg, wdt, adt, kdt), took)
    threads = min(torch.get_num_threads(), os.cpu_count() or 1)
    # the share its threads got is the linear tables' (the rest holds single-threaded parts); the others' CPUs
    # are the whole measurement's
    seen = Window(took, cpus, meter.window().others)
    busy = seen.busy(threads)
    if busy:
        logger.warning("the machine was busy while the kernel table was measured (%s): the table serves this "
                       "run only and is not cached", seen.describe(threads))
    return {"key": table_key(cfg, wdt, adt, kdt), "linear": linear, "misc": misc, **attention,
            "prefill_factor": factor, "decode_plan": decode, "decode_rows": decode_rows, "sample": sample,
            "moe": moe, "moe_distinct": moe_distinct, "busy": busy, "cpus": cpus, "others_cpus": seen.others,
            "bandwidth": sum(bandwidth) / len(bandwidth) if bandwidth else 0.0,
            "source": f"measured on the loaded model's modules and attention backend in {took:.0f} s "
                      f"(measure/kernel_cache.py, kernels {kernels_digest()})"}


def cache_path() -> Path:
    return default_cache_path().with_name(CACHE_NAME)


def _machine_key() -> str:
    return f"{cache_key(torch_threads())}|kernels={kernels_digest()}"


def gemv_limits_key(model) -> str:
    """The GEMV row limits the model's linear modules run with (kernels/cpu/gemv_limits.py: measured per machine
    and shape): a table timed with other limits timed other kernels at those rows."""
    limits = sorted({(tuple(m.weight.shape), str(m.weight.dtype), m.gemv_rows) for m in model.modules()
                     if isinstance(getattr(m, "gemv_rows", None), int)})
    return hashlib.sha1(repr(limits).encode()).hexdigest()[:10]


def kernel_table_for(engine, force: bool = False) -> dict:
    """The engine's KernelTable dict, read from the cache (this CPU, thread count, kernels' sources and
    the model's shape and dtypes) or measured now and cached."""
    pred = engine.step_cost_predictor.predictor
    wdt, kdt, adt, _ = pred.dtypes
    key = f"{_machine_key()}|{table_key(pred.cfg, wdt, adt, kdt)}|gemv={gemv_limits_key(engine.model)}"
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if not force and key in cache:
        return cache[key]
    table = measure_kernel_table(engine)
    if table.get("busy"):
        return table
    cache[key] = table
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cache))
    tmp.replace(path)
    return table
