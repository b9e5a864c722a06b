"""Random-initialised models of a real config ("random:llama-3-8b"): speed work without weights.

Weights are created directly on the target device in the target dtype, so an 8B model never
exists in float32 on the host.
"""

from __future__ import annotations

import torch

from servescope.config import ModelConfig
from servescope.loader.build import materialize


def build_random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                       max_positions: int | None = None, seed: int = 0) -> torch.nn.Module:
    model = materialize(cfg, device, dtype, max_positions)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.requires_grad_(False)
    return model.eval()
