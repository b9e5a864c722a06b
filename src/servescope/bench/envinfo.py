"""Where and with what a benchmark ran: CPU model, cores, torch threads, library versions, date.

Every result JSON carries this block, so a figure in docs/BENCHMARKS.md can always be traced to
its machine and software.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform

import torch

from servescope.analysis.cpu_isa import local_isa
from servescope.analysis.probe import cpu_model


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_flags(wanted=("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16",
                     "amx_int8")) -> list:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def environment_info() -> dict:
    """Machine, versions and date (UTC, ISO 8601)."""
    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "machine": {
            "cpu": cpu_model(),
            "cpu_flags": cpu_flags(),
            "cpu_kernel_isa": local_isa(),  # the kernel path asked for (SERVESCOPE_CPU_ISA or the best one)
            "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            "servescope": _version("servescope"),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "llama_cpp_python": _version("llama_cpp_python"),
        },
    }
    if torch.cuda.is_available():
        info["machine"]["gpu"] = torch.cuda.get_device_name(0)
    return info
