"""Build-on-first-use C++ extensions for the CPU (csrc/*.cpp), one per instruction set, with an
eager fallback.

The kernels are written once against csrc/simd.h's vector layer; this compiles them for the path the
CPU runs best (analysis/cpu_isa.py: AVX-512, AVX2 + FMA, NEON or plain C++; SERVESCOPE_CPU_ISA forces
one) as its own extension (`<name>_<isa>`), compiled once (under a minute), cached by torch afterwards.
SERVESCOPE_CPU_KERNELS=0 turns them off; anything that stops the build (no compiler, headers or
ninja) leaves `load()` returning None and callers on PyTorch. Forcing a path the CPU lacks raises
(InvalidParameterError) instead of building code that would die of an illegal instruction.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import logging
import os
import threading
import time

from torch.utils import cpp_extension

from servescope.analysis.cpu_isa import cpu_flags, local_isa

logger = logging.getLogger(__name__)

BASE_CFLAGS = ["-O3", "-fopenmp", "-DSERVESCOPE_TORCH"]
ISA_CFLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "neon": [],  # Advanced SIMD is part of every aarch64 target
    "scalar": [],
}
# optional instructions compiled in where the CPU has them: flag -> (the paths it belongs to, cflag)
OPTIONAL_CFLAGS = {
    "avx512_bf16": (("avx512",), "-mavx512bf16"),
    "avx512_vnni": (("avx512",), "-mavx512vnni"),
    "avx_vnni": (("avx2",), "-mavxvnni"),
    "amx_tile": (("avx512",), "-mamx-tile"),  # AMX-INT8 tiles for packed weights (csrc/quant_amx.h)
    "amx_int8": (("avx512",), "-mamx-int8"),
    "amx_bf16": (("avx512",), "-mamx-bf16"),  # AMX-BF16 tiles for packed weights (csrc/quant_amx_bf16.h)
}
_ARM_EXTENSIONS = {"asimddp": "dotprod", "bf16": "bf16"}  # /proc/cpuinfo Features -> -march extension


def isa_cflags(isa: str, flags) -> list:
    """The compiler flags of the `isa` build on a CPU with `flags` (and -DSERVESCOPE_ISA_<ISA>)."""
    out = [f"-DSERVESCOPE_ISA_{isa.upper()}"] + ISA_CFLAGS[isa]
    out += [cflag for flag, (isas, cflag) in OPTIONAL_CFLAGS.items() if isa in isas and flag in flags]
    if isa == "neon":
        out.append("-march=" + "+".join(["armv8.2-a"] + [ext for f, ext in _ARM_EXTENSIONS.items() if f in flags]))
    return out


def headers_digest(csrc_dir: str, patterns: tuple = ("*.h",)) -> str:
    """A digest of csrc/*.h: torch's build cache hashes the sources it is given, not the headers they
    include, so the digest goes into the flags and an edited header rebuilds the extension. patterns: other
    files of csrc/ as well (gemv_limits.py keys its timings on the .cpp files too)."""
    h = hashlib.sha1()
    for path in sorted(p for pattern in patterns for p in glob.glob(os.path.join(csrc_dir, pattern))):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def checkout_tag(source: str) -> str:
    """A short digest of where the sources lie. torch's build directory is named after the extension alone,
    and its build file names the sources by their paths: two checkouts (two clones, worktrees, or a clone
    and an installed copy) loading in turn would each find the other's build file and compile again, every
    time. A build directory per checkout keeps each one's build."""
    return hashlib.sha1(os.path.dirname(os.path.abspath(source)).encode()).hexdigest()[:8]


@contextlib.contextmanager
def build_lock(build_dir: str):
    """Hold the build of the extension in `build_dir` against every other process building it.

    torch's own lock is a file (`lock`) that its builder deletes when done, and that any later build
    waits on forever when its builder was killed mid-build (a server stopped while it compiled): an
    install or a test run then hangs. An flock is released by the OS when its holder dies, so whoever
    holds it knows a `lock` file left there has no builder and removes it before torch looks."""
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "servescope-build.flock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a build that did not finish", stale)
            os.remove(stale)
        yield


class CpuExtension:
    def __init__(self, name: str, sources, what: str, extra_cflags=()):
        """sources: a file name under csrc/, or several compiled into the one extension."""
        self.name, self.what = name, what
        names = [sources] if isinstance(sources, str) else list(sources)
        self.sources = [os.path.join(os.path.dirname(__file__), "csrc", s) for s in names]
        self.extra_cflags = list(extra_cflags)
        self._lock = threading.Lock()
        self.mod = None  # the compiled module once load() succeeded
        self.isa = None  # the path it was built for ("eager" when there is none)
        self._tried = False

    def load(self):
        """The compiled module, or None. Raises InvalidParameterError when SERVESCOPE_CPU_ISA names a
        path this CPU cannot run (or no path at all)."""
        if self._tried:
            return self.mod
        with self._lock:
            if self._tried:
                return self.mod
            self.isa = "eager"
            if os.environ.get("SERVESCOPE_CPU_KERNELS", "1") != "0":
                isa = local_isa()  # raises on a bad SERVESCOPE_CPU_ISA, before anything is marked tried
                self._build(isa)
            self._tried = True
            return self.mod

    def _build(self, isa: str) -> None:
        try:
            digest = headers_digest(os.path.dirname(self.sources[0]))
            cflags = BASE_CFLAGS + isa_cflags(isa, cpu_flags()) + self.extra_cflags + [f"-DSERVESCOPE_HEADERS={digest}"]
            t0 = time.perf_counter()
            name = f"{self.name}_{isa}"
            build_dir = cpp_extension._get_build_directory(f"{name}-{checkout_tag(self.sources[0])}", verbose=False)
            with build_lock(build_dir):
                self.mod = cpp_extension.load(name=name, sources=self.sources, verbose=False,
                                              extra_cflags=cflags, build_directory=build_dir)
            self.isa = isa
            logger.info("%s ready for %s (%.1f s)", self.what, isa, time.perf_counter() - t0)
        except Exception as e:  # no compiler, headers, ninja...: the eager path still works
            logger.warning("%s unavailable, using eager PyTorch: %s", self.what, str(e).splitlines()[0][:200])
            self.mod = None

    def load_in_background(self) -> None:
        """Start load() in a thread (the build runs in ninja's processes, beside whatever this process
        does next: an engine loads its weights meanwhile); the next load() waits for it. Not a daemon:
        an interpreter exiting mid-build would leave torch's build lock behind. Errors are left for
        that next load() to raise."""
        if self._tried or os.environ.get("SERVESCOPE_CPU_KERNELS", "1") == "0":
            return

        def run():
            try:
                self.load()
            except Exception:  # a bad SERVESCOPE_CPU_ISA: the caller's own load() raises it
                pass

        threading.Thread(target=run, name=f"build-{self.name}").start()

    def available(self) -> bool:
        return self.load() is not None

    def describe(self) -> str:
        """The path in use, for summaries: "avx2 C++ kernels", "eager PyTorch" (after load())."""
        self.load()
        if self.mod is None:
            return "eager PyTorch"
        info = dict(self.mod.isa())
        extras = [name for key, name in (("bf16_dot", "bf16 dot"), ("int8_dot", "int8 dot")) if info.get(key) == "1"]
        return f"{info['isa']} C++ kernels" + (f" ({', '.join(extras)})" if extras else "")
