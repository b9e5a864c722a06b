"""Attention backends behind one interface (see backend.py), chosen once at engine start-up."""

import torch

from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.attention.reference import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on CUDA when it imports, else the torch reference."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    try:
        # lazy and optional: triton may be missing (then only an explicit "triton" is an error), and
        # importing it costs ~0.35 s of a start-up that does not use it
        from servescope.model.attention.triton_backend import TritonAttentionBackend
    except ImportError as e:
        if name == "triton":
            raise RuntimeError(f"attention backend 'triton' is not available: {e}") from e
        return TorchAttentionBackend()
    return TritonAttentionBackend()
