"""A Triton GEMV for the decode steps of a GPU: y [M, N] = x [M, K] @ w [N, K]^T, M <= MAX_M.

Shape legend: M rows of activations (sequences decoding), K input width, N output width
(the weight's rows).

At batch 1 a decode step is a chain of matrix-vector products whose only cost is reading the
weights, so what matters is the fraction of the memory bandwidth each achieves. cuBLAS picks
its own kernel for an M of 1-8; this one is the plain streaming alternative: each program owns
BLOCK_N consecutive weight rows (contiguous memory) and walks K in BLOCK_K chunks, all M rows of
x at once, accumulating in float32, no split-K (so the result is deterministic and the same in
a CUDA graph and out of it). Which of the two is faster for a given shape is measured, not
assumed: `select` times both on the model's own weights at engine start (`gpu_linear="auto"`),
and benchmarks/gpu.py reports both side by side.

Safe under CUDA graph capture: no host syncs, the output is allocated from the input shapes,
the grid depends on shapes only. Tested on the CPU with the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import logging
import os

import torch

from servescope.timing import median_seconds

try:
    import triton
    import triton.language as tl

    from servescope.kernels.triton.attention import num_sms
except Exception:  # triton missing or broken: TritonLinear is not used
    triton = None
    tl = None

logger = logging.getLogger(__name__)

AVAILABLE: bool = triton is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")

MAX_M = 8  # rows of x this kernel serves; larger M (prefill, big decode batches) go to cuBLAS
# programs per streaming multiprocessor for one matrix: enough resident loads to cover the memory
# latency (an H200: 132 SMs, 528 programs); the rows per program follow from N
_PROGRAMS_PER_SM = 4


if triton is not None:

    @triton.jit
    def _weight_tile(w_rows, row_mask, k0, K, BLOCK_K: tl.constexpr):
        """Columns [k0, k0 + BLOCK_K) of the program's weight rows in float32 (read once: evict first)."""
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # [BN, BK]
        return w, ks, k_mask

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows = output columns
        ms = tl.arange(0, BLOCK_M)  # [BM]
        row_mask = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
        if BLOCK_M == 1:
            # one row: element-wise products summed across K chunks, one reduction at the end
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                w, ks, k_mask = _weight_tile(w_rows, row_mask, k0, K, BLOCK_K)
                x0 = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
                acc2 += w * x0[None, :]
            acc = tl.sum(acc2, axis=1)[None, :]  # [1, BN]
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                w, ks, k_mask = _weight_tile(w_rows, row_mask, k0, K, BLOCK_K)
                for m in tl.static_range(BLOCK_M):
                    # rows m >= M (BLOCK_M is a power of two) re-read row M - 1; they are never stored
                    xm = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_xm + ks, mask=k_mask,
                                 other=0.0).to(tl.float32)
                    part = tl.sum(w * xm[None, :], axis=1)  # [BN]
                    acc += tl.where(ms[:, None] == m, part[None, :], 0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + ms[:, None] * stride_ym + rows[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(ms[:, None] < M) & row_mask[None, :])


def _pow2_at_most(x: int, lo: int, hi: int) -> int:
    p = lo
    while p * 2 <= min(x, hi):
        p *= 2
    return p


def default_config(m: int, n: int, k: int, sms: int = 132) -> dict:
    """Rows per program so that a matrix spreads over about _PROGRAMS_PER_SM programs per SM (1-16 rows);
    a tile of 4096 elements at M = 1 (its float32 running products stay in registers: 32 per
    thread of 4 warps), [BLOCK_N, 256] at larger M."""
    block_n = _pow2_at_most(max(1, n // (_PROGRAMS_PER_SM * sms)), 1, 16)
    block_k = max(64, min(1024, 4096 // block_n)) if m == 1 else 256
    block_k = min(block_k, max(16, 1 << (k - 1).bit_length()))
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4}


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None
         ) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, last dim contiguous), w [N, K] contiguous -> [M, N] in x's dtype."""
    if triton is None:
        raise RuntimeError("triton is not available")
    m, k = x.shape
    n = w.shape[0]
    if not (1 <= m <= MAX_M) or w.shape[1] != k:
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} (M must be 1..{MAX_M})")
    if x.stride(1) != 1:
        x = x.contiguous()
    if not w.is_contiguous():
        raise ValueError("gemv: the weight must be contiguous")
    if config is None:
        config = default_config(m, n, k, num_sms(x.device))
    cfg = config
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _gemv_kernel[grid](x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                       HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg["BLOCK_N"],
                       BLOCK_K=cfg["BLOCK_K"], num_warps=cfg.get("num_warps", 4))
    return y


class TritonLinear(torch.nn.Module):
    """nn.Linear whose calls with M <= MAX_M rows may go to the Triton GEMV: `rows` is the set of
    M for which it does (set by `select`, or all of 1..MAX_M when forced); the rest is F.linear."""

    def __init__(self, linear: torch.nn.Module, rows=()):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.rows = frozenset(int(r) for r in rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] in self.rows:
            return gemv(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def seconds_per_call(fn, calls: int = 3, reps: int = 5) -> float:
    """Median seconds of one fn() over `reps` timed loops of `calls` calls (CUDA events on a GPU; the
    host clock in the interpreter, where only the code path matters)."""
    return median_seconds(lambda: [fn() for _ in range(calls)], reps, cuda=torch.cuda.is_available()) / calls


def decoder_projections(model: torch.nn.Module) -> list:
    """(parent, attribute name, module) of every projection of the decoder layers (nn.Linear,
    TritonLinear, CpuLinear...), in layer order: the model's swappable linears without the head."""
    return [(parent, name, m) for parent, name, m in model.projections() if name != "lm_head"]


def select(model: torch.nn.Module, mode: str, rows=(1, 2, 4, 8)) -> dict:
    """Route the decoder's projections (nn.Linear, or TritonLinear from an earlier call) through
    TritonLinear. mode "triton": the Triton GEMV at every M <= MAX_M in `rows`; "cublas": none;
    "auto": per weight shape and M, whichever of cuBLAS and the Triton GEMV is faster, timed here
    on the model's own matrices of that shape (in turn, so that no matrix is re-read from L2), a
    few ms per shape. Returns {(N, K, M): {"use": "triton" | "cublas", "triton_s", "cublas_s"}},
    the times (seconds per matrix) only for "auto"."""
    if mode not in ("triton", "cublas", "auto"):
        raise ValueError(f"mode must be triton, cublas or auto, got {mode!r}")
    mods = [(p, n, m) for p, n, m in decoder_projections(model) if type(m) in (torch.nn.Linear, TritonLinear)]
    by_shape: dict = {}
    for _, _, lin in mods:
        by_shape.setdefault(tuple(lin.weight.shape), []).append(lin)
    choice: dict = {}
    for (n, k), lins in by_shape.items():
        for m in rows:
            if m > MAX_M:
                continue
            if mode != "auto":
                choice[(n, k, m)] = {"use": mode, "triton_s": None, "cublas_s": None}
                continue
            x = torch.randn(m, k, device=lins[0].weight.device, dtype=lins[0].weight.dtype)
            try:
                t_tri = seconds_per_call(lambda: [gemv(x, lin.weight, lin.bias) for lin in lins]) / len(lins)
            except Exception as e:  # a kernel that does not compile here must not stop the engine
                logger.warning("Triton GEMV failed for %s x %s (%s: %s); using cuBLAS", (m, k), (n, k),
                               type(e).__name__, e)
                t_tri = float("inf")
            t_cub = seconds_per_call(lambda: [torch.nn.functional.linear(x, lin.weight, lin.bias) for lin in lins]
                                     ) / len(lins)
            use = "triton" if t_tri < t_cub else "cublas"
            choice[(n, k, m)] = {"use": use, "triton_s": t_tri, "cublas_s": t_cub}
            logger.info("GEMV %dx%d at M=%d: Triton %.1f us, cuBLAS %.1f us per matrix -> %s", n, k, m,
                        t_tri * 1e6, t_cub * 1e6, use)
    for parent, name, lin in mods:
        n, k = lin.weight.shape
        use = [m for m in rows if choice.get((n, k, m), {}).get("use") == "triton"]
        setattr(parent, name, TritonLinear(lin, use))
    return choice
