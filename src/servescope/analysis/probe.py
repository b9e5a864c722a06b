"""Measure the local CPU once: memory read bandwidth and matmul FLOP/s, cached on disk.

The probe uses torch (imported lazily, so `servescope.analysis` stays torch-free) with the thread
count torch is set to, because that is what the engine will run with. Each figure is the median of
several runs after a warm-up. It takes a few seconds; the result is cached as JSON in
~/.cache/servescope/hardware.json, keyed by CPU model and thread count, and re-measured when
`force=True` or when the key changes.

What is measured and why:
- bandwidth: `x.sum()` over a float32 tensor much larger than the last-level cache (default 512 MiB):
  a pure streaming read, which is what decode does with the weights.
- float32 / bfloat16 / float16: `torch.mm` of n x n matrices (2 n^3 FLOPs), the fastest of the runs
  (the bandwidth is a median: its slow and fast phases on a shared VM last minutes). float16 may be emulated
  (slow) on CPUs without native support; that is measured too, with a smaller matrix.
- int8 has no CPU matmul path in the engine (int8 weights are dequantised to the activation dtype),
  so peak_flops["int8"] is set to the bfloat16 figure and said so in `notes`.
- step_overhead_s / layer_overhead_s: the engine's own host work per step and per decoder layer,
  measured on the engine with a model too small to cost anything else (engine/overhead.py). The
  cost model adds them to every step's prediction; they are measured, not fitted to the steps they
  predict.
- linear_rates: weight bytes/s of the engine's CPU linear kernel at 1..128 rows, float32 and
  bfloat16, on 1024 x 1024 matrices that belong to no model (model/kernel_probe.py);
  decode_attention_flops: FLOP/s of its paged decode-attention kernel (KV in cache).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from pathlib import Path
from typing import Optional

from servescope.analysis.hardware import HardwareSpec, LOCAL_CPU
from servescope.timing import median_seconds

logger = logging.getLogger(__name__)

CACHE_VERSION = 5  # 2: host overheads; 3: linear kernel rates; 4: decode attention; 5: best-of matmul


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "servescope" / "hardware.json"


def cpu_model() -> str:
    """The CPU's marketing name, from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def total_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30  # unknown platform: a modest guess, stated in notes by the caller


def measure_read_bandwidth(num_bytes: int = 512 * 2**20, runs: int = 5, buf=None, warmup: int = 1) -> float:
    """Bytes/s of a streaming float32 read (torch sum), median of `runs`. buf: a float32 tensor to read
    instead of a fresh one of num_bytes (for repeated samples without allocating between them)."""
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32) if buf is None else buf  # ones: every page touched
    t = median_seconds(lambda: x.sum(), runs, warmup)
    return x.numel() * 4 / t


def measure_matmul_flops(dtype_name: str, n: int = 2048, runs: int = 5) -> float:
    """FLOP/s of an n x n x n torch.mm in `dtype_name` (2 n^3 FLOPs per call), the fastest of `runs`:
    a peak is what the cores can do, and on a shared machine interference only ever slows a run
    (one probe here read 127 GFLOP/s float32 where the others read 160-169 with the median)."""
    import torch

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


def _cache_key(threads: int) -> str:
    return f"{cpu_model()}|threads={threads}|v{CACHE_VERSION}"


def probe_local_hardware(
    force: bool = False,
    cache_path: Optional[Path] = None,
    bandwidth_bytes: int = 512 * 2**20,
    matmul_size: int = 2048,
    runs: int = 5,
    host_overhead: bool = True,
) -> HardwareSpec:
    """A HardwareSpec named 'local-cpu' for this machine, measured once and cached.

    `bandwidth_bytes`, `matmul_size` and `runs` exist so tests can run a tiny probe; a cached
    result is reused whatever they are (pass force=True to re-measure). host_overhead=False skips
    the engine measurements (overheads 0, no linear_rates).
    """
    import torch

    threads = torch.get_num_threads()
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    key = _cache_key(threads)
    cache: dict = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            logger.warning("ignoring unreadable hardware cache %s", path)
            cache = {}
    if not force and key in cache:
        try:
            return HardwareSpec.from_dict(cache[key])
        except (TypeError, ValueError):
            logger.warning("ignoring a malformed entry in %s", path)

    t0 = time.perf_counter()
    bw = measure_read_bandwidth(bandwidth_bytes, runs)
    fp32 = measure_matmul_flops("float32", matmul_size, runs)
    bf16 = measure_matmul_flops("bfloat16", matmul_size, runs)
    # float16 may be emulated: time one small call first and only go bigger when it is fast.
    n16 = min(matmul_size, 512)
    fp16 = measure_matmul_flops("float16", n16, 1)
    if 2.0 * matmul_size**3 / fp16 < 0.5:
        fp16 = measure_matmul_flops("float16", matmul_size, runs)
    step_oh = layer_oh = 0.0
    rates: dict = {}
    attn: dict = {}
    if host_overhead:
        # each measurement stands alone: one that cannot run here leaves its field at 0 / empty and
        # the predictions fall back to the peaks for that part
        try:
            from servescope.engine.overhead import measure_host_overhead

            step_oh, layer_oh = measure_host_overhead()
        except Exception as e:
            logger.warning("host overhead not measured (%s)", e)
        try:
            from servescope.kernels.kernel_probe import measure_linear_rates

            rates = {dt: measure_linear_rates(dt) for dt in ("float32", "bfloat16")}
        except Exception as e:
            logger.warning("linear kernel rates not measured (%s)", e)
        try:
            from servescope.kernels.kernel_probe import measure_decode_attention_flops

            attn = {dt: measure_decode_attention_flops(dt) for dt in ("float32", "bfloat16")}
        except Exception as e:
            logger.warning("decode attention rate not measured (%s)", e)
    elapsed = time.perf_counter() - t0
    spec = HardwareSpec(
        name=LOCAL_CPU,
        kind="cpu",
        peak_flops={"float32": fp32, "bfloat16": bf16, "float16": fp16, "int8": bf16},
        memory_bandwidth=bw,
        memory_bytes=total_memory_bytes(),
        notes=(f"measured by probe_local_hardware on {cpu_model()} with {threads} torch threads in "
               f"{elapsed:.1f} s; int8 = bfloat16 figure (int8 weights are dequantised); "
               f"memory_bytes = physical RAM; host overhead {step_oh * 1e3:.2f} ms per step + "
               f"{layer_oh * 1e6:.0f} us per layer (engine/overhead.py)"),
        step_overhead_s=step_oh,
        layer_overhead_s=layer_oh,
        linear_rates=rates,
        decode_attention_flops=attn,
        source=(f"probe: torch.sum over {bandwidth_bytes / 2**20:.0f} MiB float32 (median of {runs}), "
                f"torch.mm {matmul_size}^3 (best of {runs}); torch {torch.__version__}"),
    )
    logger.info("probed %s: %.1f GB/s, fp32 %.0f GFLOP/s, bf16 %.0f GFLOP/s (%.1f s)",
                cpu_model(), bw / 1e9, fp32 / 1e9, bf16 / 1e9, elapsed)
    cache[key] = spec.to_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(cache, indent=2))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as e:
        logger.warning("could not write hardware cache %s: %s", path, e)
    return spec
