"""Triton paged prefill attention: each prefill chunk's queries over its sequence's keys in the paged cache.

Shape legend:
  T  tokens in the step (flat, no padding), B sequences in the launch
  H  query heads, Hkv KV heads, G = H / Hkv query heads per KV head, D head dim
  N  KV blocks in the cache, S block size, M blocks per sequence
  Q  queries of one program (BLOCK_Q), R = Q * G_PAD rows of its score tile, BLOCK_N keys per tile

Flash-attention with an online softmax over varlen sequences in one launch: program (tile, kvh, b)
takes queries [tile * Q, tile * Q + Q) of sequence b (its tokens at query_start_loc[b] in the flat
T) and all G query heads of KV head kvh, stacked as the R rows of one score tile, so each key tile is
loaded once for the whole group. Query i of a chunk of L queries sits at position ctx - L + i
(ctx = context_lens[b], counted after the step); it sees keys max(0, pos - window + 1) .. pos.

Every key is read from the cache through the block table, the chunk's own too (the step stores them
before attention: backend.py), so a chunk sees the same keys whether its prompt ran in one step or
in pieces, quantised or not. The key loop covers only the positions some query of the tile sees:
from its first query's window start to its last query's position, the tiles that every query sees
without a mask (16-bit products). Programs past their sequence's chunk return at once; the longest
tiles start first. The grid comes from host values (B, the longest chunk), never a device read.

Arithmetic: float32 queries as the decode kernel (attention.py): float32 loads, IEEE dot products, a
quantised row times its scale. 16-bit queries multiply in their dtype with float32 accumulation (the
tensor cores' path, as SDPA's flash kernel), over a cache of their dtype or a quantised cache's rows
dequantised in float32 and rounded to it (as the reference's gather), the probabilities rounded to it
before the P.V product. Soft-caps and sinks as scores.attend.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from servescope.kernels.triton.attention import _tanh, check_paged_args

_LOG2E = 1.4426950408889634


@triton.jit
def _load_kv(cache_ptr, row, d, kv_mask, t_mask, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
             NATIVE: tl.constexpr):
    # [BLOCK_N, D_PAD] rows of a K or V tile: a 16-bit cache's as stored (NATIVE), else float32 (times each
    # row's scale when quantised)
    x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if QUANT or not NATIVE:
        x = x.to(tl.float32)
    if QUANT:  # each row's float32 scale sits after its D values
        x = x * tl.load((cache_ptr + row + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True),
                        mask=t_mask, other=0.0)[:, None]
    return x


@triton.jit
def _attend_keys(acc, m_i, l_i, q, qpos, lo, hi, window, scale_log2, softcap_log2,
                 k_cache_ptr, v_cache_ptr, bt_row, kvh, stride_cn, stride_cs, stride_ch, d, d_mask, n,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 QUANT: tl.constexpr, NATIVE: tl.constexpr, SOFTCAP: tl.constexpr, MASK: tl.constexpr):
    # the online softmax over keys [lo, hi) in tiles of BLOCK_N -> (acc, m_i, l_i) updated. MASK: keys past hi,
    # after a row's position or before its window are dropped; without it [lo, hi) is whole tiles every row sees
    for start in range(lo, hi, BLOCK_N):
        tok = start + n  # [BLOCK_N] key positions; a tile may span several cache blocks
        t_mask = tok < hi
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        kv_row = blk * stride_cn + (tok % BLOCK_SIZE) * stride_cs + kvh * stride_ch  # [BLOCK_N]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = _load_kv(k_cache_ptr, kv_row, d, kv_mask, t_mask, HEAD_DIM, QUANT, NATIVE)
        if NATIVE:  # a quantised row, dequantised in float32, rounded to the queries' dtype as the reference does
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [R, BLOCK_N] float32
        if SOFTCAP:
            s = softcap_log2 * _tanh(s / softcap_log2)
        if MASK:
            seen = t_mask[None, :] & (tok[None, :] <= qpos[:, None])
            seen = seen & ((window <= 0) | (tok[None, :] > qpos[:, None] - window))
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: weights 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv(v_cache_ptr, kv_row, d, kv_mask, t_mask, HEAD_DIM, QUANT, NATIVE)
        if NATIVE:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [R, D]
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr, out_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    window,  # > 0: a query at position p sees keys p - window + 1 .. p only; 0: all up to p
    softcap_log2,  # SOFTCAP: the soft-cap * log2(e)
    sinks_ptr,  # SINKS: [H] one more logit per query head in the softmax, its value row dropped
    stride_qt, stride_qh,
    stride_cn, stride_cs, stride_ch,  # cache [N, S, Hkv, D] strides (D stride 1); K and V share them
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, QUANT: tl.constexpr, NATIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tiles, the longest key loops, start first
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + b)
    qlen = tl.load(query_start_ptr + b + 1) - q_begin
    if tile * BLOCK_Q >= qlen:  # this sequence's chunk is shorter than the longest one
        return
    ctx = tl.load(context_lens_ptr + b)

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)  # rows: query i = r // GROUP_PAD of the tile, head g = r % GROUP_PAD
    qi = tile * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    heads = kvh * GROUP + g
    row_mask = (qi < qlen) & (g < GROUP)
    qpos = ctx - qlen + qi  # [R] absolute positions
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < HEAD_DIM
    io_off = (q_begin + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + io_off, mask=io_mask, other=0.0)  # [R, D]; padded rows 0, never stored
    if not NATIVE:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], tl.float32)  # running sum of p * v

    first_q = ctx - qlen + tile * BLOCK_Q  # position of the tile's first query
    hi = tl.minimum(first_q + BLOCK_Q, ctx)  # one past the last key any query of the tile sees
    lo = tl.where(window > 0, tl.maximum(first_q - window + 1, 0), 0)
    bt_row = block_tables_ptr + b * stride_bt
    cache = (k_cache_ptr, v_cache_ptr, bt_row, kvh, stride_cn, stride_cs, stride_ch)
    if NATIVE:
        # keys [lo, a): the window's edge (some queries see them, some not); [a, c): whole tiles that every query
        # of the tile sees, unmasked; [c, hi): the causal diagonal. Each key is read once. (Float32 products keep
        # one masked loop: three copies of theirs spill registers on sm_90.)
        a = tl.where(window > 0, tl.minimum(tl.maximum(hi - window, lo), first_q + 1), lo)  # hi - 1: the last query
        c = a + (first_q + 1 - a) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, qpos, lo, a, window, scale_log2, softcap_log2, *cache, d,
                                     d_mask, n, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, QUANT, NATIVE, SOFTCAP, True)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, qpos, a, c, window, scale_log2, softcap_log2, *cache, d,
                                     d_mask, n, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, QUANT, NATIVE, SOFTCAP, False)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, qpos, c, hi, window, scale_log2, softcap_log2, *cache, d,
                                     d_mask, n, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, QUANT, NATIVE, SOFTCAP, True)
    else:
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, qpos, lo, hi, window, scale_log2, softcap_log2, *cache, d,
                                     d_mask, n, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, QUANT, NATIVE, SOFTCAP, True)

    if SINKS:  # the sink's logit joins the denominator (its row has no value): rescale to the new max
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_begin + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_tiles(group: int, head_dim: int, native: bool) -> tuple:
    """(BLOCK_Q, BLOCK_N) for a GQA group and head dim: BLOCK_Q queries of the group's padded heads make the score
    tile's rows. 16-bit products: 64 rows against 64 keys (32 against 32 past a head dim of 128); float32 ones
    hold twice the registers per value: 32 rows against 32 keys (16 rows past 128). Each compiles for sm_90 at 4 warps
    without register spills (tests/model/test_triton_compile_sm90.py; 64 x 64 in float32 spills 17 KB at D 64)."""
    d_pad = triton.next_power_of_2(head_dim)
    if native:
        rows, block_n = (64, 64) if d_pad <= 128 else (32, 32)
    else:
        rows, block_n = (32 if d_pad <= 128 else 16), 32
    return max(1, rows // triton.next_power_of_2(group)), block_n


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                  out: Optional[torch.Tensor] = None, window: int = 0, softcap: float = 0.0,
                  sinks: Optional[torch.Tensor] = None, num_warps: int = 4,
                  tiles: Optional[tuple] = None) -> torch.Tensor:
    """q [T, H, D]; caches [N, S, Hkv, D] (the step's keys already stored; [..., D + 4] quantised);
    block_tables [B, M] int32; context_lens [B] int32 (after the step); query_start_loc [B + 1] int32: rows
    query_start_loc[b] .. query_start_loc[b + 1] of q are sequence b's chunk, its last keys. Rows of q
    outside every chunk are not written. max_query_len: a host-side bound of the chunks (sizes the grid).
    -> out [T, H, D] in q's dtype. window, softcap, sinks: as paged_decode. tiles: (BLOCK_Q, BLOCK_N)
    in place of prefill_tiles' (BLOCK_Q * next_power_of_2(G) >= 16, BLOCK_N >= 16)."""
    t, h, d = q.shape
    s, hkv, quant, sinks = check_paged_args(q, k_cache, v_cache, block_tables, sinks)
    bsz = block_tables.shape[0]
    assert context_lens.shape == (bsz,) and query_start_loc.shape == (bsz + 1,)
    if out is None:
        out = torch.empty_like(q)
    if bsz == 0 or t == 0 or max_query_len <= 0:
        return out
    group = h // hkv
    group_pad = triton.next_power_of_2(group)
    # 16-bit queries multiply 16-bit operands: their own dtype's cache, or a quantised one's rows dequantised
    native = q.dtype in (torch.bfloat16, torch.float16) and (quant or q.dtype == k_cache.dtype)
    # Triton 3.x's interpreter (CPU tensors) multiplies bfloat16 dot operands' bit patterns as if they were
    # integers: there bfloat16 goes through float32 (float16 operands, the same code path, are tested there)
    native &= not (q.device.type == "cpu" and q.dtype == torch.bfloat16)
    block_q, block_n = tiles or prefill_tiles(group, d, native)
    assert block_q * group_pad >= 16 and block_n >= 16, "a score tile needs at least 16 rows and 16 keys (tl.dot)"
    precision = "tf32" if native else "ieee"  # tf32: unused by 16-bit operands; ieee: float32 ones, exactly
    _paged_prefill_kernel[(triton.cdiv(max_query_len, block_q), hkv, bsz)](
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
        scale * _LOG2E, int(window), float(softcap) * _LOG2E,
        q if sinks is None else sinks,  # an unused pointer when there are no sinks
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d),
        BLOCK_SIZE=s, BLOCK_Q=block_q, BLOCK_N=block_n,
        PRECISION=precision, QUANT=quant, NATIVE=native,
        SOFTCAP=bool(softcap), SINKS=sinks is not None,
        num_warps=num_warps,
    )
    return out
