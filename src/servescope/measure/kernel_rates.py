"""How fast the engine's CPU linear kernel gets through its weights at M rows, for the cost model.

A decode step multiplies a few rows by every weight matrix. The roofline says that costs
max(FLOPs / peak, bytes / bandwidth), but neither ceiling is what a real kernel meets at small M:
the GEMV of 1-2 rows streams below a plain read's bandwidth, and the GEMMs at 4-64 rows sit between
the bandwidth and the peak. This measures that directly, once per machine, on matrices that are no
model's (32 of 1024 x 1024, 64-128 MiB: larger than the caches), with the module the engine uses
(CpuLinear: the GEMV up to MAX_ROWS, float32's panel GEMM up to PANEL_MAX_ROWS, oneDNN above; the
extension is loaded first, as the engine does). The result, weight bytes per second at each M, is
stored in the probe's HardwareSpec (`linear_rates`). The same for the paged decode-attention kernel:
its FLOP/s with the KV in cache (`decode_attention_flops`), and of the integer GEMM a prefill over
group-32 packed weights runs with float32 activations (`packed_gemm_flops`).
"""

from __future__ import annotations

import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears.cpu import CpuLinear
from servescope.model.linears.packed import GROUP32_MAX_ROWS, QuantLinear, kept_panel
from servescope.quant.scheme import BLOCK
from servescope.timing import median_seconds

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def measure_linear_rates(dtype_name: str, rows=ROWS, num_matrices: int = 32, size: int = 1024,
                         runs: int = 3) -> list:
    """[[M, weight bytes/s], ...] for the engine's CPU linear kernel in `dtype_name`."""
    dtype = getattr(torch, dtype_name)
    cpu_ops.load()  # CpuLinear packs panels only once the extension is loaded
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


def measure_packed_gemm_flops(rows: int = 512, dim: int = 768, runs: int = 3) -> float:
    """FLOP/s (2 * M * N * K) of the engine's prefill path over int4 group-32 weights (QuantLinear with
    float32 activations above GROUP32_MAX_ROWS rows: the integer GEMM, the path of int8-g32 and a GGUF's Q4_0 /
    Q4_1 / Q8_0 too) at `rows` rows, the size of a prefill chunk, over the matrix shapes of one decoder
    layer of width `dim` that belongs to no model (two dim x dim, two 3dim x dim, one dim x 3dim): the
    rate moves by +-30% with the shape (a narrow K amortises the activations' rounding over fewer
    outputs), and a layer's mix is what a prefill multiplies. The weights are random nibbles and scales:
    the kernel's speed does not depend on their values."""
    if not cpu_ops.available():
        raise RuntimeError("the CPU op extension is not built here")
    if rows <= GROUP32_MAX_ROWS:
        raise ValueError(f"rows must exceed GROUP32_MAX_ROWS ({GROUP32_MAX_ROWS}): fewer go to quant_gemv")
    if dim % BLOCK:
        raise ValueError(f"dim must be a multiple of {BLOCK}, got {dim}")
    gen = torch.Generator().manual_seed(0)
    shapes = [(dim, dim), (dim, dim), (3 * dim, dim), (3 * dim, dim), (dim, 3 * dim)]
    lins = [(QuantLinear(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                         (torch.rand(n, k // BLOCK, generator=gen) * 0.01 + 0.001).half(), k),
             torch.randn(rows, k, generator=gen)) for n, k in shapes]
    for lin, _ in lins:  # in the layout the engine's weights take on this CPU (model/quantize.keep_panels)
        lin.keep_panels(kept_panel())

    def once():
        for lin, x in lins:
            lin(x)

    with torch.inference_mode():
        return 2.0 * rows * sum(n * k for n, k in shapes) / median_seconds(once, runs)
