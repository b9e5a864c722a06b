"""Reference attention in plain PyTorch: runs everywhere, is the oracle in tests.

On the CPU, store_kv and the decode rows go to the C++ kernels of cpu_ops.py when they are built
(one call each instead of ~10 eager ops per layer); in bfloat16 the prefill tokens do too (each token
a query of the paged kernel); SERVESCOPE_CPU_KERNELS=0 keeps the torch code. A quantised cache (int8,
fp8: kv_quant.py) goes to the same C++ kernels, which quantise on store and dequantise a tile at a time
on read; the torch code dequantises only the blocks it gathers, and reads every key from the cache, a
prompt's own included.

Shape legend: T tokens, B sequences, H query heads, Hkv KV heads, D head dim,
N blocks, S block size, M blocks per sequence, L context length.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention import kv_quant
from servescope.model.attention.backend import AttentionBackend, AttentionMetadata


# A bfloat16 step whose prefill sequences are all short (below TILED_PREFILL_MIN_TOKENS, or heads the
# tiled kernel does not cover) runs every token through the paged decode kernel up to this context;
# beyond it SDPA's flash kernel is faster (measured here: a 2048-token prompt took 2.73 s that way against 2.5 s with
# SDPA, while the offline-throughput workload's prompts of 32-512 tokens ran their attention 1.6x faster;
# per 9-head prompt: 95-104 GFLOP/s against SDPA's 51-68 at 128-512 tokens, a tie at 1024). float32 keeps SDPA:
# there the kernel is no faster (47-69 against 41-97 GFLOP/s)
PAGED_PREFILL_MAX_CONTEXT = 1024
# bfloat16 prefill sequences of at least this many tokens in the step go to the tiled causal kernel
# (csrc/prefill_attention.cpp; 16 tokens per item; GQA groups 1-8, head dims 64/128): 1.2-1.4x the
# per-token path above at 128-2048 tokens and 1.25-1.7x SDPA on SmolLM2's heads, 2.5-3.6x SDPA with
# enable_gqa at Llama-3 / Qwen2 head layouts; 0.8x the per-token path at 64 (2026-11-30, 2 threads)
TILED_PREFILL_MIN_TOKENS = 128


def _cpu_kernels(x: torch.Tensor, cache: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in cpu_ops.DTYPES and cache.dtype in cpu_ops.KV_DTYPES
            and cpu_ops.load() is not None)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        if _cpu_kernels(k, k_cache) and v.dtype in cpu_ops.DTYPES:
            cpu_ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            return
        if kv_quant.is_quantized(k_cache.dtype):
            kv_quant.store(k, v, k_cache, v_cache, meta.slot_mapping)
            return
        n, s, hkv, d = k_cache.shape
        # [N, S, Hkv, D] -> [N*S, Hkv, D]: a slot is block * S + offset
        k_cache.view(n * s, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(n * s, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decode_seqs
        if (nd < meta.num_seqs and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
                and _cpu_kernels(q, k_cache)):
            out = self._cpu_bf16_with_prefill(q, k_cache, v_cache, meta, scale)
            if out is not None:
                return out
        cpu = nd and _cpu_kernels(q, k_cache)
        if cpu and nd == meta.num_seqs:  # decode only: the kernel's output is the result
            return cpu_ops.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        out = torch.empty_like(q)
        if cpu:
            cpu_ops.paged_decode(q[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, scale, out=out[:nd])
        elif nd:
            # decodes come first in the flat layout: tokens [0, nd) are one query each
            out[:nd] = self._paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                          meta.context_lens[:nd], max(meta.context_lens_cpu[:nd]), scale,
                                          meta.scratch)
        start = nd
        for i in range(nd, meta.num_seqs):
            qlen = meta.query_lens_cpu[i]
            ctx = meta.context_lens_cpu[i]
            qi = q[start:start + qlen]  # [q, H, D]
            if ctx == qlen and not kv_quant.is_quantized(k_cache.dtype):
                # nothing cached before: causal attention over this step's own k, v (a quantised cache is
                # read instead, so that a prompt sees the same keys whether it runs in one step or in chunks)
                out[start:start + qlen] = _sdpa(qi, k[start:start + qlen], v[start:start + qlen], scale, causal=True)
            else:
                key = ("prefill", i)
                if key not in meta.scratch:
                    nblk = (ctx + k_cache.shape[1] - 1) // k_cache.shape[1]
                    blocks = meta.block_tables[i, :nblk].long()
                    # query j sits at position ctx - qlen + j and sees keys 0 .. ctx - qlen + j
                    qpos = torch.arange(ctx - qlen, ctx, device=q.device)
                    mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [q, ctx]
                    meta.scratch[key] = (blocks, mask)
                blocks, mask = meta.scratch[key]
                # [nblk, S, Hkv, D] -> [nblk*S, Hkv, D] -> [ctx, Hkv, D]
                ki = kv_quant.gather(k_cache, blocks, q.dtype).flatten(0, 1)[:ctx]
                vi = kv_quant.gather(v_cache, blocks, q.dtype).flatten(0, 1)[:ctx]
                out[start:start + qlen] = _sdpa(qi, ki, vi, scale, mask=mask)
            start += qlen
        return out

    @classmethod
    def _cpu_bf16_with_prefill(cls, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """A bfloat16 step with prefill tokens on the CPU (this layer's K/V already in the cache:
        store_kv runs first): prefill sequences of TILED_PREFILL_MIN_TOKENS or more through the tiled
        causal kernel, every other token (decodes, short chunks) as one query of the paged decode
        kernel. None: leave the step to SDPA (no tiled kernel for these heads and contexts beyond
        PAGED_PREFILL_MAX_CONTEXT). The split is the same for every layer: worked out once per step."""
        split = meta.scratch.get("cpu_bf16_split")
        if split is None:
            split = meta.scratch["cpu_bf16_split"] = cls._bf16_prefill_split(q, k_cache, meta)
        if split is None:
            return None
        long, rest, rest_idx, starts = split
        if not long:
            return cls._cpu_paged_tokens(q, k_cache, v_cache, meta, scale, rest)
        out = torch.empty_like(q)
        if rest:
            out[rest_idx] = cls._cpu_paged_tokens(q[rest_idx], k_cache, v_cache, meta, scale, rest)
        for i in long:
            out[starts[i]:starts[i + 1]] = cpu_ops.prefill_attention(q[starts[i]:starts[i + 1]], k_cache, v_cache,
                                                                     meta.block_tables[i], meta.context_lens_cpu[i],
                                                                     scale)
        return out

    @staticmethod
    def _bf16_prefill_split(q, k_cache, meta: AttentionMetadata):
        """(sequences for the tiled kernel, the others, the others' token indices, token starts per
        sequence), or None for SDPA."""
        tiled = cpu_ops.prefill_attention_supported(q.shape[1] // k_cache.shape[2], q.shape[2])
        qlens = meta.query_lens_cpu
        long = [i for i in range(meta.num_decode_seqs, meta.num_seqs) if tiled and qlens[i] >= TILED_PREFILL_MIN_TOKENS]
        if not long and meta.max_context_len > PAGED_PREFILL_MAX_CONTEXT:
            return None
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        taken = set(long)
        rest = [i for i in range(meta.num_seqs) if i not in taken]
        rest_idx = None
        if long and rest:
            rest_idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rest]).to(q.device)
        return long, rest, rest_idx, starts

    @staticmethod
    def _cpu_paged_tokens(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, seqs) -> torch.Tensor:
        """The tokens of sequences `seqs` (q holds exactly those, in order), each as one query of the
        paged decode kernel against its own sequence's cached keys up to its own position. That is
        causal attention, exact per token whatever the chunking; the kernel's bfloat16 pair products
        run at ~100 GFLOP/s here against ~50 for SDPA's bfloat16 kernel on prompts of a few hundred
        tokens."""
        key = ("cpu_tokens", tuple(seqs))
        cached = meta.scratch.get(key)
        if cached is None:
            seq_of_tok, ctx_of_tok = [], []
            for i in seqs:
                qlen, ctx = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
                seq_of_tok += [i] * qlen
                ctx_of_tok += range(ctx - qlen + 1, ctx + 1)  # token j of the chunk sees keys 0 .. its position
            idx = torch.tensor(seq_of_tok, device=q.device, dtype=torch.long)
            cached = (meta.block_tables[idx].contiguous(), torch.tensor(ctx_of_tok, dtype=torch.int32, device=q.device))
            meta.scratch[key] = cached
        tables, lens = cached
        return cpu_ops.paged_decode(q, k_cache, v_cache, tables, lens, scale)

    @staticmethod
    def _paged_decode(q, k_cache, v_cache, block_tables, context_lens, max_ctx: int, scale: float,
                      scratch: dict | None = None):
        b, h, d = q.shape
        s = k_cache.shape[1]
        nblk = (max_ctx + s - 1) // s
        cached = scratch.get("decode") if scratch is not None else None
        if cached is None:
            tables = block_tables[:, :nblk].long()  # [B, M]
            valid = torch.arange(nblk * s, device=q.device)[None, :] < context_lens[:, None]  # [B, M*S]
            cached = (tables, valid[:, None, None, :])  # mask [B, 1, 1, M*S]
            if scratch is not None:
                scratch["decode"] = cached
        tables, mask = cached
        # [B, M, S, Hkv, D] -> [B, M*S, Hkv, D]
        keys = kv_quant.gather(k_cache, tables, q.dtype).flatten(1, 2)
        vals = kv_quant.gather(v_cache, tables, q.dtype).flatten(1, 2)
        hkv = keys.shape[2]
        # q [B, H, D] -> [B, Hkv, H/Hkv, D]; keys [B, L, Hkv, D] -> [B, Hkv, L, D]
        qg = q.view(b, hkv, h // hkv, d)
        kt = keys.permute(0, 2, 1, 3)
        vt = vals.permute(0, 2, 1, 3)
        with _sdpa_backends(q.device):
            o = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask, scale=scale)  # [B, Hkv, H/Hkv, D]
        return o.reshape(b, h, d)


def _sdpa(q, k, v, scale, causal=False, mask=None):
    """q [q, H, D], k, v [L, Hkv, D] -> [q, H, D]; grouped-query heads via enable_gqa."""
    # [q, H, D] -> [1, H, q, D]; [L, Hkv, D] -> [1, Hkv, L, D]
    qt = q.transpose(0, 1)[None]
    kt = k.transpose(0, 1)[None]
    vt = v.transpose(0, 1)[None]
    with _sdpa_backends(q.device):
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None,
                                           scale=scale, enable_gqa=kt.shape[1] != qt.shape[1])
    return o[0].transpose(0, 1)  # [1, H, q, D] -> [q, H, D]


_GPU_BACKENDS = None


def _sdpa_backends(device: torch.device):
    """On CUDA, keep SDPA off cuDNN: it builds an execution plan for every new sequence length
    (measured on an H200: a 30-sequence 8192-token prefill step took 4.9 s instead of ~0.1 s)."""
    global _GPU_BACKENDS
    if device.type != "cuda":
        return contextlib.nullcontext()
    if _GPU_BACKENDS is None:
        _GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(_GPU_BACKENDS)
