"""Attention backends behind one interface (see backend.py), chosen once at engine start-up: the torch
reference (reference.py, the tests' oracle), the CPU backend over the C++ kernels (cpu.py), Triton
(triton_backend.py)."""

import torch

from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.attention.cpu import CpuAttentionBackend
from servescope.model.attention.reference import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "CpuAttentionBackend", "TorchAttentionBackend",
           "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on CUDA when it imports; on a CPU `auto` and `torch` pick the CPU backend (the C++
    kernels, the reference's code where the extension is not built); elsewhere the torch reference."""
    if device.type == "cpu" and name in ("auto", "torch"):
        return CpuAttentionBackend()
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    try:
        # lazy and optional: triton may be missing (then only an explicit "triton" is an error), and
        # importing it is start-up time that a CPU engine would pay for nothing
        from servescope.model.attention.triton_backend import TritonAttentionBackend
    except ImportError as e:
        if name == "triton":
            raise RuntimeError(f"attention backend 'triton' is not available: {e}") from e
        return TorchAttentionBackend()
    return TritonAttentionBackend()
