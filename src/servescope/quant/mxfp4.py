"""MXFP4 (OCP microscaling FP4), the form gpt-oss's experts are released in: blocks of 32 e2m1 values (4 bits:
sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) sharing one E8M0 scale
byte (2^(e - 127)). 4.25 bits per weight.

The engine's packed form (kernels/cpu/csrc: QMatrix's e8m0, quant_dot.h's FMT_MX) is GGUF's MXFP4 with the
scale moved out, the int4 forms' byte order:
  blocks uint8 [N, K/2]: byte j of a block = element j (low nibble) | element j + 16 (high nibble)
  scales uint8 [N, K/32]: the E8M0 bytes
A Hugging Face checkpoint (transformers' integrations/mxfp4.py) stores `<name>_blocks` [.., N, K/32, 16] with
byte j = element 2j (low) | element 2j + 1 (high) and `<name>_scales` [.., N, K/32]: `from_hf_blocks` re-lays
the nibbles (as llama.cpp's converter does), `to_hf_blocks` the other way. The kernels multiply in integers:
the nibble's value doubled (VALUES2: ggml's kvalues_mxfp4) times the int8 activations, scaled by 2^(e - 128).
"""

from __future__ import annotations

import torch

BLOCK = 32
BITS_PER_WEIGHT = 4.25
VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
VALUES2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # doubled, as integers
QUANT_METHOD = "mxfp4"  # a Hugging Face config's quantization_config quant_method


def is_mxfp4(scales: torch.Tensor) -> bool:
    """Whether packed weights with these scales are MXFP4 (E8M0 bytes; the int forms' scales are float16)."""
    return scales.dtype == torch.uint8


def codes(blocks: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes [N, K] (int64) of blocks uint8 [N, K/2] in the engine's order."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 16).long()
    return torch.stack([b & 15, b >> 4], dim=2).reshape(n, -1)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, k: int, dtype=torch.float32) -> torch.Tensor:
    """blocks uint8 [N, K/2] (engine order), scales uint8 [N, K/32] -> [N, k] in dtype (exact in float32)."""
    n = blocks.shape[0]
    v = torch.tensor(VALUES, dtype=torch.float32)[codes(blocks)].view(n, -1, BLOCK)
    w = torch.ldexp(v, scales.to(torch.int32)[..., None] - 127)
    return w.reshape(n, -1)[:, :k].to(dtype)


def quantize(w: torch.Tensor) -> tuple:
    """w [N, K] float (K a multiple of 32) -> (blocks, scales) in the engine's order: ggml's
    quantize_row_mxfp4_ref rule (e = floor(log2(amax)) - 2 + 127, each value to its nearest e2m1 value times
    2^(e - 127), ties to the first in VALUES2's order)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 rows hold whole blocks of {BLOCK}, got {k} weights")
    rows = max(1, (1 << 16) // k)  # rows per chunk: the nearest-value search's temporaries stay a few MiB
    if n > rows:
        parts = [quantize(w[r:r + rows]) for r in range(0, n, rows)]
        return torch.cat([b for b, _ in parts]), torch.cat([s for _, s in parts])
    x = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    amax = x.abs().amax(dim=2)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).clamp(0, 254)
    d = torch.ldexp(torch.ones_like(e), e.to(torch.int32) - 128)  # halved, as VALUES2 are doubled
    scaled = x / d[..., None]
    table = torch.tensor(VALUES2, dtype=torch.float32)
    idx = (scaled[..., None] - table).abs().argmin(dim=-1)  # first minimum: ggml's best_index_mxfp4
    u = idx.to(torch.uint8).reshape(n, k // BLOCK, 2, 16)
    blocks = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2)
    return blocks.contiguous(), e.to(torch.uint8).contiguous()


def from_hf_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """A checkpoint's `_blocks` [.., K/32, 16] (element 2j low, 2j + 1 high) -> the engine's [.., K/2]."""
    b = blocks.to(torch.uint8)
    pairs = torch.stack([b & 15, b >> 4], dim=-1).reshape(*b.shape[:-1], BLOCK)  # element order
    return (pairs[..., :16] | (pairs[..., 16:] << 4)).reshape(*b.shape[:-2], -1).contiguous()


def to_hf_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The engine's blocks [.., K/2] -> a checkpoint's `_blocks` [.., K/32, 16] (from_hf_blocks' inverse)."""
    b = blocks.reshape(*blocks.shape[:-1], -1, 16)
    elements = torch.cat([b & 15, b >> 4], dim=-1)  # [.., K/32, 32] in element order
    return (elements[..., 0::2] | (elements[..., 1::2] << 4)).contiguous()
