"""The quantised KV cache (int8, fp8 e4m3): its layout, writing rows into it, reading them back.

Shape legend: T tokens, Hkv KV heads, D head dim, N blocks, S block size.

Layout: a cache of dtype int8 or float8_e4m3fn is [N, S, Hkv, D + 4]: for each position and KV head,
the D quantised values, then the 4 bytes of their float32 scale (value = q * scale). A float cache
stays [N, S, Hkv, D]. The dtype alone says which: every path that hands (k_cache, v_cache) on (block
tables, prefix caching, preemption, speculative rollback, the C++ decode plan, a TP shard's own heads)
carries the scales with the values and needs no new argument; the kernels read a row's scale right
after its values (kernels/cpu/csrc/kv_quant.h), as llama.cpp's q8_0 blocks keep theirs.

Scales per token and KV head, for int8 and fp8 alike: absmax / 127 (int8, symmetric, round half to
even) or absmax / 448 (e4m3's largest value). Why per token: a row is quantised once, when it is
written, from its own values only; nothing written later rescales it, and no calibration pass is
needed (a per-tensor fp8 scale would need one, or a rewrite of the cache when it grows). So the bytes
of a token's K/V do not depend on what else was in its step: greedy outputs stay the same under
batching, chunking and prefix caching. Cost: 4 bytes per row of D (SmolLM2, D 64: 68 bytes against
256 in float32, 3.76x the tokens in the same memory).

Every attention path reads all of a sequence's keys from the cache, its own step's included (the
prefill too): a prompt computed in one step or in chunks then sees the same quantised keys.
"""

from __future__ import annotations

import math
import mmap

import torch

SCALE_BYTES = 4  # one float32 per row
FP8 = getattr(torch, "float8_e4m3fn", None)  # None: a torch without float8 (fp8_e4m3 is refused at config)
QMAX = {torch.int8: 127.0, **({FP8: 448.0} if FP8 is not None else {})}
QUANT_DTYPES = tuple(QMAX)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def head_dim_of(cache: torch.Tensor) -> int:
    """D of a cache [N, S, Hkv, D (+ 4)]."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache.dtype) else 0)


def row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one position of one KV head: D values (and the scale of a quantised cache)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return head_dim * elem + (SCALE_BYTES if is_quantized(dtype) else 0)


def allocate(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """A zeroed cache [N, S, Hkv, D] ([..., D + 4] when quantised; zero bytes are the value 0, scale 0)."""
    if not is_quantized(dtype):
        return _zeroed((num_blocks, block_size, kv_heads, head_dim), dtype, device)
    if head_dim % SCALE_BYTES:
        raise ValueError(f"a quantised KV cache needs a head dim divisible by {SCALE_BYTES} (its rows' float32 "
                         f"scales must be aligned), got {head_dim}")
    return _zeroed((num_blocks, block_size, kv_heads, head_dim + SCALE_BYTES), torch.uint8, device).view(dtype)


def _zeroed(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU an anonymous mapping of its own: a large cache then comes as the kernel's
    zero pages, faulted in when a block is first written, instead of being memset at start-up (a second or
    so per GiB, for a run that may touch a few MiB of it), whatever the C allocator's settings
    (engine/host_memory.py moves large blocks onto the heap, where a calloc may clear them). Page-aligned."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)  # keeps `region` alive


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple:
    """x [T, Hkv, D] -> (values [T, Hkv, D] in dtype, scales [T, Hkv, 1] float32), per row (token, head).
    The C++ store (csrc/kv_quant.h quantize_row) does the same float32 arithmetic, in the same order:
    IEEE divisions (tensor by tensor: no reciprocal), clamping, then rounding half to even (int8) or
    e4m3's own rounding, so both write the same bytes."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)  # [T, Hkv, 1]
    qmax = QMAX[dtype]
    scale = amax / torch.full_like(amax, qmax)
    y = (xf / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-qmax, qmax)
    return (y.round().to(torch.int8) if dtype == torch.int8 else y.to(dtype)), scale


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[N, S, Hkv, D + 4] -> its bytes as [N*S, Hkv, D + 4] uint8: a slot's rows."""
    return cache.view(torch.uint8).view(-1, cache.shape[2], cache.shape[3])


def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """Quantise k, v [T, Hkv, D] into the caches at slot_mapping [T] (slot = block * S + offset)."""
    d = k.shape[-1]
    for x, cache in ((k, k_cache), (v, v_cache)):
        values, scale = quantize_rows(x, cache.dtype)
        rows = _rows(cache)
        rows[..., :d].index_copy_(0, slot_mapping, values.view(torch.uint8))
        rows[..., d:].view(torch.float32).index_copy_(0, slot_mapping, scale)


def dequantize(rows: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """rows [..., D + 4] uint8 of a `dtype` cache -> values [..., D] in out_dtype."""
    d = rows.shape[-1] - SCALE_BYTES
    values = rows[..., :d].view(dtype).float()
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (values * scale).to(out_dtype)


def gather(cache: torch.Tensor, index: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """cache[index] in out_dtype: [*index.shape, S, Hkv, D] (the blocks `index` names), dequantised
    when the cache is quantised: only the gathered blocks, never the whole cache."""
    if not is_quantized(cache.dtype):
        return cache[index].to(out_dtype)
    return dequantize(cache.view(torch.uint8)[index], cache.dtype, out_dtype)
