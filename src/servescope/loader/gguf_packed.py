"""A GGUF's Q4_0 / Q4_1 / Q8_0 tensors kept in their blocks and run as they are.

The blocks are the packed form of kernels/quant_linear.py with the float16 scales moved out:
  Q4_0  [d f16][16 bytes: element j low nibble, j + 16 high]   value d * (u - 8)
  Q4_1  [d f16][m f16][16 bytes]                                value d * u + m
  Q8_0  [d f16][32 int8]                                        value d * q
`split_blocks` makes (packed, scales) from a tensor's bytes with one copy and no arithmetic. The
loader puts a zero-cost placeholder in the state dict in their place (a broadcast zero of the right
shape, so that the shape checks and the model build run as for any checkpoint), and `apply_packed`
swaps the built model's modules for QuantLinear / QuantEmbedding over the blocks afterwards. Other
types (Q4_K, Q6_K, Q5_x, ...) are dequantised to float32 by the loader, which says so in a log line.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from servescope.kernels.quant_linear import QuantEmbedding, QuantLinear, dequantize
from servescope.model.llama import FUSED_PROJECTIONS

logger = logging.getLogger(__name__)

# type -> (bytes per block of 32, scale halves per block, int4)
NATIVE = {T.Q4_0: (18, 1, True), T.Q4_1: (20, 2, True), T.Q8_0: (34, 1, False)}


def is_native(ttype) -> bool:
    return ttype in NATIVE


def split_blocks(data: np.ndarray, ttype, rows: int, k: int) -> tuple:
    """A tensor's raw bytes [rows, k / 32 blocks] -> (packed uint8 | int8 [rows, bytes], float16 scales
    [rows, G] or [rows, G, 2])."""
    size, halves, int4 = NATIVE[ttype]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, k // 32, size)
    scales = np.ascontiguousarray(blocks[:, :, :2 * halves]).view(np.float16).reshape(rows, k // 32, halves)
    qs = np.ascontiguousarray(blocks[:, :, 2 * halves:]).reshape(rows, -1)
    packed = torch.from_numpy(qs) if int4 else torch.from_numpy(qs.view(np.int8))
    scales = torch.from_numpy(scales if halves == 2 else scales[..., 0].copy())
    return packed, scales.contiguous()


def placeholder(shape) -> torch.Tensor:
    """A float32 tensor of `shape` that takes no memory (one zero, broadcast)."""
    return torch.zeros(()).expand(*shape)


def settle_fused(packed: dict, state_dict: dict, num_layers: int, path: str) -> None:
    """Parts of one fused projection (q/k/v, gate/up) must share a packed form to be concatenated;
    where they do not (a Q4_K part, or Q4_0 beside Q8_0), every part is dequantised to float32."""
    for i in range(num_layers):
        for _, parts in FUSED_PROJECTIONS:
            keys = [f"model.layers.{i}.{p}.weight" for p in parts]
            got = [packed.get(k) for k in keys]
            if all(g is None for g in got):
                continue
            kinds = {None if g is None else (g[0].dtype, g[1].dim()) for g in got}
            if len(kinds) != 1:
                for k, g in zip(keys, got):
                    if g is not None:
                        state_dict[k] = dequantize(g[0], g[1], g[2])
                        del packed[k]
                logger.info("%s: layer %d: %s mix block types; dequantised to float32", path, i, "/".join(parts))


def apply_packed(model: torch.nn.Module, packed: dict, dtype: torch.dtype) -> None:
    """Replace the built model's projections, head and embedding by modules over the packed blocks."""
    for i, layer in enumerate(model.model.layers):
        for parent, fused_name, parts in _fused_targets(layer):
            keys = [f"model.layers.{i}.{p}.weight" for p in parts]
            if not all(k in packed for k in keys):
                continue
            old = getattr(parent, fused_name)
            qs = torch.cat([packed[k][0] for k in keys])
            scales = torch.cat([packed[k][1] for k in keys])
            setattr(parent, fused_name, QuantLinear(qs, scales, packed[keys[0]][2], old.bias))
    emb = packed.get("model.embed_tokens.weight")
    if emb is not None:
        model.model.embed_tokens = QuantEmbedding(emb[0], emb[1], emb[2], dtype)
    head = emb if model.config.tie_word_embeddings else packed.get("lm_head.weight")
    if head is not None:
        model.lm_head = QuantLinear(head[0], head[1], head[2], None, float_output=True)


def _fused_targets(layer) -> list:
    """(parent, attribute, checkpoint parts) of a decoder layer's projections, fused ones first."""
    out = []
    for fused, parts in FUSED_PROJECTIONS:
        parent_name, attr = fused.split(".")
        out.append((getattr(layer, parent_name), attr, parts))
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        parent_name, attr = name.split(".")
        out.append((getattr(layer, parent_name), attr, (name,)))
    return out
