"""Bytes of packed (4- and 8-bit) weights, for the cost model and the memory planner. Pure Python.

The weight formats a step's weights can be in, besides the float and int8 dtypes of analysis/spec.py:
- `--quantization` modes: `int4` (group 32, symmetric), `int8-g32`, `int<4|8>-<g32|g64|g128|ch>[-sym|-asym]`.
  The embedding lookup keeps the activation dtype; the output head is a packed copy (8 bits in groups
  of 32 for the 4-bit modes, model/quantize.HEAD_SCHEME; the mode itself for the 8-bit ones).
- a GGUF run from its blocks: `q4_0`, `q4_1`, `q8_0`, read off its first projection in memory (a Q4_K
  file's repacked projections are in Q4_1's form, its Q6_K ones in Q8_0's: the name undercounts a
  Q4_K_M file's Q6_K tensors). The embedding table and the (tied) head are the file's token_embd, Q8_0
  in the files this engine writes and ships.
Bytes per weight of a row of K (quant/packed.py's form, GGUF's block sizes): the packed
integers of K rounded up to the group, plus one float16 scale per group (and one float16 offset when
asymmetric): Q4_0 18 / 32 = 0.5625, Q4_1 20 / 32 = 0.625, Q8_0 34 / 32 = 1.0625 bytes per weight; MXFP4
17 / 32 = 0.53125 (4.25 bits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

# MXFP4 (gpt-oss's released experts, quant/mxfp4.py): 32 e2m1 nibbles and one E8M0 scale byte per block,
# 17 / 32 bytes per weight; a model in it keeps its other weights in the float dtype (config/moe.py's
# ExpertsSpec.weight_format), so it is counted per expert, not as a whole-model format
MXFP4_BITS_PER_WEIGHT = (32 * 4 + 8) / 32
GGUF_FORMATS = {"q4_0": "int4-g32-sym", "q4_1": "int4-g32-asym", "q8_0": "int8-g32-sym"}
_GROUPS = {"g32": 32, "g64": 64, "g128": 128, "ch": None}


@dataclass(frozen=True)
class PackedFormat:
    bits: int
    group: Optional[int]  # None: one group per row
    asym: bool
    gguf: bool = False  # the embedding is the packed table itself (a GGUF's token_embd)

    def row_bytes(self, k: int) -> int:
        """Stored bytes of one row of k weights, scales included."""
        g = self.group or -(-k // 32) * 32
        kp = -(-k // g) * g
        return kp * self.bits // 8 + (kp // g) * 2 * (2 if self.asym else 1)

    def bytes_per_weight(self, k: int) -> float:
        return self.row_bytes(k) / k

    def head(self) -> "PackedFormat":
        """The output head's format: 8 bits in groups of 32 beside 4-bit weights, else the same."""
        return PackedFormat(8, 32, False, self.gguf) if self.bits == 4 else self


def packed_format(name: str) -> Optional[PackedFormat]:
    """The format a weight-format name stands for; None for anything else (a float dtype, int8)."""
    return _parse(name) if isinstance(name, str) else None


@functools.lru_cache(maxsize=256)  # the cost model asks for the same few names several times every step
def _parse(name: str) -> Optional[PackedFormat]:
    gguf = name in GGUF_FORMATS
    parts = GGUF_FORMATS.get(name, name).split("-")
    bits = {"int4": 4, "int8": 8}.get(parts[0])
    if bits is None or (bits == 8 and len(parts) == 1):  # plain int8 is the per-channel dtype
        return None
    rest = parts[1:]
    group = _GROUPS.get(rest.pop(0), 0) if rest and rest[0] in _GROUPS else 32
    asym = rest.pop(0) == "asym" if rest and rest[0] in ("sym", "asym") else False
    if group == 0 or rest:
        return None
    return PackedFormat(bits, group, asym, gguf)


def gguf_format_name(bits: int, group: Optional[int], asym: bool) -> Optional[str]:
    """q4_0 / q4_1 / q8_0 for a GGUF's packed weights of that shape, else None."""
    want = f"int{bits}-g32-{'asym' if asym else 'sym'}" if group == 32 else None
    return next((k for k, v in GGUF_FORMATS.items() if v == want), None)
