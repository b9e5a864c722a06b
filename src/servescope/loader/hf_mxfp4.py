"""A Hugging Face gpt-oss directory whose experts are MXFP4 (`quantization_config: {"quant_method": "mxfp4"}`,
how openai/gpt-oss-20b and -120b are released): the experts stay in their blocks.

The file holds, per sparse layer (transformers' integrations/mxfp4.py names; quant/mxfp4.py the bytes):
  model.layers.N.mlp.experts.gate_up_proj_blocks [E, 2I, Dm/32, 16] uint8, gate_up_proj_scales [E, 2I, Dm/32]
      uint8 (E8M0): rows gate and up interleaved (even, odd), as the float checkpoint's columns are
  model.layers.N.mlp.experts.down_proj_blocks [E, Dm, I/32, 16], down_proj_scales [E, Dm, I/32]
  ...gate_up_proj_bias, down_proj_bias in float, as in a float checkpoint
and everything else (attention, router, embedding, head: the config's modules_to_not_convert) in float.
`read_mxfp4` hands each expert's gate, up and down to the build as packed entries under the per-expert HF
keys that a GGUF's experts use (loader/gguf_experts.py's packed_experts makes the layer's PackedClampedExperts
over them before anything is allocated), the nibbles re-laid to the engine's order and gate / up
de-interleaved (rows only: no value changes). The float weights of those experts never exist.
"""

from __future__ import annotations

import re

import torch

from servescope.errors import ModelLoadError
from servescope.loader.gguf_experts import expert_key
from servescope.loader.gguf_packed import placeholder
from servescope.quant import mxfp4

_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")


def is_mxfp4_config(hf_config: dict) -> bool:
    qc = hf_config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == mxfp4.QUANT_METHOD


def read_mxfp4(tensors: dict, shapes: dict, where: str) -> tuple:
    """(dense state dict, packed {per-expert HF key: (blocks, scales, K)}) of a gpt-oss MXFP4 checkpoint's
    tensors (as stored; emptied as they are read, so the stacked blocks and their re-laid copies coexist one
    layer at a time). shapes: the config's {hf name: shape} (expected_tensor_shapes): a layer's stacked expert
    weights get zero-cost placeholders in the dense dict for the shape checks (the caller drops them). Raises
    ModelLoadError for a block tensor the model has no place for, one without its scales, or a shape that does
    not match the config."""
    dense, packed, layers = {}, {}, {}
    for name in list(tensors):  # (taken out of `tensors` as read: a layer's stacked blocks go once it is re-laid)
        t = tensors.pop(name)
        m = _TENSOR.match(name)
        if m is None:
            if name.endswith(("_blocks", "_scales")):
                raise ModelLoadError(f"{where}: MXFP4 tensor {name}: only gpt-oss's routed experts are read packed")
            dense[name] = t
            continue
        layers.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = t
    if not layers:
        raise ModelLoadError(f"{where}: quantization_config says mxfp4 but the files hold no MXFP4 expert tensors "
                             "(model.layers.N.mlp.experts.*_blocks / _scales)")
    for layer, proj in sorted(layers):
        parts = layers.pop((layer, proj))
        stacked = f"model.layers.{layer}.mlp.experts.{proj}"
        if stacked not in shapes or set(parts) != {"blocks", "scales"}:
            raise ModelLoadError(f"{where}: {stacked}_blocks and _scales: the pair is incomplete or the config "
                                 "has no experts in that layer")
        e, k, n = shapes[stacked]  # the float layout: [E, K, N] (transposed)
        blocks, scales = parts["blocks"], parts["scales"]
        if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape) != (e, n, k // 32, 16)
                or tuple(scales.shape) != (e, n, k // 32) or k % 32):
            raise ModelLoadError(f"{where}: {stacked}_blocks {list(blocks.shape)} / _scales {list(scales.shape)}: "
                                 f"expected uint8 [{e}, {n}, {k // 32}, 16] / [{e}, {n}, {k // 32}] for the config")
        for x in range(e):
            if proj == "down_proj":
                packed[expert_key("gpt_oss", layer, "down", x)] = (mxfp4.from_hf_blocks(blocks[x]),
                                                                    scales[x].contiguous(), k)
                continue
            for part, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                packed[expert_key("gpt_oss", layer, part, x)] = (mxfp4.from_hf_blocks(blocks[x, rows]),
                                                                  scales[x, rows].contiguous(), k)
        dense[stacked] = placeholder((e, k, n))
    return dense, packed


def drop_packed_placeholders(state_dict: dict, packed: dict) -> dict:
    """The checked state dict without the stacked expert placeholders of the layers `packed` holds."""
    keep = {}
    for name, t in state_dict.items():
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m and expert_key("gpt_oss", m.group(1), "down", 0) in packed:
            continue
        keep[name] = t
    return keep
