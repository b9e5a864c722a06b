"""Measure the local CPU once: memory read bandwidth and matmul FLOP/s, cached on disk.

The probe uses torch (imported lazily, so `servescope.analysis` stays torch-free) with the thread
count torch is set to, because that is what the engine will run with. Each figure is the median of
several runs after a warm-up. It takes well under 30 s on any CPU (each dtype's matmul is sized to its
speed, below); the result is cached as JSON in ~/.cache/servescope/hardware.json, keyed by CPU model,
kernel path and speed-relevant CPU flags (analysis/cpu_isa.py: a Zen 3 and a Zen 4 share a model
name), thread count (and by which engine measurements it holds), and re-measured when `force=True`
or when the key changes.

What is measured and why:
- bandwidth: `x.sum()` over a float32 tensor much larger than the last-level cache (default 512 MiB):
  a pure streaming read, which is what decode does with the weights. It moves with the other tenants
  of a shared VM, so a cached spec is always read with a spot check of it beside it (analysis/bandwidth.py:
  the same sum over the same 512 MiB, ~0.1 s), whose figure prices the memory-bound terms where the two disagree.
- float32 / bfloat16 / float16: `torch.mm` of n x n matrices (2 n^3 FLOPs), the fastest of the runs
  (the bandwidth is a median: its slow and fast phases on a shared VM last minutes). n is sized to the
  dtype's speed: one 256^3 call first, then the largest n <= matmul_size whose call takes at most
  a quarter of a second at that rate. A CPU without bfloat16 (float16) instructions emulates it
  hundreds of times slower than float32 (a large bfloat16 matmul takes a minute on an AVX2-only CPU):
  it is measured small and listed in `slow_dtypes` (below a quarter of float32), which the engine
  never picks by default.
- int8 has no CPU matmul path in the engine (int8 weights are dequantised to the activation dtype),
  so peak_flops["int8"] is set to the bfloat16 figure and said so in `notes`.

What the engine measures, handed in as `EngineMeasurers` (analysis/ never imports the engine;
measure/local_hardware.py passes the engine's own):
- step_overhead_s / layer_overhead_s / seq_overhead_s: the engine's own host work per step, per
  decoder layer and per sequence in the step, measured on the engine with a model too small to cost
  anything else (measure/overhead.py). The cost model adds them to every step's prediction (the
  engine's StepRecords and the simulator's clock alike); they are measured, not fitted to the steps
  they predict.
- linear_rates: weight bytes/s of the engine's CPU linear kernel at 1..128 rows, float32 and
  bfloat16, on 1024 x 1024 matrices that belong to no model (measure/kernel_rates.py);
  decode_attention_flops: FLOP/s of its paged decode-attention kernel (KV in cache);
  packed_gemm_flops: FLOP/s of its integer GEMM over group-32 packed weights with float32 activations
  (the prefill of int4 / int8-g32 / a GGUF's Q4_0, Q4_1, Q8_0), which beats the float32 peak with VNNI.

Invariant of the cache: the entry under the full key (`cache_key(threads)`) was measured with all
engine measurers; a probe given fewer is stored under a key that names what it holds, so it
never stands in for the full one (whose predictions include the host overhead and kernel rates).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from servescope.analysis.busy import CpuMeter
from servescope.analysis.cache_dir import cache_dir
from servescope.analysis.bandwidth import (PROBE_BYTES, checked_spec, default_spot_check, measure_read_bandwidth,
                                           quiet_read, record_sample)
from servescope.analysis.cpu_isa import cpu_flags, cpu_model, isa_signature, library_caps, local_isa
from servescope.analysis.spec import LOCAL_CPU, HardwareSpec

logger = logging.getLogger(__name__)

CACHE_VERSION = 9  # 2: host overheads; 3: linear kernel rates; 4: decode attention; 5: best-of matmul;
# 6: the kernel path and CPU flags in the key, matmuls sized to each dtype's speed, slow_dtypes;
# 7: the packed integer GEMM's rate; 8: float32's linear rates with the panel GEMM; 9: decode attention
# reads each tile in cache order (its rate moved). The host overhead per sequence took no new version: an entry
# written before it lacks the field and is measured again (_cached_spec), so that the kernel tables, keyed by
# this version too (measure/kernel_cache.py), stay valid.
CALL_BUDGET_S = 0.25  # the longest one timed matmul call may take (sizes the matmul of each dtype)
SLOW_FRACTION = 0.25  # a dtype below this fraction of float32's matmul rate has no fast path here
SLOW_ROWS = (1, 2)  # the rows a slow dtype's linear kernel is measured at
KERNEL_DTYPES = ("float32", "bfloat16")  # the activation dtypes the engine's CPU kernels are measured in
# A probe taken on a busy machine (analysis/busy.py) serves the run that measured it but is never cached, or every
# later prediction would inherit it (one such entry predicted 7x the measured decode step).
# A cached probe is of this machine only if its memory is this close to the machine's (the count moves a
# little with ballooning; a VM resized under the same CPU key moves it by GiBs)
SAME_MEMORY = 0.02


@dataclass(frozen=True)
class EngineMeasurers:
    """The measurements only the engine can make, as callables (None: not measured).

    host_overhead() -> (seconds per step, seconds per decoder layer, seconds per sequence in the step);
    linear_rates(dtype name[, rows]) -> [[rows M, weight bytes/s], ...], M ascending;
    decode_attention_flops(dtype name) -> FLOP/s of the paged decode-attention kernel;
    packed_gemm_flops() -> FLOP/s of the integer GEMM over group-32 packed weights, float32 activations.
    """

    host_overhead: Optional[Callable[[], tuple]] = None
    linear_rates: Optional[Callable[[str], list]] = None
    decode_attention_flops: Optional[Callable[[str], float]] = None
    packed_gemm_flops: Optional[Callable[[], float]] = None

    @property
    def given(self) -> tuple:
        """Names of the measurers handed in, in field order."""
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)

    @property
    def complete(self) -> bool:
        return self.given == ENGINE_MEASUREMENTS


ENGINE_MEASUREMENTS = tuple(f.name for f in dataclasses.fields(EngineMeasurers))


def default_cache_path() -> Path:
    return cache_dir() / "hardware.json"


def total_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30  # unknown platform: a modest guess, stated in notes by the caller


def measure_matmul_flops(dtype_name: str, n: int = 2048, runs: int = 5) -> float:
    """FLOP/s of an n x n x n torch.mm in `dtype_name` (2 n^3 FLOPs per call), the fastest of `runs`:
    a peak is what the cores can do, and on a shared machine interference only ever slows a run
    (one probe here read 127 GFLOP/s float32 where the others read 160-169 with the median)."""
    import torch  # lazy: importing servescope.analysis must not import torch (2.5 s here)

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def sized_matmul_flops(dtype_name: str, max_n: int = 2048, runs: int = 5,
                       call_budget_s: float = CALL_BUDGET_S) -> tuple:
    """(FLOP/s, n): the matmul measured at the largest power-of-two n <= max_n whose one call takes
    about call_budget_s or less at the rate of a first 256^3 call (fewer runs when even that is slow)."""
    n = min(256, max_n)
    rate = measure_matmul_flops(dtype_name, n, 1)
    while n * 2 <= max_n and 2.0 * (2 * n) ** 3 / rate <= call_budget_s:
        n *= 2
    if 2.0 * n**3 / rate > call_budget_s:  # slow even at 256: what was measured stands, one more run
        return max(rate, measure_matmul_flops(dtype_name, n, 1)), n
    return measure_matmul_flops(dtype_name, n, runs), n


def torch_threads() -> int:
    """The thread count torch runs with: part of the cache key (the engine runs with it too)."""
    import torch  # lazy: importing servescope.analysis must not import torch (2.5 s here)

    return torch.get_num_threads()


def cache_key(threads: int, measured: Optional[tuple] = None) -> str:
    """The cache entry's key. measured: the names of the engine measurers the entry holds, None for
    all of them (the full probe); any other set, the empty one included, is named in the key."""
    key = f"{cpu_model()}|{isa_signature(cpu_flags(), local_isa())}|threads={threads}|v{CACHE_VERSION}"
    caps = library_caps()  # torch's kernels capped below the CPU (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, ...)
    if caps:
        key += f"|caps={caps}"
    if measured is None or tuple(measured) == ENGINE_MEASUREMENTS:
        return key
    return f"{key}|engine={'+'.join(measured) or 'none'}"


def _read_cache(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        logger.warning("ignoring unreadable hardware cache %s", path)
        return {}


def _cached_spec(cache: dict, key: str, path: Path) -> Optional[HardwareSpec]:
    """The spec stored under `key`, or None: none stored, one the probe stored before it measured the host
    overhead per sequence (its per-step overhead without the per-sequence one: it would predict without it),
    or one measured on a machine with another amount of memory (a VM resized under the same CPU key)."""
    entry = cache.get(key)
    if entry is None or ("step_overhead_s" in entry and "seq_overhead_s" not in entry):
        return None
    here = total_memory_bytes()
    if abs((entry.get("memory_bytes") or 0) / here - 1.0) > SAME_MEMORY:
        logger.warning("the cached probe in %s was measured on a machine with %.1f GiB of memory, this one has "
                       "%.1f GiB: not used", path, (entry.get("memory_bytes") or 0) / 2**30, here / 2**30)
        return None
    try:
        return HardwareSpec.from_dict(entry)
    except (TypeError, ValueError):
        logger.warning("ignoring a malformed entry in %s", path)
        return None


def _spec_in_use(cache: dict, key: str, path: Path, spot_check: Optional[Callable] = None) -> Optional[HardwareSpec]:
    """The one way a cached probe is used: the entry under `key` with a spot check of the bandwidth beside it
    (analysis/bandwidth.checked_spec), or None where none is cached. spot_check: () -> bytes/s (None: the
    default, which SERVESCOPE_BANDWIDTH_SPOT_CHECK=0 switches off; one returning None takes no figure)."""
    cached = _cached_spec(cache, key, path)
    if cached is None:
        return None
    check = spot_check if spot_check is not None else default_spot_check()
    spec = checked_spec(cached, check() if check is not None else None)
    if spec.memory_bandwidth != cached.memory_bandwidth:
        logger.info("the read bandwidth moved since the probe: %.1f GB/s now against %.1f cached; the memory-bound "
                    "terms follow the spot check", spec.memory_bandwidth / 1e9, cached.memory_bandwidth / 1e9)
    return spec


def _write_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(cache, indent=2))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as e:
        logger.warning("could not write hardware cache %s: %s", path, e)


def cached_local_hardware(cache_path: Optional[Path] = None,
                          spot_check: Optional[Callable] = None) -> Optional[HardwareSpec]:
    """The full probe's cached spec for this CPU and thread count with its bandwidth spot-checked
    (_spec_in_use), or None when there is none (this never probes: measuring needs the engine's
    measurers, see measure/local_hardware.py)."""
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    return _spec_in_use(_read_cache(path), cache_key(torch_threads()), path, spot_check)


def _measure_peaks(bandwidth_bytes: int, matmul_size: int, runs: int) -> tuple:
    """(read bandwidth, {dtype: matmul FLOP/s}, {dtype: n measured at}, slow dtypes) of this machine."""
    meter = CpuMeter(own=process_cpu_seconds)
    bw = measure_read_bandwidth(bandwidth_bytes, runs)
    if bandwidth_bytes == PROBE_BYTES:  # the spot checks' measurement: one more sample of their history
        record_sample(bw, quiet_read(meter.window()))
    peaks, sizes = {}, {}
    for dt in ("float32", "bfloat16", "float16"):
        peaks[dt], sizes[dt] = sized_matmul_flops(dt, matmul_size, runs)
    slow = [dt for dt in ("bfloat16", "float16") if peaks[dt] < SLOW_FRACTION * peaks["float32"]]
    peaks["int8"] = peaks["bfloat16"]
    return bw, peaks, sizes, slow


def _measure_engine(m: EngineMeasurers, slow: list) -> dict:
    """The HardwareSpec fields the engine's measurers fill. Each measurement stands alone: one that
    cannot run here leaves its field at 0 / empty and the predictions fall back to the peaks for
    that part. A slow dtype's linear kernel is measured at the GEMV's rows only (SLOW_ROWS: the C++
    GEMV widens bfloat16 to float32 and runs at the bandwidth anyway; more rows go to a GEMM that
    has no fast path here and would take minutes), beyond which the (slow) peak prices it."""
    out = {"step_overhead_s": 0.0, "layer_overhead_s": 0.0, "seq_overhead_s": 0.0, "linear_rates": {},
           "decode_attention_flops": {}, "packed_gemm_flops": 0.0}
    if m.host_overhead is not None:
        try:
            out["step_overhead_s"], out["layer_overhead_s"], out["seq_overhead_s"] = m.host_overhead()
        except Exception as e:
            logger.warning("host overhead not measured (%s)", e)
    if m.linear_rates is not None:
        try:
            out["linear_rates"] = {dt: m.linear_rates(dt, SLOW_ROWS) if dt in slow else m.linear_rates(dt)
                                   for dt in KERNEL_DTYPES}
        except Exception as e:
            logger.warning("linear kernel rates not measured (%s)", e)
    if m.decode_attention_flops is not None:
        try:
            out["decode_attention_flops"] = {dt: m.decode_attention_flops(dt) for dt in KERNEL_DTYPES}
        except Exception as e:
            logger.warning("decode attention rate not measured (%s)", e)
    if m.packed_gemm_flops is not None:
        try:
            out["packed_gemm_flops"] = float(m.packed_gemm_flops())
        except Exception as e:
            logger.warning("packed integer GEMM rate not measured (%s)", e)
    return out


def probe_local_hardware(
    force: bool = False,
    cache_path: Optional[Path] = None,
    bandwidth_bytes: int = PROBE_BYTES,
    matmul_size: int = 2048,
    runs: int = 5,
    measurers: Optional[EngineMeasurers] = None,
    kernel_path: str = "",
    packed_gemm_bfloat16: bool = False,
    spot_check: Optional[Callable] = None,
) -> HardwareSpec:
    """A HardwareSpec named 'local-cpu' for this machine, measured once and cached.

    `bandwidth_bytes`, `matmul_size` and `runs` exist so tests can run a tiny probe; a cached
    result is reused whatever they are (pass force=True to re-measure). measurers: the engine's
    own measurements (measure/local_hardware.py passes them); without them the overheads are 0 and
    there are no kernel rates, and the result is cached under its own key (see the module doc).
    kernel_path: the engine's CPU kernel path ("avx2 C++ kernels"), recorded in the spec; packed_gemm_bfloat16:
    whether its kernels run bfloat16 rows of packed weights on the integer GEMM (model/linears/packed.py), likewise.
    A cached spec is used with its bandwidth spot-checked (_spec_in_use; spot_check as there).
    """
    import torch  # lazy: importing servescope.analysis must not import torch (2.5 s here)

    measurers = measurers or EngineMeasurers()
    threads = torch.get_num_threads()
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    key = cache_key(threads, measurers.given)
    cache = _read_cache(path)
    cached = None if force else _spec_in_use(cache, key, path, spot_check)
    if cached is not None:
        return cached

    t0, meter = time.perf_counter(), CpuMeter(own=process_cpu_seconds)
    bw, peaks, sizes, slow = _measure_peaks(bandwidth_bytes, matmul_size, runs)
    seen = meter.window()
    engine = _measure_engine(measurers, slow)
    elapsed = time.perf_counter() - t0
    busy = seen.busy(min(threads, len(os.sched_getaffinity(0))))
    step_oh, layer_oh, seq_oh = engine["step_overhead_s"], engine["layer_overhead_s"], engine["seq_overhead_s"]
    spec = HardwareSpec(
        name=LOCAL_CPU,
        kind="cpu",
        peak_flops=peaks,
        memory_bandwidth=bw,
        memory_bytes=total_memory_bytes(),
        notes=(f"measured by probe_local_hardware on {cpu_model()} with {threads} torch threads in "
               f"{elapsed:.1f} s; int8 = bfloat16 figure (int8 weights are dequantised); "
               f"memory_bytes = physical RAM; host overhead {step_oh * 1e3:.2f} ms per step + "
               f"{layer_oh * 1e6:.0f} us per layer + {seq_oh * 1e6:.0f} us per sequence (measure/overhead.py)"
               + (f"; no fast path for {', '.join(slow)} here (measured small, never the default)" if slow else "")
               + ("" if measurers.complete else f"; engine measurements: {', '.join(measurers.given) or 'none'}")
               + (f"; the machine was busy ({seen.describe(threads)}): not cached" if busy else "")),
        source=(f"probe: torch.sum over {bandwidth_bytes / 2**20:.0f} MiB float32 (median of {runs}), torch.mm "
                + ", ".join(f"{dt} {n}^3" for dt, n in sizes.items())
                + f" (best of {runs}); torch {torch.__version__}"),
        kernel_path=kernel_path or local_isa(),
        packed_gemm_bfloat16=packed_gemm_bfloat16,
        slow_dtypes=slow,
        **engine,
    )
    logger.info("probed %s (%s): %.1f GB/s, fp32 %.0f GFLOP/s, bf16 %.0f GFLOP/s (%.1f s)",
                cpu_model(), spec.kernel_path, bw / 1e9, peaks["float32"] / 1e9, peaks["bfloat16"] / 1e9, elapsed)
    if busy:
        logger.warning("the machine was busy during the hardware probe (%s): its figures serve this run only and "
                       "are not cached; `servescope hardware probe --force` on a quiet machine records lasting ones",
                       seen.describe(threads))
        return spec
    cache[key] = spec.to_dict()
    _write_cache(path, cache)
    return spec


def process_cpu_seconds() -> float:
    """CPU seconds this process has used, all threads (the probe compares it with the wall time)."""
    return time.process_time()
