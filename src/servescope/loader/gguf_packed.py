"""A GGUF's Q4_0 / Q4_1 / Q8_0 tensors kept in their blocks and run as they are; Q4_K / Q6_K repacked.

The blocks are the packed form of quant/packed.py with the float16 scales moved out:
  Q4_0  [d f16][16 bytes: element j low nibble, j + 16 high]   value d * (u - 8)
  Q4_1  [d f16][m f16][16 bytes]                                value d * u + m
  Q8_0  [d f16][32 int8]                                        value d * q
`split_blocks` makes (packed, scales) from a tensor's bytes with one copy and no arithmetic. The
K-quants' super-blocks of 256 are repacked into those forms at load (`REPACKED`):
  Q4_K  [d f16][dmin f16][12 bytes: 6-bit scale and min of 8 sub-blocks of 32][128 bytes of nibbles]
        value d * sc_j * u - dmin * m_j: Q4_1's form per sub-block, the same nibbles (re-laid to
        element j low, j + 16 high), scale d * sc_j and offset -dmin * m_j rounded to float16 (a
        relative 2^-11 at most: the products need up to 17 bits), 0.625 bytes per weight for 0.5625;
  Q6_K  [128 bytes low 4 bits][64 bytes high 2 bits][16 int8 scales of sub-blocks of 16][d f16]
        value d * sc_i * (q - 32): two scales per 32 do not fit one group-32 scale, so it is
        requantised to int8 group 32 (Q8_0's form, 1.0625 bytes per weight for 0.82) with the engine's
        scale search: each value moves by less than one int8 step (a quarter of one on average), the
        int8 step being about a quarter of the 6-bit step of the larger-scaled of its group's two
        sub-blocks.
The loader puts a zero-cost placeholder in the state dict in their place (a broadcast zero of the right
shape), and `apply_packed` swaps the model's modules for QuantLinear / QuantEmbedding over the blocks while
the model is still on the meta device, so that no float copy of a packed weight is ever allocated (a 3B
model's would be 12 GB in float32), checking each module's shape against its blocks. Other
types (Q5_x, Q2_K, Q3_K, Q5_K, ...) are dequantised to float32 by the loader, which says so in a log line.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from servescope.errors import ModelLoadError
from servescope.model.decoder import FUSED_PROJECTIONS
from servescope.model.linears.packed import QuantEmbedding, QuantLinear
from servescope.quant.packed import dequantize, quantize
from servescope.quant.scheme import QuantScheme

logger = logging.getLogger(__name__)

# type -> (bytes per block of 32, scale halves per block, int4)
NATIVE = {T.Q4_0: (18, 1, True), T.Q4_1: (20, 2, True), T.Q8_0: (34, 1, False)}
QK_K = 256  # weights per K-quant super-block
REPACKED = {T.Q4_K: 144, T.Q6_K: 210}  # type -> bytes per super-block
REPACKED_FORM = {"Q4_K": "Q4_1's form (the same nibbles)", "Q6_K": "int8 group 32 (requantised)"}


def is_native(ttype) -> bool:
    return ttype in NATIVE or ttype in REPACKED


def split_blocks(data: np.ndarray, ttype, rows: int, k: int) -> tuple:
    """A tensor's raw bytes [rows, k / 32 blocks] -> (packed uint8 | int8 [rows, bytes], float16 scales
    [rows, G] or [rows, G, 2]); the K-quants repacked (module doc)."""
    if ttype in REPACKED:
        if k % QK_K:
            raise ValueError(f"a {ttype.name} row holds whole super-blocks of {QK_K}, got {k} weights")
        raw = np.array(data, dtype=np.uint8)  # a copy: torch wants writable memory, the file is read-only
        blocks = torch.from_numpy(raw.reshape(rows, k // QK_K, REPACKED[ttype]))
        return _q4_k(blocks) if ttype == T.Q4_K else _q6_k(blocks, rows, k)
    size, halves, int4 = NATIVE[ttype]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, k // 32, size)
    scales = np.ascontiguousarray(blocks[:, :, :2 * halves]).view(np.float16).reshape(rows, k // 32, halves)
    qs = np.ascontiguousarray(blocks[:, :, 2 * halves:]).reshape(rows, -1)
    packed = torch.from_numpy(qs) if int4 else torch.from_numpy(qs.view(np.int8))
    scales = torch.from_numpy(scales if halves == 2 else scales[..., 0].copy())
    return packed, scales.contiguous()


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float32 of the little-endian float16 they hold."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _q4_k(blocks: torch.Tensor) -> tuple:
    """Q4_K super-blocks [rows, S, 144] -> Q4_1's form: nibbles [rows, S * 128], scales [rows, S * 8, 2]."""
    rows, nsup = blocks.shape[:2]
    d, dmin, q = _half(blocks[..., 0:2]), _half(blocks[..., 2:4]), blocks[..., 4:16].int()
    # llama.cpp's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (mins 4-7), 4-7 in
    # the nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes 0-7
    sc = torch.cat([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    scales = torch.stack([d[..., None] * sc, -(dmin[..., None] * mn)], -1).half().reshape(rows, nsup * 8, 2)
    # 4 chunks of 32 bytes: sub-block 2c in the low nibbles (element l of byte l), 2c + 1 in the high ones
    b = blocks[..., 16:].reshape(rows, nsup, 4, 2, 16)
    lo, hi = b[..., 0, :], b[..., 1, :]  # bytes 0-15 and 16-31 of each chunk
    a = (lo & 15) | ((hi & 15) << 4)  # sub-block 2c: element j low, j + 16 high
    c = (lo >> 4) | (hi & 0xF0)  # sub-block 2c + 1
    return torch.stack([a, c], 3).reshape(rows, nsup * 128).contiguous(), scales.contiguous()


def q6_k_values(blocks: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Q6_K super-blocks [rows, S, 210] -> float32 [rows, k] (llama.cpp's dequantize_row_q6_K)."""
    nsup = blocks.shape[1]
    ql = blocks[..., 0:128].int().reshape(rows, nsup, 2, 64)
    qh = blocks[..., 128:192].int().reshape(rows, nsup, 2, 32)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float().reshape(rows, nsup, 2, 8)
    d = _half(blocks[..., 208:210])
    lo, hi = ql[..., :32], ql[..., 32:]
    q = torch.cat([(lo & 15) | ((qh & 3) << 4), (hi & 15) | (((qh >> 2) & 3) << 4),
                   (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], -1) - 32
    scale = d[..., None, None] * sc.repeat_interleave(16, -1)  # element e of a half: sub-block e // 16
    return (scale * q).reshape(rows, k)


def _q6_k(blocks: torch.Tensor, rows: int, k: int) -> tuple:
    """Q6_K -> int8 group 32 (Q8_0's form), requantised with the engine's scale search."""
    return quantize(q6_k_values(blocks, rows, k), QuantScheme(8, 32))


def placeholder(shape) -> torch.Tensor:
    """A float32 tensor of `shape` that takes no memory (one zero, broadcast)."""
    return torch.zeros(()).expand(*shape)


INT8_G32 = (torch.int8, 2)  # (packed dtype, scale dims) of int8 group 32, Q8_0's form


def settle_fused(packed: dict, state_dict: dict, num_layers: int, path: str) -> None:
    """Parts of one fused projection (q/k/v, gate/up) must share a packed form to be concatenated.
    Where they do not (Q4_K q/k beside a Q6_K v, as in llama.cpp's Q4_K_M; Q4_0 beside Q8_0), the parts
    are requantised to int8 group 32 (Q8_0's form, the finer of the two), one that is already in it
    kept as it is; a projection with a part that is not packed at all is dequantised to float32."""
    mixed = []
    for i in range(num_layers):
        for _, parts in FUSED_PROJECTIONS:
            keys = [f"model.layers.{i}.{p}.weight" for p in parts]
            got = [packed.get(k) for k in keys]
            if all(g is None for g in got) or not all(k in state_dict for k in keys):  # (latent attention: q alone)
                continue
            kinds = {None if g is None else (g[0].dtype, g[1].dim()) for g in got}
            if len(kinds) == 1:
                continue
            for k, g in zip(keys, got):
                if g is None:
                    continue
                if None in kinds:
                    state_dict[k] = dequantize(g[0], g[1], g[2])
                    del packed[k]
                elif (g[0].dtype, g[1].dim()) != INT8_G32:
                    packed[k] = (*quantize(dequantize(g[0], g[1], g[2]), QuantScheme(8, 32)), g[2])
            mixed.append(f"{i}:{'/'.join(parts)}" + (" (float32)" if None in kinds else ""))
    if mixed:
        logger.info("%s: fused projections whose parts mix block types, requantised to int8 group 32: %s",
                    path, ", ".join(mixed))


def apply_packed(model: torch.nn.Module, packed: dict, dtype: torch.dtype) -> None:
    """Replace the (meta) model's projections, head and embedding by modules over the packed blocks. A
    replaced projection's bias stays a meta parameter, allocated and loaded with the others (then
    `QuantLinear.refresh_bias`)."""
    for i, layer in enumerate(model.model.layers):
        for parent, fused_name, parts in _fused_targets(layer):
            keys = [f"model.layers.{i}.{p}.weight" for p in parts]
            if not all(k in packed for k in keys):
                continue
            old = getattr(parent, fused_name)
            qs = torch.cat([packed[k][0] for k in keys])
            scales = torch.cat([packed[k][1] for k in keys])
            _check_shape(f"model.layers.{i}.{fused_name}", (qs.shape[0], packed[keys[0]][2]),
                         (old.out_features, old.in_features))
            setattr(parent, fused_name, QuantLinear(qs, scales, packed[keys[0]][2], old.bias))
            for k in keys:  # (the parts' only other holder: the caller's dict, which the build consumes)
                del packed[k]
    emb = packed.get("model.embed_tokens.weight")
    if emb is not None:
        old = model.model.embed_tokens
        _check_shape("model.embed_tokens", (emb[0].shape[0], emb[2]), (old.num_embeddings, old.embedding_dim))
        model.model.embed_tokens = QuantEmbedding(emb[0], emb[1], emb[2], dtype)
    head = packed.get("lm_head.weight")  # (a saved quantised checkpoint: the tied head's own packed copy)
    if head is None and model.config.tie_word_embeddings:
        head = emb
    if head is not None:
        _check_shape("lm_head", (head[0].shape[0], head[2]), (model.lm_head.out_features, model.lm_head.in_features))
        model.lm_head = QuantLinear(head[0], head[1], head[2], None, float_output=True)
    packed.pop("model.embed_tokens.weight", None)
    packed.pop("lm_head.weight", None)


def _check_shape(name: str, blocks: tuple, module: tuple) -> None:
    if tuple(blocks) != tuple(module):
        raise ModelLoadError(f"tensor {name}.weight has shape {tuple(blocks)}, expected {tuple(module)}")


def _fused_targets(layer) -> list:
    """(parent, attribute, checkpoint parts) of a decoder layer's projections (a fused one's parts in the
    checkpoint's names, FUSED_PROJECTIONS; any other is its own single part)."""
    names = {id(m): name for name, m in layer.named_modules()}
    fused = dict(FUSED_PROJECTIONS)
    return [(parent, attr, fused.get(names[id(m)], (names[id(m)],))) for parent, attr, m in layer.projections()]
