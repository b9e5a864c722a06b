"""A mixture of experts' routed MLPs on a GPU in two grouped GEMMs (vLLM's fused_moe scheme, our own code).

Shape legend: T tokens, k experts per token, P = T k (token, expert) pairs, E experts, Dm model width,
I expert width, BM rows of one block.

The pairs are sorted by expert on the device (`align_by_expert`: no host sync, so the shapes depend on T,
k and E only), each expert's run padded to a multiple of BM; each block of BM sorted pairs then belongs to
one expert, and one GEMM kernel runs every block over its expert's weights:
  gate_up: [P, 2I] rows = x[token of the pair] @ W_gate_up[e]^T          (A read through the token index)
  down:    [P, Dm] rows = silu(gate) * up of the pair @ W_down[e]^T x routing weight of the pair
and the k rows of a token are summed. Blocks past the padded total exit at once (the grid is the bound
P + min(P, E) (BM - 1), fixed by the shapes). An expert no token chose is never read.

Written for Triton 3.x; tested on CPU with the interpreter (TRITON_INTERPRET=1) against the per-expert torch
loop (model/moe.grouped_experts).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # triton missing or broken: the experts run the torch loop
    triton = None
    tl = None

AVAILABLE: bool = triton is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")

BLOCK_M = 16  # sorted pairs per block (tl.dot's smallest tile)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple:
    """ids [T, k] -> (the pair ids sorted by expert [R] int32, each expert's run padded with P to a multiple of
    BM; the expert of each block of BM [R / BM] int32; the padded total [1] int32; tokens per expert [E] int64),
    R = P + min(P, E) (BM - 1) rounded up to BM. Each expert's pairs keep their token order."""
    flat = ids.reshape(-1)
    p = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # [P] pairs by expert
    expert_of = flat[order]
    rank = torch.arange(p, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    rows = -(-(p + min(p, num_experts) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((rows,), p, dtype=torch.int32, device=ids.device)
    sorted_ids[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    starts = torch.arange(0, rows, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32), counts


if triton is not None:

    @triton.jit
    def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, sorted_ptr, block_expert_ptr, total_ptr, weight_ptr,
                         num_pairs, N, K, stride_am, stride_we, stride_wn, stride_cm,
                         A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """C[pair, :N] = A[pair // A_ROW_DIV] @ W[e]^T (x the pair's routing weight) for the block's pairs."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        valid = pairs < num_pairs
        a_rows = (pairs // A_ROW_DIV).to(tl.int64)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = ns < N
        w_base = w_ptr + e * stride_we + ns.to(tl.int64)[None, :] * stride_wn  # [1, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_mask[None, :],
                        other=0.0)  # [BM, BK]
            w = tl.load(w_base + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
            if a.dtype == tl.float32:  # (not TF32: float32 experts keep float32 products, as the torch loop)
                acc += tl.dot(a, w, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc += tl.dot(a, w.to(a.dtype), out_dtype=tl.float32)
        if MUL_WEIGHT:
            acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
        out = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + ns[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, plan: tuple, row_div: int,
          weights: torch.Tensor | None) -> None:
    sorted_ids, block_expert, total, _ = plan
    n, k = w.shape[1], w.shape[2]
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](a, w, c, sorted_ids, block_expert, total, c if weights is None else weights,
                           c.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
                           A_ROW_DIV=row_div, MUL_WEIGHT=weights is not None,
                           BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, activation) -> tuple:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token: x [T, Dm], ids / weights [T, k],
    gate_up [E, 2I, Dm], down [E, Dm, I], activation: [P, 2I] -> [P, I] (silu(gate) * up) -> ([T, Dm] in x's
    dtype, tokens per expert [E] int64 on x's device)."""
    t, top_k = ids.shape
    if t == 0:
        return x.new_zeros(x.shape), torch.zeros(gate_up.shape[0], dtype=torch.int64, device=x.device)
    x = x.contiguous()
    plan = align_by_expert(ids, gate_up.shape[0])
    h = x.new_empty(t * top_k, gate_up.shape[1])
    _gemm(x, gate_up, h, plan, top_k, None)
    act = activation(h).contiguous()
    y = x.new_empty(t * top_k, down.shape[1])
    _gemm(act, down, y, plan, 1, weights.reshape(-1).contiguous())
    return y.view(t, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype), plan[3]
