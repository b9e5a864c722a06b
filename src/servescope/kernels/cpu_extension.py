"""Build-on-first-use C++ extensions for the CPU (csrc/*.cpp), with an eager fallback.

An extension is compiled once by torch.utils.cpp_extension (about 30 s here; cached by torch
afterwards) when the CPU has AVX-512 and SERVESCOPE_CPU_KERNELS is not "0"; anything that stops
the build (no compiler, headers or ninja) leaves `load()` returning None and callers on PyTorch.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from torch.utils.cpp_extension import load as load_ext

logger = logging.getLogger(__name__)

BASE_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"]
_REQUIRED = {"avx512f", "avx512bw", "avx512vl", "fma"}


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split())


class CpuExtension:
    def __init__(self, name: str, sources, what: str, extra_cflags=()):
        """sources: a file name under csrc/, or several compiled into the one extension."""
        self.name, self.what = name, what
        names = [sources] if isinstance(sources, str) else list(sources)
        self.sources = [os.path.join(os.path.dirname(__file__), "csrc", s) for s in names]
        self.extra_cflags = list(extra_cflags)
        self._lock = threading.Lock()
        self.mod = None  # the compiled module once load() succeeded
        self._tried = False

    def load(self):
        """The compiled module, or None."""
        if self._tried:
            return self.mod
        with self._lock:
            if self._tried:
                return self.mod
            flags = cpu_flags()
            if os.environ.get("SERVESCOPE_CPU_KERNELS", "1") != "0" and _REQUIRED <= flags:
                try:
                    cflags = BASE_CFLAGS + self.extra_cflags
                    if "avx512_bf16" in flags:
                        cflags.append("-mavx512bf16")
                    t0 = time.perf_counter()
                    self.mod = load_ext(name=self.name, sources=self.sources, verbose=False, extra_cflags=cflags)
                    logger.info("%s ready (%.1f s)", self.what, time.perf_counter() - t0)
                except Exception as e:  # no compiler, headers, ninja...: the eager path still works
                    logger.warning("%s unavailable, using eager PyTorch: %s", self.what,
                                   str(e).splitlines()[0][:200])
                    self.mod = None
            self._tried = True
            return self.mod

    def available(self) -> bool:
        return self.load() is not None
