"""The CPU per-layer op extension (csrc/cpu_ops.cpp), compiled on first use and cached.

One C++ call each for rms_norm, add_rms_norm, rotary, silu_mul (dispatched from fused_ops.py) and
store_kv, paged decode attention (from attention/torch_ref.py): at batch 1 their eager PyTorch
versions are dozens of tiny ops per layer whose dispatch overhead exceeds their arithmetic.
`load()` is None where the extension cannot be built (no compiler, no AVX-512,
SERVESCOPE_CPU_KERNELS=0, read once at the first call); callers then use the torch references,
which the tests compare against.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16)
_lock = threading.Lock()
_mod = None
_tried = False
_EMPTY = torch.empty(0)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split())


def load():
    """The compiled module, or None. Compiling takes a minute once; the result is cached by torch."""
    global _mod, _tried
    if _tried:
        return _mod
    with _lock:
        if _tried:
            return _mod
        flags = _cpu_flags()
        if os.environ.get("SERVESCOPE_CPU_KERNELS", "1") == "0" or not {
                "avx512f", "avx512bw", "avx512vl", "fma"} <= flags:
            _tried = True
            return None
        try:
            from torch.utils.cpp_extension import load as load_ext

            src = os.path.join(os.path.dirname(__file__), "csrc", "cpu_ops.cpp")
            cflags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp", "-ffp-contract=off"]
            if "avx512_bf16" in flags:
                cflags.append("-mavx512bf16")
            t0 = time.perf_counter()
            _mod = load_ext(name="servescope_cpu_ops", sources=[src], verbose=False, extra_cflags=cflags)
            logger.info("CPU op kernels ready (%.1f s)", time.perf_counter() - t0)
        except Exception as e:  # no compiler, headers, ninja...: the torch references still work
            logger.warning("CPU op kernels unavailable, using eager PyTorch: %s", str(e).splitlines()[0][:200])
            _mod = None
        _tried = True
        return _mod


def available() -> bool:
    return load() is not None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _mod.rms_norm(x, w, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> tuple:
    y, h = _mod.add_rms_norm(x, residual, w, eps)
    return y, h


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    qo, ko = _mod.rotary(q, k, cos, sin)
    return qo, ko


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _mod.silu_mul(gate_up)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    _mod.store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, out=None) -> torch.Tensor:
    """q [B, H, D]; caches [N, S, Hkv, D]; block_tables [>=B, M] int32; context_lens [>=B] int32 -> [B, H, D]."""
    return _mod.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, _EMPTY if out is None else out)
