"""Reference attention in plain PyTorch: runs everywhere, is the oracle in tests, and serves what the
faster backends leave to it (the CPU backend's steps without the C++ extension; cpu.py).

A quantised cache (int8, fp8: kv_quant.py) is read by gathering and dequantising only the blocks a step
reads; every key comes from the cache, a prompt's own included.

Shape legend: T tokens, B sequences, H query heads, Hkv KV heads, D head dim,
N blocks, S block size, M blocks per sequence, L context length.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from servescope.model.attention import kv_quant
from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.attention.scores import attend


class TorchAttentionBackend(AttentionBackend):
    name = "torch"  # the attention_backend setting that selects it (config/engine.py)

    def store_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        if kv_quant.is_quantized(k_cache.dtype):
            kv_quant.store(k, v, k_cache, v_cache, meta.slot_mapping)
            return
        n, s, hkv, d = k_cache.shape
        # [N, S, Hkv, D] -> [N*S, Hkv, D]: a slot is block * S + offset
        k_cache.view(n * s, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(n * s, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        nd = meta.num_decode_seqs
        out = torch.empty_like(q)
        if nd:
            # decodes come first in the flat layout: tokens [0, nd) are one query each
            out[:nd] = self._paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                          meta.context_lens[:nd], max(meta.context_lens_cpu[:nd]), scale,
                                          meta.scratch, window, softcap, sinks)
        self._attend_prefills(q, k, v, k_cache, v_cache, meta, scale, out, window, softcap, sinks)
        return out

    @staticmethod
    def _attend_prefills(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out,
                         window: int = 0, softcap: float = 0.0, sinks=None, skip=()) -> None:
        """The sequences after the decodes (tokens from num_decode_seqs on), each a causal attention of
        its new tokens over its cached keys (the last `window` of them per query when window > 0), written
        into out [T, H, D]; those in `skip` left as they are (another kernel wrote them). softcap, sinks:
        scores.attend's."""
        mods = dict(softcap=softcap, sinks=sinks)
        start = meta.num_decode_seqs
        for i in range(start, meta.num_seqs):
            qlen = meta.query_lens_cpu[i]
            ctx = meta.context_lens_cpu[i]
            if i in skip:
                start += qlen
                continue
            qi = q[start:start + qlen]  # [q, H, D]
            if ctx == qlen and not kv_quant.is_quantized(k_cache.dtype) and not (window and qlen > window):
                # nothing cached before: causal attention over this step's own k, v (a quantised cache is
                # read instead, so that a prompt sees the same keys whether it runs in one step or in chunks)
                out[start:start + qlen] = _sdpa(qi, k[start:start + qlen], v[start:start + qlen], scale, causal=True,
                                                **mods)
            else:
                key = ("prefill", i, window)
                if key not in meta.scratch:
                    meta.scratch[key] = _prefill_keys(ctx, qlen, k_cache.shape[1], meta.block_tables[i], window,
                                                      q.device)
                blocks, lo, hi, mask = meta.scratch[key]
                # [nblk, S, Hkv, D] -> [nblk*S, Hkv, D] -> the keys the chunk sees, [L, Hkv, D]
                ki = kv_quant.gather(k_cache, blocks, q.dtype).flatten(0, 1)[lo:hi]
                vi = kv_quant.gather(v_cache, blocks, q.dtype).flatten(0, 1)[lo:hi]
                out[start:start + qlen] = _sdpa(qi, ki, vi, scale, mask=mask, **mods)
            start += qlen

    @staticmethod
    def _paged_decode(q, k_cache, v_cache, block_tables, context_lens, max_ctx: int, scale: float,
                      scratch: dict | None = None, window: int = 0, softcap: float = 0.0, sinks=None):
        b, h, d = q.shape
        s = k_cache.shape[1]
        key = ("decode", window)
        cached = scratch.get(key) if scratch is not None else None
        if cached is None:
            cached = _decode_keys(block_tables, context_lens, max_ctx, s, window)
            if scratch is not None:
                scratch[key] = cached
        tables, mask = cached
        # [B, M, S, Hkv, D] -> [B, M*S, Hkv, D]
        keys = kv_quant.gather(k_cache, tables, q.dtype).flatten(1, 2)
        vals = kv_quant.gather(v_cache, tables, q.dtype).flatten(1, 2)
        hkv = keys.shape[2]
        # q [B, H, D] -> [B, Hkv, H/Hkv, D]; keys [B, L, Hkv, D] -> [B, Hkv, L, D]
        qg = q.view(b, hkv, h // hkv, d)
        kt = keys.permute(0, 2, 1, 3)
        vt = vals.permute(0, 2, 1, 3)
        if softcap or sinks is not None:  # q as [B, H, 1, D]: one query per head
            return attend(q[:, :, None], kt, vt, scale, mask, softcap, sinks).reshape(b, h, d)
        with _sdpa_backends(q.device):
            o = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask, scale=scale)  # [B, Hkv, H/Hkv, D]
        return o.reshape(b, h, d)


def _prefill_keys(ctx: int, qlen: int, s: int, table, window: int, device) -> tuple:
    """(block ids, slice start, slice end, mask [q, L]) of a chunk of qlen queries ending at position ctx - 1:
    the blocks from the one holding the first key any query of the chunk sees (0, or the first query's
    position - window + 1), the slice of their keys up to ctx, and the causal (and window) mask."""
    first = max(0, ctx - qlen - window + 1) if window else 0
    b0 = first // s
    blocks = table[b0:(ctx + s - 1) // s].long()
    kpos = torch.arange(first, ctx, device=device)[None, :]  # [1, L]
    qpos = torch.arange(ctx - qlen, ctx, device=device)[:, None]  # [q, 1]: query j sits at ctx - qlen + j
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    return blocks, first - b0 * s, ctx - b0 * s, mask


def _decode_keys(block_tables, context_lens, max_ctx: int, s: int, window: int) -> tuple:
    """(block ids [B, M], mask [B, 1, 1, M*S]) of a decode step: each sequence's blocks from the one holding
    its first visible key (position ctx - window, or 0), so that blocks that slid out of the window (and
    may have been freed) are never read."""
    dev = block_tables.device
    nblk = (max_ctx + s - 1) // s
    if not window:
        tables = block_tables[:, :nblk].long()  # [B, M]
        valid = torch.arange(nblk * s, device=dev)[None, :] < context_lens[:, None]  # [B, M*S]
        return tables, valid[:, None, None, :]
    lens = context_lens.long()
    lo = (lens - window).clamp(min=0)  # [B] first visible position
    m = min(nblk, (window + s - 1) // s + 1)  # blocks a window can touch
    idx = (lo // s)[:, None] + torch.arange(m, device=dev)[None, :]  # [B, M] block index in each table
    tables = block_tables.long().gather(1, idx.clamp(max=block_tables.shape[1] - 1))
    pos = (idx[:, :, None] * s + torch.arange(s, device=dev)).flatten(1)  # [B, M*S] absolute positions
    valid = (pos >= lo[:, None]) & (pos < lens[:, None])
    return tables, valid[:, None, None, :]


def _sdpa(q, k, v, scale, causal=False, mask=None, softcap: float = 0.0, sinks=None):
    """q [q, H, D], k, v [L, Hkv, D] -> [q, H, D]; grouped-query heads via enable_gqa (scores.attend where
    the scores are soft-capped or meet sinks: SDPA has neither)."""
    # [q, H, D] -> [1, H, q, D]; [L, Hkv, D] -> [1, Hkv, L, D]
    qt = q.transpose(0, 1)[None]
    kt = k.transpose(0, 1)[None]
    vt = v.transpose(0, 1)[None]
    if softcap or sinks is not None:
        if mask is None:  # causal over the chunk's own keys (L == q)
            mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        return attend(qt, kt, vt, scale, mask, softcap, sinks)[0].transpose(0, 1)
    with _sdpa_backends(q.device):
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None,
                                           scale=scale, enable_gqa=kt.shape[1] != qt.shape[1])
    return o[0].transpose(0, 1)  # [1, H, q, D] -> [q, H, D]


_GPU_BACKENDS = None


def _sdpa_backends(device: torch.device):
    """On CUDA, keep SDPA off cuDNN: it builds an execution plan for every new sequence length
    (on an H200 that made a long batched prefill step many times slower: docs/BENCHMARKS.md)."""
    global _GPU_BACKENDS
    if device.type != "cuda":
        return contextlib.nullcontext()
    if _GPU_BACKENDS is None:
        _GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(_GPU_BACKENDS)
