"""The hardware spec an engine predicts its steps on, when the caller did not resolve one.

Resolving never measures the engine here: measure/ (above the engine) runs the full probe, which
times the engine's own host overhead and kernels, and callers above the engine (the CLI, server,
bench, labs) hand its spec in. Here: a named spec, a GPU's datasheet, or for the local CPU the full
probe's cached spec, else the probe of what any torch program measures (bandwidth, matmul peaks:
analysis/probe.py, cached under its own key), whose predictions leave out the host overhead.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from servescope.analysis.collectives import DEFAULT_LINK, LinkSpec, cached_local_link, get_link
from servescope.analysis.hardware import LOCAL_CPU, HardwareSpec, canonical_hardware_name, get_hardware
from servescope.analysis.probe import cached_local_hardware, cpu_model, probe_local_hardware
from servescope.errors import InvalidParameterError
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears.packed import panel_gemm_takes_rows

logger = logging.getLogger(__name__)

_GPU_KEYS = ("h200", "h100", "a100", "l40s", "l4", "4090", "mi300x")


def local_cpu_without_engine() -> HardwareSpec:
    """The full probe's cached spec of this CPU, else the plain probe's (measured once, then cached)."""
    spec = cached_local_hardware()
    if spec is not None:
        return spec
    logger.info("no full hardware probe cached for this CPU: predicting from bandwidth and matmul peaks "
                "only (`servescope hardware probe` also measures the engine's overheads and kernels)")
    return probe_local_hardware(**kernel_routes())


def kernel_routes() -> dict:
    """What the probe records of this build's kernels beside its measurements: their path, and whether bfloat16
    rows of packed weights run the integer panel GEMM (the cost model prices them at its rate then)."""
    return {"kernel_path": cpu_ops.kernel_path(), "packed_gemm_bfloat16": panel_gemm_takes_rows()}


def gpu_datasheet(device: torch.device) -> HardwareSpec:
    gpu = torch.cuda.get_device_name(device).lower()
    for key in _GPU_KEYS:
        if key in gpu:
            try:
                return get_hardware(key)
            except InvalidParameterError:
                break
    logger.warning("no datasheet spec for %s; predictions use the H100 spec", gpu)
    return get_hardware("h100")


def default_hardware(device: torch.device, name: Optional[str] = None) -> HardwareSpec:
    """The named spec, else the GPU's datasheet, else the local CPU's (see the module doc)."""
    if name and canonical_hardware_name(name) != LOCAL_CPU:
        return get_hardware(name)
    if not name and device.type == "cuda":
        return gpu_datasheet(device)
    return local_cpu_without_engine()


def local_link_key() -> str:
    return f"{cpu_model()} / {os.cpu_count()} cores"


def default_link(hw: HardwareSpec) -> Optional[LinkSpec]:
    """The link between ranks: the GPU's NVLink/PCIe default, else the local gloo link measured earlier
    (measure.local_hardware.local_gloo_link), None where it never was."""
    if hw.kind == "gpu":
        return get_link(DEFAULT_LINK.get(hw.name, "pcie4"))
    return cached_local_link(local_link_key())
