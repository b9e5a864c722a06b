"""How fast the engine's CPU linear kernel gets through its weights at M rows, for the cost model.

A decode step multiplies a few rows by every weight matrix. The roofline says that costs
max(FLOPs / peak, bytes / bandwidth), but neither ceiling is what a real kernel meets at small M:
the GEMV of 1-2 rows streams below a plain read's bandwidth, and oneDNN at 4-64 rows sits between
the bandwidth and the peak. This measures that directly, once per machine, on matrices that are no
model's (32 of 1024 x 1024, 64-128 MiB: larger than the caches), with the module the engine uses
(CpuLinear: GEMV below MAX_ROWS, oneDNN on prepacked weights above). The result, weight bytes per
second at each M, is stored in the probe's HardwareSpec (`linear_rates`). The same for the paged
decode-attention kernel: its FLOP/s with the KV in cache (`decode_attention_flops`).
"""

from __future__ import annotations

import torch

from servescope.kernels import cpu_ops
from servescope.kernels.cpu_kernels import CpuLinear
from servescope.timing import median_seconds

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def measure_linear_rates(dtype_name: str, rows=ROWS, num_matrices: int = 32, size: int = 1024,
                         runs: int = 3) -> list:
    """[[M, weight bytes/s], ...] for the engine's CPU linear kernel in `dtype_name`."""
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    lins = []
    for _ in range(num_matrices):
        lin = torch.nn.Linear(size, size, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(size, size, generator=gen) * 0.02)
        lins.append(CpuLinear(lin.to(dtype).requires_grad_(False)))
    nbytes = num_matrices * size * size * torch.empty(0, dtype=dtype).element_size()
    out = []
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, size, generator=gen).to(dtype)

            def once():
                for lin in lins:
                    lin(x)

            out.append([int(m), nbytes / median_seconds(once, runs)])
    return out


def measure_decode_attention_flops(dtype_name: str, batch: int = 32, context: int = 256, kv_heads: int = 2,
                                   group: int = 4, head_dim: int = 64, runs: int = 5) -> float:
    """FLOP/s (4 * H * D per attended key) of the engine's CPU paged decode-attention kernel, with its
    KV in cache (a few MiB): the compute rate; reading the KV from memory is priced separately."""
    if not cpu_ops.available():
        raise RuntimeError("the CPU op extension is not built here")
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    s = 16
    nblk = batch * context // s
    kc = torch.randn(nblk, s, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(nblk, s, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.arange(nblk, dtype=torch.int32).view(batch, context // s)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen).to(dtype)
    flops = 4 * kv_heads * group * head_dim * context * batch

    def ten():
        for _ in range(10):
            cpu_ops.paged_decode(q, kc, vc, tables, lens, head_dim ** -0.5)

    return flops / (median_seconds(ten, runs) / 10)
