"""Which instruction set the CPU kernels run with: read from the CPU's flags, or forced by
SERVESCOPE_CPU_ISA (avx512 | avx2 | neon | scalar). Pure Python: the probe keys its cache on it and
kernels/cpu/extension.py compiles the extension for it.

The paths, best first on each architecture (kernels/cpu/csrc/simd.h is the vector layer they share):
- avx512: AVX-512 F/BW/VL + FMA (x86); with AVX512-BF16 the bfloat16 dot products (VDPBF16PS)
- avx2:   AVX2 + FMA (x86: Haswell and Zen onwards, most desktops, laptops and cloud VMs)
- neon:   ARMv8 Advanced SIMD (every aarch64 CPU); with dotprod / bf16 where the CPU has them
- scalar: plain C++ (anything else), still one C++ call per op instead of dozens of eager ones

Forcing a path the CPU lacks is an error that says what the CPU has (it would crash with SIGILL
otherwise); an unknown name is an error too.
"""

from __future__ import annotations

import os
import platform
from typing import Iterable, Optional

from servescope.errors import InvalidParameterError

ISAS = ("avx512", "avx2", "neon", "scalar")
ENV = "SERVESCOPE_CPU_ISA"
_X86 = ("x86_64", "amd64", "i686", "i386")
_ARM = ("aarch64", "arm64")
# the CPU flags (x86 /proc/cpuinfo "flags", ARM "Features") each path needs
REQUIRED = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "fma"}),
    "avx2": frozenset({"avx2", "fma"}),
    "neon": frozenset({"asimd"}),
    "scalar": frozenset(),
}
# flags that change what a path computes with (compiled in where present) or how fast bfloat16 is
SPEED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
               "asimd", "asimddp", "bf16", "sve")


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


def machine_arch() -> str:
    return platform.machine().lower()


def cpu_flags() -> frozenset:
    """The CPU's feature flags (x86 "flags" or ARM "Features" of /proc/cpuinfo); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isas(flags: Iterable[str], arch: str) -> list:
    """The paths this CPU can run, best first (scalar always)."""
    flags = frozenset(flags)
    family = ("avx512", "avx2") if arch in _X86 else ("neon",) if arch in _ARM else ()
    return [isa for isa in family if REQUIRED[isa] <= flags] + ["scalar"]


def select_isa(flags: Iterable[str], arch: str, forced: Optional[str] = None) -> str:
    """The path to use: `forced` (a name from ISAS) if the CPU has it, else the best one it has."""
    flags = frozenset(flags)
    supported = supported_isas(flags, arch)
    if not forced:
        return supported[0]
    forced = forced.strip().lower()
    if forced not in ISAS:
        raise InvalidParameterError(ENV, f"{ENV}={forced!r} is not a CPU kernel path; choose one of {', '.join(ISAS)}")
    if forced not in supported:
        missing = sorted(REQUIRED[forced] - flags) or [f"a {forced} CPU (this one is {arch})"]
        raise InvalidParameterError(
            ENV, f"{ENV}={forced}: this CPU ({arch}) lacks {', '.join(missing)}; it can run {', '.join(supported)}")
    return forced


def local_isa() -> str:
    """This machine's path, SERVESCOPE_CPU_ISA honoured (InvalidParameterError if it cannot run it)."""
    return select_isa(cpu_flags(), machine_arch(), os.environ.get(ENV) or None)


def has_fast_bf16(flags: Iterable[str]) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX512-BF16, AMX-BF16, ARM BF16): without it a
    bfloat16 matmul is emulated, hundreds of times slower than float32 (0.3 GFLOP/s on a Zen 3)."""
    return bool(frozenset(flags) & {"avx512_bf16", "amx_bf16", "bf16"})


# oneDNN's ISA levels (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA), lowest first: torch multiplies bfloat16
# through oneDNN on the CPU, which uses bf16 dot products only from AVX512_CORE_BF16 on (AVX2_VNNI_2 only
# converts). A cap below that makes bfloat16 matmuls as slow as on a CPU without them, whatever the flags.
_ONEDNN_LEVELS = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni",
                  "avx512_core_bf16", "avx10_1_512", "avx512_core_fp16", "avx10_1_512_amx", "avx512_core_amx",
                  "avx10_1_512_amx_fp16", "avx512_core_amx_fp16", "avx10_2_512", "avx10_2_512_amx_2", "all",
                  "default")


def onednn_allows_bf16(env: Optional[dict] = None) -> bool:
    """False where ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) caps oneDNN below AVX512_CORE_BF16; an unset
    or unknown value caps nothing."""
    env = os.environ if env is None else env
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().lower()
    if cap not in _ONEDNN_LEVELS:
        return True
    return _ONEDNN_LEVELS.index(cap) >= _ONEDNN_LEVELS.index("avx512_core_bf16")


# the environment variables that cap the instruction sets torch's own kernels use: they change what a
# probe measures (a probe cache entry names them), not what the CPU has
LIBRARY_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def library_caps(env: Optional[dict] = None) -> str:
    """The caps set in `env` (default os.environ) as "NAME=value,...", or "" where none is."""
    env = os.environ if env is None else env
    return ",".join(f"{n}={env[n].strip().lower()}" for n in LIBRARY_CAPS if env.get(n, "").strip())


def local_fast_bf16() -> bool:
    """Whether bfloat16 matmuls are fast here: the CPU has bf16 dot products and oneDNN may use them."""
    return has_fast_bf16(cpu_flags()) and onednn_allows_bf16()


def isa_signature(flags: Iterable[str], isa: str) -> str:
    """A short string for cache keys: the kernel path and the speed-relevant flags the CPU has."""
    present = [f for f in SPEED_FLAGS if f in frozenset(flags)]
    return f"isa={isa}|flags={'+'.join(present) or 'none'}"
