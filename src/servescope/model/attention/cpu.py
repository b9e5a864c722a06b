"""The CPU attention backend: the C++ kernels of kernels/cpu/ops.py where they serve, the reference's
torch code (reference.py) for the rest.

store_kv and the decode rows go to the C++ kernels when they are built (one call each instead of ~10
eager ops per layer); in bfloat16 the prefill tokens do too (each token a query of the paged kernel, or
long prompts through the tiled causal kernel). A quantised cache (int8, fp8: kv_quant.py) goes to the
same C++ kernels, which quantise on store and dequantise a tile at a time on read. Where the extension
is not built (SERVESCOPE_CPU_KERNELS=0, no compiler; read at each call, so it is never waited for at
start-up) or the tensors are of a kind the kernels do not take, every call is the reference's.

Shape legend: T tokens, B sequences, H query heads, Hkv KV heads, D head dim,
N blocks, S block size, M blocks per sequence, L context length.
"""

from __future__ import annotations

import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention.backend import AttentionMetadata
from servescope.model.attention.reference import TorchAttentionBackend

# A bfloat16 step whose prefill sequences are all short (below TILED_PREFILL_MIN_TOKENS, or heads the
# tiled kernel does not cover) runs every token through the paged decode kernel up to this context;
# beyond it SDPA's flash kernel is faster, below it the paged kernel (docs/BENCHMARKS.md has the
# measurements by prompt length). float32 keeps SDPA: there the kernel is no faster
PAGED_PREFILL_MAX_CONTEXT = 1024
# bfloat16 prefill sequences of at least this many tokens in the step go to the tiled causal kernel
# (csrc/prefill_attention.cpp; 16 tokens per item; GQA groups 1-8, head dims 64/128): faster than the
# per-token path above and than SDPA from this many tokens on, slower below (docs/BENCHMARKS.md)
TILED_PREFILL_MIN_TOKENS = 128
# float32 prefill sequences of at least this many tokens in the step go to the tiled kernel (prefill_f32.h), the
# rest to SDPA: on AVX-512 it beat SDPA 1.3-2.4x from 32-64 tokens on at the Llama-3.2-1B / 3B heads, about even
# or slower at 16 (benchmarks/prefill_attention_f32.py, docs/BENCHMARKS.md)
TILED_F32_MIN_TOKENS = 32
# the kernel paths that take them, and up to what context (None: any). The AVX2 build (8 tokens per item, 16
# registers: twice the broadcasts per FMA) beat SDPA up to ~1k keys and lost beyond (0.7-0.9x at 2048 on a Zen 4);
# NEON and the scalar build are not routed (unmeasured; SDPA is vectorised there): the kernel is tested on them
TILED_F32_MAX_CONTEXT = {"avx512": None, "avx2": 1024}


def _cpu_kernels(x: torch.Tensor, cache: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in cpu_ops.DTYPES and cache.dtype in cpu_ops.KV_DTYPES
            and cpu_ops.load() is not None)



def paged_tokens_beat_attend(group: int, head_dim: int) -> bool:
    """Whether prefill rows with soft-capped scores or sinks run faster as one query each of the paged decode
    kernel (the query heads of a KV head share each key and value read; nothing of size [H, q, L] is held) than
    through scores.attend (BLAS over the chunk's materialised scores). Measured on the Xeon (one thread, 512
    queries over 1024 keys, float32 / bfloat16; benchmarks/score_mods_prefill.py): paged 2.2-4.4x faster at
    group 8-16 of head dim 64 (gpt-oss: 64 heads, 8 KV), 1.6-2.3x at group 8 of 128 and group 4 of 64; about
    even (0.7-1.3x, run to run) at group 4 of 128 and group 2 of 64; 3-8x slower at group 2 of 256 (Gemma 2: 8
    heads, 4 KV, dim 256), whose wide heads BLAS reuses better. Either is exact per row."""
    return head_dim <= 16 * group

class CpuAttentionBackend(TorchAttentionBackend):
    # the attention_backend setting that selects it on a CPU (config/engine.py): the executor's C++
    # decode plan reads this backend's cache layout, which is the reference's
    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        if _cpu_kernels(k, k_cache) and v.dtype in cpu_ops.DTYPES:
            cpu_ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            return
        super().store_kv(k, v, k_cache, v_cache, meta)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        if not _cpu_kernels(q, k_cache):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks)
        # soft-capped scores and sinks: the decode rows in the paged kernel (it has both), prefill chunks too where
        # it beats the reference's scores.attend (paged_tokens_beat_attend), else the reference's (the bfloat16
        # prefill paths below compute softmax(q.k * scale) only)
        plain = not softcap and sinks is None
        nd = meta.num_decode_seqs
        if plain and nd < meta.num_seqs and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16:
            if window:  # every token one query of the paged kernel over its own window: O(window) per token
                return self._cpu_paged_tokens(q, k_cache, v_cache, meta, scale, range(meta.num_seqs), window)
            out = self._cpu_bf16_with_prefill(q, k_cache, v_cache, meta, scale)
            if out is not None:
                return out
        mods = dict(window=window, softcap=softcap, sinks=sinks)
        if not plain and nd < meta.num_seqs and paged_tokens_beat_attend(q.shape[1] // k_cache.shape[2], q.shape[2]):
            return self._cpu_paged_tokens(q, k_cache, v_cache, meta, scale, range(meta.num_seqs), **mods)
        if nd and nd == meta.num_seqs:  # decode only: the kernel's output is the result
            return cpu_ops.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, **mods)
        out = torch.empty_like(q)
        if nd:
            cpu_ops.paged_decode(q[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, scale, out=out[:nd],
                                 **mods)
        tiled = self._f32_tiled(q, k_cache, meta) if plain and not window else {}
        for i, (lo, hi) in tiled.items():
            out[lo:hi] = cpu_ops.prefill_attention(q[lo:hi], k_cache, v_cache, meta.block_tables[i],
                                                   meta.context_lens_cpu[i], scale)
        self._attend_prefills(q, k, v, k_cache, v_cache, meta, scale, out, skip=tiled, **mods)
        return out

    @staticmethod
    def _f32_tiled(q, k_cache, meta: AttentionMetadata) -> dict:
        """{sequence: (first token, end)} of a float32 step's prefill sequences the tiled kernel takes (at least
        TILED_F32_MIN_TOKENS of them, heads it covers, a float32 cache); worked out once per step."""
        tiled = meta.scratch.get("cpu_f32_tiled")
        if tiled is None:
            tiled = meta.scratch["cpu_f32_tiled"] = {}
            isa = cpu_ops.isa()
            if (q.dtype == torch.float32 and k_cache.dtype == torch.float32 and isa in TILED_F32_MAX_CONTEXT
                    and cpu_ops.prefill_attention_supported(q.shape[1] // k_cache.shape[2], q.shape[2], q.dtype)):
                most = TILED_F32_MAX_CONTEXT[isa] or float("inf")
                start = meta.num_decode_seqs
                for i in range(meta.num_decode_seqs, meta.num_seqs):
                    n = meta.query_lens_cpu[i]
                    if n >= TILED_F32_MIN_TOKENS and meta.context_lens_cpu[i] <= most:
                        tiled[i] = (start, start + n)
                    start += n
        return tiled

    def latent_decode(self, q, cache, meta: AttentionMetadata, scale: float, v_dim: int) -> torch.Tensor:
        """The C++ latent_decode where the kernels serve: the values read as the first v_dim features of each
        latent row (no second pass over the rope features), each output the full-width paged decode's own."""
        if not _cpu_kernels(q, cache):
            return super().latent_decode(q, cache, meta, scale, v_dim)
        return cpu_ops.latent_decode(q, cache, meta.block_tables, meta.context_lens, scale, v_dim)

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
    def _cpu_paged_tokens(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, seqs,
                          window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        """The tokens of sequences `seqs` (q holds exactly those, in order), each as one query of the
        paged decode kernel against its own sequence's cached keys up to its own position. That is
        causal attention (over the token's last `window` keys when window > 0), exact per token whatever the
        chunking; the kernel's bfloat16 pair products
        beat SDPA's bfloat16 kernel on prompts of a few hundred tokens (docs/BENCHMARKS.md)."""
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
        return cpu_ops.paged_decode(q, k_cache, v_cache, tables, lens, scale, window=window, softcap=softcap,
                                    sinks=sinks)
