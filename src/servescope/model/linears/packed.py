"""Weight-only 4- and 8-bit linears kept packed in memory, and the embedding that reads the same form.

The packed form (csrc/quant_gemv.h says it byte by byte): along K the weight is cut into blocks of 32,
a group of 32, 64, 128 or all of K shares one float16 scale d (and an offset m when asymmetric):
  int4  uint8 [N, Kp/2], byte j of a block = element j (low nibble) | element j + 16 (high nibble);
        symmetric d * (u - 8) (GGUF Q4_0), asymmetric d * u + m (GGUF Q4_1)
  int8  int8 [N, Kp]; symmetric d * q (GGUF Q8_0), asymmetric d * q + m
  scales float16 [N, G] (symmetric) | [N, G, 2] (asymmetric: d, m)
Kp is K rounded up to the group (the padding is zeros). GGUF's Q4_0 / Q4_1 / Q8_0 blocks are these very
bytes with their scales moved out (loader/gguf_packed.py), so a GGUF runs from its own blocks.

QuantLinear: decode-sized calls (up to MAX_ROWS rows) go to the C++ GEMV over the packed blocks. Larger
ones (prefill) with group-32 scales (int4, int8-g32, every GGUF block type) and float32 activations run
the integer GEMM (csrc/quant_gemm.h): the activations rounded to int8 per 32-block, as the GEMV already
does at decode and llama.cpp does for its Q4_0 / Q8_0 prefill, so a row's result does not depend on how
many rows share the call, and the int8 dot products do ~2x the float32 GEMM's work per cycle. The other
groups, and bfloat16 activations (whose AMX / BF16 GEMM is faster still), dequantise the matrix and
run the float GEMM, which is compute-bound there anyway. On the CPU the dequantisation is C++, parallel
over rows, written straight in the activation dtype (bfloat16 for a bfloat16 model: no float32 copy in
between) into a per-thread scratch buffer that is reused, up to
TILE_ELEMENTS weights at a time, and the GEMM is oneDNN's on that plain buffer (torch's default float32
GEMM, MKL, costs ~1.25x as much CPU time on the Zen 4; docs/BENCHMARKS.md, issue 15 section). On a GPU decode-sized
calls go to the Triton GEMV over the same bytes (kernels/triton_quant.py); the rest, and a CPU without
the extension, dequantise with torch.

Precision: a float32 model with packed weights keeps float32 activations everywhere except inside the
group-32 products, which round them to int8 per block (decode and prefill alike: one arithmetic, the
accuracy table of docs/BENCHMARKS.md measures it); it is not moved to bfloat16, even on a CPU whose
bfloat16 dot products would be faster: that is a precision change the user did not ask for. Asking
for it is `dtype="bfloat16"` (the CLI's `--dtype auto` picks it on such a CPU), which runs the whole
model, the prefill GEMM included, in bfloat16.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servescope.kernels.cpu import ops as cpu_ops
from servescope.quant import search as quant_search
from servescope.kernels.cpu.linear import onednn_linear

BLOCK = 32
GROUPS = (32, 64, 128)
# Up to how many rows the packed GEMV runs; above, dequantise + GEMM (docs/BENCHMARKS.md)
MAX_ROWS = 8
GPU_MAX_ROWS = 8  # likewise on a GPU, the Triton GEMV's (triton_quant.MAX_M)
# The most weights the prefill path dequantises for one GEMM call (16 MiB of float32): every projection
# of a small model in one piece, a large model's matrices and a big vocabulary's head in row tiles
TILE_ELEMENTS = 1 << 22
_EMPTY = torch.empty(0)


@dataclass(frozen=True)
class QuantScheme:
    """bits 4 | 8; group 32 | 64 | 128 | None (None: one group per row, "per channel"); asym: with an offset."""

    bits: int
    group: int | None = 32
    asym: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"quantization bits must be 4 or 8, got {self.bits}")
        if self.group is not None and self.group not in GROUPS:
            raise ValueError(f"quantization group must be one of {GROUPS} or per-channel, got {self.group}")

    def padded_k(self, k: int) -> int:
        g = self.group or BLOCK
        return -(-k // g) * g

    def bits_per_weight(self, k: int) -> float:
        """Stored bits per weight of a row of length k, scales included."""
        kp = self.padded_k(k)
        groups = kp // (self.group or kp)
        return (kp * self.bits + groups * 16 * (2 if self.asym else 1)) / k


def quantize(w: torch.Tensor, scheme: QuantScheme, importance=None) -> tuple:
    """w [N, K] float -> (packed weight, float16 scales) in the form above. importance: None, or each
    input's mean squared activation on calibration data [K] (servescope quantize --method imatrix): the
    search then weighs each weight's error by it, as llama.cpp's imatrix quantisation does
    (kernels/quant_search.importance_weights), over its fuller candidate sets.

    Each group's scale (and offset) is searched for, as llama.cpp's quantisers do (ggml-quants.c
    make_qx_quants, make_qkx2_quants): for a few candidate scales around the plain rule (symmetric int4:
    the value of largest magnitude maps to -8, GGUF Q4_0's; int8: amax / 127; asymmetric: min / max),
    the integers, then the least-squares scale (and offset) for those integers; the candidate of least
    squared error is kept and refitted once on its own nearest integers. The integers stored are the
    nearest for the float16 scale and offset stored. An asymmetric group keeps the plain rule where that
    is no worse, so a group already on a 4-bit asymmetric grid (Q4_1 data) comes back exactly. Rows go
    in chunks of SEARCH_ELEMENTS weights (the temporaries: a few MiB)."""
    n, k = w.shape
    kp = scheme.padded_k(k)
    g = scheme.group or kp
    w = w.detach()
    rows = max(1, SEARCH_ELEMENTS // kp)
    if importance is not None:
        importance = F.pad(importance.detach().float().reshape(k), (0, kp - k))
    q = torch.empty(n, kp, dtype=torch.uint8 if scheme.bits == 4 else torch.int8)
    scales = torch.empty(n, kp // g, *((2,) if scheme.asym else ()), dtype=torch.float16)
    for r0 in range(0, n, rows):
        part = w[r0:r0 + rows]
        x = F.pad(part.float(), (0, kp - k)).view(part.shape[0], kp // g, g)
        qi, scales[r0:r0 + rows] = quant_search.quantize_group_rows(x, k, scheme, importance)
        q[r0:r0 + rows] = qi.view(part.shape[0], kp)
    packed = _pack_nibbles(q) if scheme.bits == 4 else q
    return packed.contiguous(), scales.contiguous()


SEARCH_ELEMENTS = 1 << 18  # weights per chunk of rows: 1 MiB of float32 per temporary, cache-sized


def _pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    n, kp = u.shape
    b = u.view(n, kp // BLOCK, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, kp // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The stored integers [N, Kp] (int4: 0..15) as int16."""
    if packed.dtype == torch.int8:
        return packed.to(torch.int16)
    n = packed.shape[0]
    b = packed.view(n, -1, 16).to(torch.int16)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(n, -1)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, k: int, dtype=torch.float32) -> torch.Tensor:
    """The packed matrix as [N, k] floats (torch only: the reference, and the path off the CPU)."""
    q = unpack(packed).to(dtype)
    n, kp = q.shape
    groups = scales.shape[1]
    q = q.view(n, groups, kp // groups)
    if scales.dim() == 3:
        w = q * scales[..., 0, None].to(dtype) + scales[..., 1, None].to(dtype)
    elif packed.dtype == torch.uint8:
        w = (q - 8) * scales[..., None].to(dtype)
    else:
        w = q * scales[..., None].to(dtype)
    return w.reshape(n, kp)[:, :k]


def gemv_activations(x: torch.Tensor, kp: int, group: int) -> tuple:
    """What the C++ GEMV multiplies x [M, K] with, in float64, and each element's rounding bound: with
    group-32 scales, x rounded per 32-block to int8 as csrc/quant_dot.h does (float32 d = amax / 127,
    q = x / d rounded half to even); with other groups x itself (quant_gemv.h). The tests' reference."""
    if group != BLOCK:
        return x.double(), torch.zeros_like(x, dtype=torch.float64)
    m, k = x.shape
    xb = F.pad(x.float(), (0, kp - k)).view(m, kp // BLOCK, BLOCK)
    d = xb.abs().amax(dim=2, keepdim=True) / 127.0
    q = torch.round(xb * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))).clamp(-127, 127)
    xa = (q.double() * d.double()).view(m, kp)[:, :k]
    return xa, (d.double() / 2).expand_as(xb).reshape(m, kp)[:, :k]


def _triton_quant():
    """kernels/triton_quant.py where Triton runs (a GPU), else None."""
    from servescope.kernels.triton import quant as triton_quant  # lazy: importing triton is ~90 ms a CPU never needs

    return triton_quant if triton_quant.AVAILABLE else None


def _cpu_kernels(x: torch.Tensor):
    mod = cpu_ops.load() if x.device.type == "cpu" else None
    return mod


class QuantLinear(torch.nn.Module):
    """A linear over packed weights. float_output: the GEMV's float32 result is returned as it is
    (the output head: logits are float32)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, in_features: int, bias=None,
                 float_output: bool = False):
        super().__init__()
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales)
        self.in_features, self.out_features = in_features, packed.shape[0]
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self._bias_f32 = None if bias is None else bias.detach().float()
        self._bias_cast = None  # the bias in the prefill GEMM's dtype, when that is not its own
        self.float_output = float_output
        kp = packed.shape[1] * (2 if packed.dtype == torch.uint8 else 1)
        self.group32 = kp == scales.shape[1] * BLOCK  # one scale per 32-block: the integer GEMM's form

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, scheme: QuantScheme, float_output: bool = False):
        packed, scales = quantize(linear.weight, scheme)
        return cls(packed, scales, linear.in_features, linear.bias, float_output)

    @property
    def bits(self) -> int:
        return 4 if self.qweight.dtype == torch.uint8 else 8

    def weight_bytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        mod = _cpu_kernels(x2)
        if mod is not None and x2.shape[0] <= MAX_ROWS:
            y = mod.quant_gemv(x2, self.qweight, self.scales, _opt(self._bias_f32))
            y = y if self.float_output else y.to(x.dtype)
        elif x2.is_cuda and x2.shape[0] <= GPU_MAX_ROWS and _triton_quant() is not None:
            bias = None if self.bias is None else self.bias.float()
            y = _triton_quant().quant_gemv(x2, self.qweight, self.scales, self.in_features, bias)
            y = y if self.float_output else y.to(x.dtype)
        elif mod is not None and x2.dtype == torch.float32 and self.group32:
            y = mod.quant_gemm(x2, self.qweight, self.scales, _opt(self._bias_f32))
        elif mod is not None and x2.dtype in (torch.float32, torch.bfloat16):
            y = self._prefill(mod, x2.contiguous())
        else:
            w = dequantize(self.qweight, self.scales, self.in_features, x.dtype)
            y = F.linear(x2, w, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def _prefill(self, mod, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] float32 | bfloat16 -> [M, N] in its dtype: row tiles of the weight dequantised into
        the scratch buffer, each multiplied by oneDNN (F.linear where oneDNN is missing)."""
        n, k = self.out_features, self.in_features
        rows = max(1, min(n, TILE_ELEMENTS // k))
        bias = self._bias_as(x2.dtype)
        buf = _scratch(rows * k, x2.dtype)
        if rows == n:  # one tile: the GEMM's result is the output
            mod.quant_dequantize_into(self.qweight, self.scales, 0, buf.view(n, k))
            return _gemm(x2, buf.view(n, k), bias)
        y = torch.empty(x2.shape[0], n, dtype=x2.dtype)
        for n0 in range(0, n, rows):
            r = min(rows, n - n0)
            w = buf[: r * k].view(r, k)
            mod.quant_dequantize_into(self.qweight, self.scales, n0, w)
            y[:, n0:n0 + r] = _gemm(x2, w, None if bias is None else bias[n0:n0 + r])
        return y

    def _bias_as(self, dtype: torch.dtype):
        if self.bias is None or self.bias.dtype == dtype:
            return self.bias
        if self._bias_cast is None or self._bias_cast.dtype != dtype:
            self._bias_cast = self.bias.detach().to(dtype)
        return self._bias_cast

    def plan_entry(self) -> tuple:
        """For the C++ DecodePlan (see CpuLinear.plan_entry): its `gemv` routes float16-scaled packed
        weights to the packed GEMV, so the plan serves decode steps up to MAX_ROWS rows."""
        return [self.qweight, self.scales, _opt(self._bias_f32), _EMPTY, _EMPTY, _EMPTY], (MAX_ROWS, 0), MAX_ROWS


class QuantEmbedding(torch.nn.Module):
    """An embedding table in the packed form (a GGUF's token_embd, shared with a tied QuantLinear
    head): the looked-up rows are dequantised, nothing else."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, dim: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales)
        self.embedding_dim, self.num_embeddings, self.dtype = dim, packed.shape[0], dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(self.qweight[flat], self.scales[flat], self.embedding_dim, torch.float32)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)


def _opt(t):
    return _EMPTY if t is None else t


HUGE_PAGE = 2 << 20


def move_to_huge_pages(modules) -> int:
    """Copy the packed weights and scales of `modules` (QuantLinear / QuantEmbedding, in the order the
    decode step reads them) into one anonymous mapping advised MADV_HUGEPAGE, and point the modules at
    views of it. Decode streams these bytes once per token, and on 4 KiB pages each 4 KiB is a new TLB
    entry; 2 MiB pages (Linux's transparent huge pages, granted to a mapping that asks where THP is
    `madvise` or `always`) take 512x fewer (the effect on decode speed is not yet measured on a quiet
    machine: docs/BENCHMARKS.md, issue 15). A buffer shared by two modules (a tied GGUF embedding and
    head) stays shared. Returns the bytes moved: 0 off the CPU, where the OS has no
    MADV_HUGEPAGE, or with nothing to move."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    def key(t):  # the same tensor (a shared buffer), not merely the same first byte
        return t.data_ptr(), t.dtype, tuple(t.shape)

    found = {}  # key -> tensor, first use first
    for mod in modules:
        for name in ("qweight", "scales"):
            t = getattr(mod, name)
            if t.device.type == "cpu" and t.is_contiguous() and t.numel():
                found.setdefault(key(t), t)
    if advice is None or not found:
        return 0
    offsets, size = {}, 0
    for ptr, t in found.items():
        offsets[ptr] = size
        size += -(-t.numel() * t.element_size() // 64) * 64
    # private: a shared anonymous mapping is shmem, whose huge pages follow another setting (often off)
    # whole huge pages from an aligned start (the unaligned head of the mapping is never touched)
    arena = mmap.mmap(-1, -(-size // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(advice)
    flat = torch.frombuffer(arena, dtype=torch.uint8)  # keeps `arena` alive as long as any view
    start = -flat.data_ptr() % HUGE_PAGE  # the weights begin on a huge-page boundary
    moved = {}
    for ptr, t in found.items():
        nbytes = t.numel() * t.element_size()
        view = flat[start + offsets[ptr]:start + offsets[ptr] + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        moved[ptr] = view
    for mod in modules:
        for name in ("qweight", "scales"):
            t = getattr(mod, name)
            if key(t) in moved:
                setattr(mod, name, moved[key(t)])
    return size


_SCRATCH = threading.local()  # per thread: {dtype: flat buffer}, grown to the largest tile asked for


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


_ONEDNN = {}  # dtype -> whether oneDNN's linear runs here (probed once)


def _gemm(x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias) with oneDNN's linear on the plain weight, else F.linear."""
    ok = _ONEDNN.get(x.dtype)
    if ok is None:
        try:
            onednn_linear(x[:1], w[:1])
            ok = torch.backends.mkldnn.is_available()
        except (RuntimeError, AttributeError, NotImplementedError):
            ok = False
        _ONEDNN[x.dtype] = ok
    return onednn_linear(x, w, bias) if ok else F.linear(x, w, bias)
