"""Triton kernels for the paged KV cache: the KV store and the paged-attention decode.

Shape legend:
  T  tokens in the step, B sequences (one query token each in decode)
  H  query heads, Hkv KV heads, G = H / Hkv query heads per KV head, D head dim
  N  KV blocks in the cache, S block size (tokens per block), M blocks per sequence
  P  split-K partitions of one sequence's context (flash-decoding)

Both kernels are safe under CUDA graph capture: their grids depend only on shapes that are
fixed for a captured batch size (T, B, Hkv, P), never on a context length read from the
device. The decode kernel loops over the sequence's own blocks up to context_lens[b].

Written for Triton 3.x (tested with the interpreter, TRITON_INTERPRET=1, on CPU). Every load
is converted to float32 before arithmetic: the dot products use tf32 for 16-bit caches, which
is exact for bf16/fp16 inputs (their mantissas fit in tf32's), and IEEE fp32 for fp32 caches,
so a float32 model matches the reference to rounding.

A quantised cache (int8 / float8 e4m3, model/attention/kv_quant.py) is [N, S, Hkv, D + 4]: each row's
float32 scale after its D values. The store quantises each (token, head) row as it writes it; the
decode multiplies each loaded K / V tile by its rows' scales (IEEE float32 dot products: a dequantised
value needs float32's mantissa), so the cache is never dequantised as a whole.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Decode programs per SM we aim for before splitting a sequence's context (split-K).
_TARGET_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 32
# A split shorter than this costs more in its reduce than it gains in parallelism.
_MIN_TOKENS_PER_SPLIT = 256

_sm_count_cache: dict = {}
# quantised cache dtypes -> the largest value a scaled row may take (kv_quant.QMAX; the kernels are below model/)
_QMAX = {torch.int8: 127.0, **({torch.float8_e4m3fn: 448.0} if hasattr(torch, "float8_e4m3fn") else {})}


# --------------------------------------------------------------------------------------------
# KV store: k, v [T, Hkv, D] -> k_cache, v_cache [N, S, Hkv, D] at slot_mapping[T]
# --------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cslot, stride_ch,  # cache strides of one slot and one KV head (same for K and V)
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: N * S * Hkv * D can pass 2**31
    e = tl.arange(0, BLOCK)  # flat index over this token's Hkv * D features
    h = e // HEAD_DIM
    d = e % HEAD_DIM
    # slot -1 marks a padded row of a CUDA graph: nothing is written
    mask = (e < NUM_KV_HEADS * HEAD_DIM) & ((e * 0 + slot) >= 0)
    dst = slot * stride_cslot + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_row_store(x_ptr, stride_xt, stride_xh, cache_ptr, t, dst_row, h, d, mask, QMAX: tl.constexpr,
                        IS_INT8: tl.constexpr, HEAD_DIM: tl.constexpr):
    # x [Hkv, D] of token t -> per head: values x / s and s = absmax / QMAX after them (kv_quant.py's rows)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=mask, other=0.0).to(tl.float32)  # [Hkv, D]
    s = tl.max(tl.abs(x), 1) / QMAX  # [Hkv]
    y = x / tl.where(s > 0, s, 1.0)[:, None]
    if IS_INT8:
        # round half to even as torch.round: adding and removing 1.5 * 2**23 leaves the nearest integer (|y| <= 127)
        y = (y + 12582912.0) - 12582912.0
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(cache_ptr + dst_row[:, None] + d, y.to(cache_ptr.dtype.element_ty), mask=mask)
    scale_ptr = (cache_ptr + dst_row + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scale_ptr, s, mask=tl.max(mask.to(tl.int32), 1) > 0)


@triton.jit
def _store_kv_quant_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cslot, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HKV_PAD: tl.constexpr, D_PAD: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, HKV_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & ((d * 0 + slot) >= 0)  # slot -1: a padded graph row
    dst_row = slot * stride_cslot + tl.arange(0, HKV_PAD) * stride_ch  # [Hkv] start of each head's row
    _quantize_row_store(k_ptr, stride_kt, stride_kh, k_cache_ptr, t, dst_row, h, d, mask, QMAX, IS_INT8, HEAD_DIM)
    _quantize_row_store(v_ptr, stride_vt, stride_vh, v_cache_ptr, t, dst_row, h, d, mask, QMAX, IS_INT8, HEAD_DIM)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into k_cache, v_cache [N, S, Hkv, D] at slot_mapping [T]
    (slot = block * S + offset; a negative slot is skipped); a quantised cache ([..., D + 4]) gets
    each row's values and scale."""
    t, hkv, d = k.shape
    if t == 0:
        return
    _check_cache(k_cache)
    _check_cache(v_cache)
    assert k.stride(2) == 1 and v.stride(2) == 1, "k and v must be contiguous in the head dim"
    assert k_cache.stride() == v_cache.stride()
    if k_cache.dtype in _QMAX:
        _store_kv_quant_kernel[(t,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=hkv, HEAD_DIM=d, HKV_PAD=triton.next_power_of_2(hkv), D_PAD=triton.next_power_of_2(d),
            QMAX=_QMAX[k_cache.dtype], IS_INT8=k_cache.dtype == torch.int8,
        )
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK=triton.next_power_of_2(hkv * d),
    )


# --------------------------------------------------------------------------------------------
# Paged decode: q [B, H, D] over each sequence's cached keys -> out [B, H, D]
# --------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): finite for every x (e^2x = inf gives 1, 0 gives -1); portable to the interpreter
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    window,  # > 0: only the sequence's last `window` positions are read (a sliding layer); 0: all of them
    softcap_log2,  # SOFTCAP: the soft-cap * log2(e); each base-2 score s becomes softcap_log2 * tanh(s / softcap_log2)
    sinks_ptr,  # SINKS: [H] one more logit per query head in the softmax, its value row dropped
    stride_qb, stride_qh,
    stride_cn, stride_cs, stride_ch,  # cache [N, S, Hkv, D] strides (D stride 1); K and V share them
    stride_bt,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    # one program: sequence b, KV head kvh (all its G query heads), context partition `split`
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(context_lens_ptr + b)
    # the visible positions [first, ctx) are cut into NUM_SPLITS ranges of whole BLOCK_N tiles
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    tiles_per_split = tl.cdiv(tl.cdiv(ctx - first, BLOCK_N), NUM_SPLITS)
    lo = first + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + g  # [G]: the query heads that share this KV head
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    # padded rows (g >= G) load q = 0: their scores are 0, harmless, and never stored
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [G, D]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)  # running sum of p * v

    bt_row = block_tables_ptr + b * stride_bt
    for start in range(lo, hi, BLOCK_N):
        tok = start + n  # [BLOCK_N] token positions; a tile may span several cache blocks
        t_mask = tok < hi
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = blk * stride_cn + (tok % BLOCK_SIZE) * stride_cs + kvh * stride_ch  # [BLOCK_N]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        if QUANT:  # each row's float32 scale sits after its D values
            k = k * tl.load((k_cache_ptr + row + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True),
                            mask=t_mask, other=0.0)[:, None]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G, BLOCK_N]
        if SOFTCAP:
            s = softcap_log2 * _tanh(s / softcap_log2)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the tile has at least one valid token
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        if QUANT:
            v = v * tl.load((v_cache_ptr + row + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True),
                            mask=t_mask, other=0.0)[:, None]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)  # [G, D]
        m_i = m_new

    if NUM_SPLITS == 1:
        if SINKS:  # the sink's logit joins the denominator (its row has no value): rescale to the new max
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)  # 0 for an empty context (m_i = -inf)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
        # an empty context (a padded CUDA-graph row) yields zeros, not NaN
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # partials [B, H, P, D_PAD] and [B, H, P]; an empty partition stores m = -inf, l = 0
        base = (b * NUM_HEADS + heads) * NUM_SPLITS + split  # [G]
        tl.store(part_acc_ptr + base[:, None] * D_PAD + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_m_ptr + base, m_i, mask=g_mask)
        tl.store(part_l_ptr + base, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, SINKS: tl.constexpr,
):
    # one program: sequence b, query head h; combines the P partial softmaxes
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    p_mask = p < NUM_SPLITS
    base = (b * NUM_HEADS + h) * NUM_SPLITS
    m = tl.load(part_m_ptr + base + p, mask=p_mask, other=float("-inf"))
    part_sum = tl.load(part_l_ptr + base + p, mask=p_mask, other=0.0)
    sink = tl.full([], float("-inf"), tl.float32)  # no sink: weight exp2(-inf) = 0
    if SINKS:  # the sink's logit (base 2) joins the softmax after the partitions merge
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
    m_max = tl.maximum(tl.max(m, 0), sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every partition empty: weights 0
    w = tl.exp2(m - m_max)  # [P]; exp2(-inf) = 0 for empty partitions
    total = tl.sum(part_sum * w, 0) + tl.exp2(sink - m_max)
    acc = tl.load(part_acc_ptr + (base + p)[:, None] * D_PAD + d[None, :], mask=p_mask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); a nominal 8 elsewhere."""
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count_cache:
        _sm_count_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count_cache[idx]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Split-K partitions: enough programs to fill the GPU at small batch, none when the batch
    fills it, and never partitions shorter than _MIN_TOKENS_PER_SPLIT tokens of max_context_len.
    Depends only on host values, so a captured graph keeps its grid."""
    programs = max(1, num_seqs * num_kv_heads)
    want = triton.cdiv(_TARGET_PROGRAMS_PER_SM * num_sms(device), programs)
    by_len = triton.cdiv(max(1, max_context_len), _MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(want, by_len, _MAX_SPLITS)))


def check_paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     sinks: Optional[torch.Tensor]) -> tuple:
    """The checks the paged decode and prefill kernels share: (block size, KV heads, quantised cache, sinks made
    contiguous or None)."""
    h, d = q.shape[1], q.shape[2]
    _check_cache(k_cache)
    _check_cache(v_cache)
    assert k_cache.stride() == v_cache.stride()
    _, s, hkv, dk = k_cache.shape
    quant = k_cache.dtype in _QMAX
    assert dk == d + (4 if quant else 0) and h % hkv == 0, (
        f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    assert q.stride(2) == 1, "q must be contiguous in the head dim"
    assert block_tables.stride(1) == 1
    if sinks is not None:
        assert sinks.shape == (h,) and sinks.device == q.device, f"sinks {tuple(sinks.shape)} for {h} heads"
        sinks = sinks.contiguous()
    return s, hkv, quant, sinks


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, max_context_len: int,
                 out: Optional[torch.Tensor] = None, num_splits: Optional[int] = None,
                 num_warps: int = 4, window: int = 0, softcap: float = 0.0,
                 sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, D] (one query token per sequence); caches [N, S, Hkv, D]; block_tables [B, M]
    int32; context_lens [B] int32 (0 allowed: the row's output is zeros) -> out [B, H, D] in
    q's dtype. max_context_len is a host-side upper bound used only to size split-K. num_warps:
    of the main kernel (at head dim 128, 4 warps use 255 registers and spill 84 bytes on sm_90,
    8 do not spill; benchmarks/gpu.py times both). window > 0: each row reads its last `window`
    positions only (a sliding layer). softcap > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2);
    sinks [H]: one more logit per query head in the softmax whose value row is dropped (gpt-oss); both as
    model/attention/scores.attend defines them."""
    bsz, h, d = q.shape
    s, hkv, quant, sinks = check_paged_args(q, k_cache, v_cache, block_tables, sinks)
    if out is None:
        out = torch.empty_like(q)
    if bsz == 0:
        return out
    group = h // hkv
    d_pad = triton.next_power_of_2(d)
    if num_splits is None:
        visible = min(max_context_len, window) if window else max_context_len
        num_splits = choose_num_splits(bsz, hkv, visible, q.device)
    block_n = max(triton.next_power_of_2(s), 64 if d_pad <= 128 else 32)
    precision = "ieee" if k_cache.dtype == torch.float32 or quant else "tf32"
    if num_splits > 1:
        # sized by (B, H, P) only: allocations inside a CUDA graph capture are static
        part_acc = torch.empty((bsz, h, num_splits, d_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((bsz, h, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty((bsz, h, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_m = part_l = out  # unused: NUM_SPLITS == 1 writes out directly
    _paged_decode_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_acc, part_m, part_l,
        scale * 1.4426950408889634, int(window), float(softcap) * 1.4426950408889634,
        q if sinks is None else sinks,  # an unused pointer when there are no sinks
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=h, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=s, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, PRECISION=precision, QUANT=quant,
        SOFTCAP=bool(softcap), SINKS=sinks is not None,
        num_warps=num_warps,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(bsz, h)](
            out, part_acc, part_m, part_l, q if sinks is None else sinks, out.stride(0), out.stride(1),
            NUM_HEADS=h, HEAD_DIM=d, D_PAD=d_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), SINKS=sinks is not None,
            num_warps=4,
        )
    return out


def _check_cache(cache: torch.Tensor) -> None:
    n, s, hkv, d = cache.shape
    # the kernels address a slot as slot * stride(1): blocks must be laid out back to back
    assert cache.stride(3) == 1 and cache.stride(0) == s * cache.stride(1), \
        f"the KV cache must be contiguous over [S, Hkv, D] per block, got strides {cache.stride()}"
