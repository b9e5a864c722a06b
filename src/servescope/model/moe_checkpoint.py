"""Checkpoint layouts of the MLP kind "moe" (model/moe.py): per-expert tensors stacked into the layer's
[E, 2I, Dm] gate|up and [E, Dm, I] down parameters at load, gpt-oss's interleaved gate|up de-interleaved; the
decoder's load hook (model/decoder.py's load_weights) calls `stack_expert_checkpoint` before its straight copy."""

from __future__ import annotations

import re

import torch

_GPT_OSS_ROUTER = re.compile(r"(model\.layers\.\d+\.mlp\.)router\.(weight|bias)$")
_MIXTRAL_ROUTER = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
_EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# a checkpoint's per-expert part -> (stacked parameter, its place along the stacked rows)
_PARTS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", 0), "w2": ("down_proj", 0)}


def stack_expert_checkpoint(sd: dict) -> dict:
    """Per-expert checkpoint tensors (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
    `block_sparse_moe.experts.{e}.w1.weight` ...) -> this model's stacked `mlp.experts.gate_up_proj`
    [E, 2I, Dm] and `mlp.experts.down_proj` [E, Dm, I]; Mixtral's `block_sparse_moe.gate` -> `mlp.gate`.
    A layer missing an expert's part keeps its tensors as they are (the build names what is missing).
    gpt-oss's stacked experts: `gpt_oss_checkpoint`."""
    gpt_oss_checkpoint(sd)
    parts: dict = {}  # (layer, stacked name) -> {expert: {slot: tensor}}
    for key in list(sd):
        m = _MIXTRAL_ROUTER.match(key)
        if m:
            sd[f"model.layers.{m.group(1)}.mlp.gate.weight"] = sd.pop(key)
            continue
        m = _EXPERT_TENSOR.match(key)
        if m and m.group(3) in _PARTS:
            name, slot = _PARTS[m.group(3)]
            parts.setdefault((m.group(1), name), {}).setdefault(int(m.group(2)), {})[slot] = key
    for (layer, name), experts in parts.items():
        slots = 2 if name == "gate_up_proj" else 1
        if sorted(experts) != list(range(len(experts))) or any(len(s) != slots for s in experts.values()):
            continue
        stacked = [torch.cat([sd.pop(experts[e][s]) for s in range(slots)], dim=0)
                   for e in range(len(experts))]
        sd[f"model.layers.{layer}.mlp.experts.{name}"] = torch.stack(stacked)
    return sd


def gpt_oss_checkpoint(sd: dict) -> None:
    """gpt-oss's expert tensors -> this model's names and layout, in place, in each layer that has gpt-oss's
    router (`mlp.router`, becoming `mlp.gate`): gate_up_proj [E, Dm, 2I] with gate and up interleaved (even and
    odd columns) -> [E, 2I] rows gate | up over Dm, its bias [E, 2I] likewise; down_proj [E, I, Dm] -> [E, Dm, I]."""
    for key in list(sd):
        m = _GPT_OSS_ROUTER.match(key)
        if not m:
            continue
        mlp = m.group(1)
        sd[f"{mlp}gate.{m.group(2)}"] = sd.pop(key)
        if m.group(2) != "weight":
            continue
        ex = mlp + "experts."
        if ex + "gate_up_proj" in sd:
            w = sd[ex + "gate_up_proj"].transpose(1, 2)  # [E, 2I, Dm], rows interleaved
            sd[ex + "gate_up_proj"] = torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
        if ex + "gate_up_proj_bias" in sd:
            b = sd[ex + "gate_up_proj_bias"]
            sd[ex + "gate_up_proj_bias"] = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
        if ex + "down_proj" in sd:
            sd[ex + "down_proj"] = sd[ex + "down_proj"].transpose(1, 2).contiguous()
