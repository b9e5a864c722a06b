"""Up to how many rows the GEMV serves a bfloat16 weight, measured on this CPU at the weight's own shape.

The GEMV (csrc/kernels.h: `gemv_rows_bf16_dot` for bfloat16 rows of x where the CPU has AVX512-BF16, `gemv_rows`
otherwise) streams the weight once for any number of rows of x, but its arithmetic grows with the rows, while
oneDNN's blocked GEMM on the prepacked weight stays near its own read time for a few rows. Where they cross depends
on the CPU and on the shape: on the Zen 4 VM (AVX-512 BF16, no AMX) the GEMV is at least 5% ahead up to 12-16 rows
of SmolLM2-135M's K = 576 projections, 5 of its gate_up, 3 of its head, and 2-4 rows of Llama-3.2-1B's matrices; on
the Xeon oneDNN runs AMX tiles and wins from 3 rows on (benchmarks/gemv_rows.py). One constant (linear.MAX_ROWS) can
only be right for one of them, so each distinct bfloat16 (N, K) is timed once per machine: both kernels at 2, 3, ...
8, 10, ... 16 rows over enough copies of the weight to miss the caches (a layer's weights are evicted by the other
layers' between two uses), alternating, medians; the limit is the last row count before the GEMV is less than 5%
faster. Cached ($XDG_CACHE_HOME/servescope/gemv_limits.json) under the CPU, its ISA, the thread count and a digest
of the kernels' sources; a timing taken while the rest of the machine was busy (analysis/busy.py) serves this
process only.

Inside `cached_only()` (a parallel engine's ranks: each would time its shards while the others time theirs, see them
as load and time again at every start) a limit not cached is not timed: linear.MAX_ROWS serves.

SERVESCOPE_GEMV_ROWS=fixed keeps linear.MAX_ROWS (the tests do, so that a kernel choice never depends on a
timing); any other value, or none, measures.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Optional

import torch

from servescope.analysis.busy import CpuMeter
from servescope.analysis.cache_dir import cache_dir
from servescope.analysis.probe import cache_key
from servescope.kernels.cpu import linear as cpu_linear
from servescope.kernels.cpu.extension import headers_digest

logger = logging.getLogger(__name__)

CACHE_NAME = "gemv_limits.json"
ENV = "SERVESCOPE_GEMV_ROWS"
# the row counts tried, in order, until oneDNN is faster at one (the GEMV serves any count; with bfloat16 dot products
# it was level with oneDNN at 12-16 rows of SmolLM2-135M's matrices on the Zen 4 VM)
TRIED_ROWS = (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
MOST_ROWS = TRIED_ROWS[-1]
PASS_BYTES = 48 << 20  # one timed pass reads at least this much weight: past a 32 MiB last-level cache
MAX_COPIES = 128
SAMPLES = 5
# the GEMV takes a row count where it is at least this much faster than oneDNN: near level, the step goes as oneDNN's
# (whose output is already in the activation dtype; at 12-16 rows of SmolLM2-135M the measured limits at level
# ran decode at batch 16 4-11% slower than oneDNN in two rounds)
MARGIN = 0.95
_LIMITS: dict = {}  # this process's: shape key -> rows
_TIMING = [True]  # False inside cached_only()


def shape_key(w: torch.Tensor) -> str:
    return f"{w.shape[0]}x{w.shape[1]}|{str(w.dtype).replace('torch.', '')}"


def machine_key() -> str:
    """The probe's key of this CPU and thread count, the kernels' sources, the rule's margin."""
    csrc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
    return f"{cache_key(torch.get_num_threads())}|csrc={headers_digest(csrc, ('*.h', '*.cpp'))}|margin={MARGIN}"


def measured(env=os.environ) -> bool:
    return env.get(ENV, "measure") != "fixed"


def limit_from_times(times: dict) -> int:
    """{rows: (GEMV seconds, oneDNN seconds)} -> the most rows r such that the GEMV took at most MARGIN of oneDNN's
    time at every row count tried from 2 to r (1: at 1 row the GEMV always serves; counts between two tried ones
    go as the lower)."""
    limit = 1
    for rows in sorted(times):
        gemv, onednn = times[rows]
        if gemv > MARGIN * onednn:
            break
        limit = rows
    return limit


def time_rows(w: torch.Tensor, rows: int, copies: list, samples: int = SAMPLES) -> tuple:
    """(GEMV seconds, oneDNN seconds) of one pass over `copies` [(weight, packed)] at `rows` rows: medians of
    `samples` passes of each, alternating."""
    x = torch.randn(rows, w.shape[1]).to(w.dtype)
    runs: dict = {"gemv": [], "onednn": []}
    kernels = {"gemv": lambda c: cpu_linear.gemv(x, c[0]), "onednn": lambda c: cpu_linear.onednn_linear(x, c[1])}
    for name, run in kernels.items():  # one untimed pass each: page faults, oneDNN's primitive cache
        run(copies[0])
    for _ in range(samples):
        for name, run in kernels.items():
            t0 = time.perf_counter()
            for c in copies:
                run(c)
            runs[name].append(time.perf_counter() - t0)
    return statistics.median(runs["gemv"]), statistics.median(runs["onednn"])


def measure_limit(w: torch.Tensor, most: int = MOST_ROWS) -> tuple:
    """(the limit for w's shape, {rows: (GEMV s, oneDNN s)} as timed, whether the machine was busy)."""
    n = max(1, min(MAX_COPIES, -(-PASS_BYTES // (w.numel() * w.element_size()))))
    copies = []
    for _ in range(n):
        c = torch.randn(w.shape).to(w.dtype) * 0.02
        copies.append((c, cpu_linear.pack_for_onednn(c)))
    meter, times = CpuMeter(), {}
    for rows in (r for r in TRIED_ROWS if r <= most):
        times[rows] = time_rows(w, rows, copies)
        if times[rows][0] > MARGIN * times[rows][1]:
            break
    busy = meter.window().busy(min(torch.get_num_threads(), os.cpu_count() or 1))
    return limit_from_times(times), times, busy


@contextmanager
def cached_only():
    """Within it, gemv_rows reads a limit from this process or the cache and times none (the default serves)."""
    before, _TIMING[0] = _TIMING[0], False
    try:
        yield
    finally:
        _TIMING[0] = before


def _read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    os.replace(tmp, path)  # whole or not at all


def gemv_rows(w: torch.Tensor, packed, measure: Optional[Callable] = None) -> int:
    """The most rows the GEMV serves `w` with (`packed`: its oneDNN copy, None where there is none): the measured
    limit for a bfloat16 weight beside a oneDNN copy (read from this process, then the cache, else measured and
    cached), linear.MAX_ROWS otherwise. measure: measure_limit's stand-in (tests)."""
    default = cpu_linear.MAX_ROWS.get(w.dtype, 0)
    if (w.dtype != torch.bfloat16 or packed is None or w.dim() != 2 or cpu_linear.load() is None
            or not measured()):
        return default
    key = shape_key(w)
    if key in _LIMITS:
        return _LIMITS[key]
    path, machine = cache_dir() / CACHE_NAME, machine_key()
    cached = _read(path).get(machine, {}).get(key)
    if cached is not None:
        _LIMITS[key] = int(cached["rows"])
        return _LIMITS[key]
    if not _TIMING[0]:
        return default
    t0 = time.perf_counter()
    rows, times, busy = (measure or measure_limit)(w)
    _LIMITS[key] = rows
    logger.info("GEMV row limit for a %s weight: %d rows (measured in %.2f s%s)", key, rows,
                time.perf_counter() - t0, "; the machine was busy: not cached" if busy else "")
    if not busy:
        cache = _read(path)  # again: another process may have written since
        cache.setdefault(machine, {})[key] = {"rows": rows, "seconds": {str(r): list(t) for r, t in times.items()}}
        _write(path, cache)
    return rows


def limits_in_use() -> dict:
    """This process's measured limits, {shape key: rows} (the kernel table's cache key holds them)."""
    return dict(sorted(_LIMITS.items()))
