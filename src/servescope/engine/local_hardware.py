"""The hardware spec the engine predicts with, and the probe of the local CPU with the engine's own
measurers.

analysis/ is pure: its probe measures what any torch program can (bandwidth, matmul peaks) and takes
the engine-specific measurements (host overhead per step and layer, the linear and attention kernels'
rates) as arguments. This module, above both, hands them in. Everything above the engine (CLI, labs,
bench) asks here for "local-cpu".
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from servescope.analysis.hardware import HardwareSpec, get_hardware
from servescope.errors import InvalidParameterError

logger = logging.getLogger(__name__)

_GPU_KEYS = ("h200", "h100", "a100", "l40s", "l4", "4090", "mi300x")


def probe_local_cpu(force: bool = False) -> HardwareSpec:
    """The local CPU's spec: measured once (bandwidth, matmul peaks, the engine's kernel rates and host
    overhead), then read from the cache."""
    return get_hardware("local-cpu", force_probe=force)


def resolve_hardware(name: Optional[str]) -> HardwareSpec:
    """A spec by name; "local-cpu" (and its aliases) through probe_local_cpu."""
    return get_hardware(name)


def hardware_for_device(device: torch.device, name: Optional[str] = None) -> HardwareSpec:
    """The spec to predict with: the named one, else the GPU's datasheet, else the CPU probe."""
    if name:
        return resolve_hardware(name)
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        for key in _GPU_KEYS:
            if key in gpu:
                try:
                    return get_hardware(key)
                except InvalidParameterError:
                    break
        logger.warning("no datasheet spec for %s; predictions use the H100 spec", gpu)
        return get_hardware("h100")
    return probe_local_cpu()
