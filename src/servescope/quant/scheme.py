"""The packed weight form's scheme: bits, group and symmetry (servescope.quant.packed says the bytes).

Its own module because everything in quant/ names it (packed.py's quantize, search.py's scale search,
gptq.py) and search.py must not import packed.py, which calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 32
GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class QuantScheme:
    """bits 4 | 8; group 32 | 64 | 128 | None (None: one group per row, "per channel"); asym: with an offset."""

    bits: int
    group: int | None = 32
    asym: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"quantization bits must be 4 or 8, got {self.bits}")
        if self.group is not None and self.group not in GROUPS:
            raise ValueError(f"quantization group must be one of {GROUPS} or per-channel, got {self.group}")

    def padded_k(self, k: int) -> int:
        g = self.group or BLOCK
        return -(-k // g) * g

    def bits_per_weight(self, k: int) -> float:
        """Stored bits per weight of a row of length k, scales included."""
        kp = self.padded_k(k)
        groups = kp // (self.group or kp)
        return (kp * self.bits + groups * 16 * (2 if self.asym else 1)) / k
