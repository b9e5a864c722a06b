"""Build a model from a ModelConfig and a checkpoint state dict (straight copy, names match)."""

from __future__ import annotations

import torch

from servescope.config import ModelConfig
from servescope.errors import ModelLoadError
from servescope.model.llama import MODEL_CLASSES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(cfg: ModelConfig, state_dict: dict, dtype: torch.dtype, device: torch.device,
                max_positions: int | None = None) -> torch.nn.Module:
    cls = MODEL_CLASSES[cfg.architecture]
    with torch.device("meta"):
        model = cls(cfg, max_positions=max_positions)
    expected = dict(model.named_parameters())
    sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if unexpected:
        raise ModelLoadError(f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")
    for name, p in expected.items():
        if tuple(sd[name].shape) != tuple(p.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(sd[name].shape)}, expected {tuple(p.shape)}")
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(sd[name].to(dtype))
    # non-persistent buffers (rotary tables) were built on meta: rebuild them on the device
    _rebuild_rotary(model, cfg, max_positions, device)
    model.requires_grad_(False)
    return model.eval()


def _rebuild_rotary(model, cfg: ModelConfig, max_positions, device) -> None:
    from servescope.model.layers import RotaryEmbedding

    model.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                   cfg.rope_theta, cfg.rope_scaling).to(device)
