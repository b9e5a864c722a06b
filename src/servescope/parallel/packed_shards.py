"""Tensor-parallel shards of packed weights (a GGUF's blocks kept packed: `--quantization gguf`; quant/packed.py
says the bytes): a QuantLinear's output rows (column parallel) and whole groups of its input columns (row
parallel); a packed embedding's or head's vocabulary rows are tensor_parallel._padded's, as any table's. The
blocks are sliced, never requantised, so every shard multiplies the file's own bytes and one process's numbers
come back up to the order of the partial sums."""

from __future__ import annotations

import torch

from servescope.errors import EngineConfigError
from servescope.model.linears.packed import QuantLinear


def _per_byte(q: torch.Tensor) -> int:
    return 2 if q.dtype == torch.uint8 else 1  # int4: two nibbles a byte; int8: one


def packed_rows(mod: QuantLinear, spans: list) -> QuantLinear:
    """The QuantLinear of the output rows in `spans` [(start, stop)...] concatenated."""
    q = torch.cat([mod.qweight[a:b] for a, b in spans])
    s = torch.cat([mod.scales[a:b] for a, b in spans])
    bias = None if mod.bias is None else torch.cat([mod.bias.detach()[a:b] for a, b in spans])
    return QuantLinear(q.contiguous(), s.contiguous(), mod.in_features, bias, mod.float_output)


def packed_cols(mod: QuantLinear, start: int, stop: int, keep_bias: bool, name: str) -> QuantLinear:
    """The QuantLinear of the input columns [start, stop): whole groups of scales only (each shard reads the
    file's blocks as they are); the bias on one shard only (row parallel)."""
    kp = mod.qweight.shape[1] * _per_byte(mod.qweight)
    group = kp // mod.scales.shape[1]
    if mod.mxfp4 or kp != mod.in_features or start % group or stop % group:
        raise EngineConfigError(
            f"tensor parallelism cuts {name}'s packed input columns at {start}..{stop}, which does not fall on its "
            f"blocks of {group} (columns {mod.in_features}): use a tensor_parallel_size whose shard widths are "
            f"whole blocks, or float weights (--quantization int4 / int8 quantise each shard)")
    per = _per_byte(mod.qweight)
    q = mod.qweight[:, start // per:stop // per]
    s = mod.scales[:, start // group:stop // group]
    return QuantLinear(q.contiguous(), s.contiguous(), stop - start, mod.bias if keep_bias else None,
                       mod.float_output)

