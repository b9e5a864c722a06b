"""Attention backends behind one interface (see backend.py), chosen once at engine start-up."""

import torch

from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.attention.torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on CUDA when it imports, else the torch reference."""
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
