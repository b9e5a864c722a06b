"""What a hardware spec holds (HardwareSpec): peak dense FLOP/s per dtype, memory bandwidth and capacity,
from vendor datasheets.

Conventions (every spec follows them, so that predictions are comparable):
- `peak_flops[dtype]` is the dense matmul peak (no 2:4 sparsity). NVIDIA datasheets print the
  with-sparsity figure with an asterisk; the dense figure is half of it. "float32" is plain FP32
  (CUDA cores), not TF32: PyTorch leaves TF32 matmul off by default. "fp8" (FP8 e4m3 inputs, the
  matmul of FP8 weights with activations rounded to FP8 per token: vLLM's `--quantization fp8`) is there only
  where the part has FP8 tensor cores.
- `memory_bandwidth` is bytes/s from the vendor's decimal GB/s or TB/s (1 GB/s = 1e9 B/s).
- `memory_bytes` is the capacity in the unit the vendor prints. NVIDIA and AMD print "GB" and we take
  it as 1e9 bytes; the physical HBM is larger (an "80GB" part shows ~80 GiB in nvidia-smi), so plans
  made against these numbers are slightly conservative.
- `step_overhead_s` / `layer_overhead_s` / `seq_overhead_s`: time the runtime spends per step, per
  layer and per sequence (row) of the step outside the roofline (kernel launches, Python, each
  sequence's scheduling, tensors' rows, sample and bookkeeping). Zero for datasheet specs; the local
  probe measures them on the engine, an engine may calibrate them (see `HardwareSpec.replace`) and
  the cost model adds them to every step.
- `linear_rates`: {weight dtype: [[rows M, weight bytes per second], ...]}, how fast the engine's own
  linear-layer kernels get through their weights at M rows (measured by the local probe, empty for
  datasheet specs). A matmul of few rows is neither at the bandwidth nor at the peak: the cost model
  takes the slower of the roofline and this measured rate (`kernel_seconds` of an op).
- `decode_attention_flops`: {activation dtype: FLOP/s} of the engine's paged decode-attention
  kernel with its data in cache (measured by the local probe): one query per sequence against its
  cached keys does a few FLOPs per byte and reaches a fraction of the matmul peak.
- `packed_gemm_flops` (local probe only): FLOP/s of the engine's integer GEMM over group-32 packed
  weights (int4, int8-g32, a GGUF's Q4_0 / Q4_1 / Q8_0) with float32 activations, which it rounds to int8
  per 32-block and multiplies with int8 dot products: faster than the float32 matmul peak on CPUs with
  VNNI. 0: not measured (the cost model prices those matmuls at the activation dtype's peak).
- `kernel_tables` (local probe only): the engine's kernels timed at a model's own shapes and dtypes
  (analysis/kernel_table.py); where one matches a step's model, it prices the linear layers, attention
  and the small per-layer ops instead of the peaks and the rates above.
- `probed_bandwidth` / `spot_bandwidth` (a cached local probe only): the bandwidth the probe measured and
  a spot check's taken when the cached spec was read (analysis/bandwidth.py); `memory_bandwidth` is the
  one that prices the steps (the spot figure where the two differ beyond the tolerance). 0: no spot
  check (a fresh probe, a datasheet).
- `kernel_path` / `slow_dtypes` (local probe only): which CPU kernels were measured (their ISA), and
  the dtypes whose matmul is emulated here (bfloat16 without bf16 instructions: ~500x slower).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from servescope.errors import InvalidParameterError

LOCAL_CPU = "local-cpu"  # the name of the spec the local probe measures

DTYPES = ("float32", "bfloat16", "float16", "int8")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
FP8 = "fp8"  # a peak only parts with FP8 tensor cores have (Hopper, Ada, MI300): optional in peak_flops



@dataclass(frozen=True)
class HardwareSpec:
    """What one accelerator (or the local CPU) can do, as the cost model sees it."""

    name: str
    kind: str  # "gpu" or "cpu"
    peak_flops: dict = field(default_factory=dict)  # dtype -> dense FLOP/s
    memory_bandwidth: float = 0.0  # bytes/s
    memory_bytes: int = 0
    notes: str = ""
    source: str = ""
    step_overhead_s: float = 0.0  # added once per step
    layer_overhead_s: float = 0.0  # added once per decoder layer per step
    seq_overhead_s: float = 0.0  # added once per sequence (row the cost model is handed) per step
    linear_rates: dict = field(default_factory=dict)  # weight dtype -> [[M, weight bytes/s], ...], M ascending
    decode_attention_flops: dict = field(default_factory=dict)  # activation dtype -> FLOP/s of decode attention
    packed_gemm_flops: float = 0.0  # FLOP/s of the integer GEMM over group-32 packed weights (float32 activations)
    # whether that GEMM also multiplies bfloat16 rows at every row count (a local CPU whose kernels take their
    # integer panel GEMM, not AMX: model/linears/packed.group32_max_rows); else bfloat16 rows price as bfloat16
    packed_gemm_bfloat16: bool = False
    probed_bandwidth: float = 0.0  # bytes/s the cached probe measured, beside a spot check (0: none taken)
    spot_bandwidth: float = 0.0  # bytes/s of the spot check (the recent samples' median) when the probe was read
    kernel_path: str = ""  # the CPU kernel path the probe measured ("avx2", "avx512 C++ kernels"); "" for datasheets
    slow_dtypes: list = field(default_factory=list)  # dtypes with no fast matmul here (never picked by default)
    # table key -> analysis/kernel_table.KernelTable as a dict: the engine's kernels timed at one model's
    # shapes (local probe only; measure/shape_kernels.py)
    kernel_tables: dict = field(default_factory=dict)

    def linear_rate(self, weight_dtype: str, rows: int):
        """Weight bytes/s of the measured linear kernel at `rows` rows (log-log interpolation between
        measured points), or None outside the measured range or without a table for the dtype."""
        pts = self.linear_rates.get(weight_dtype)
        if not pts or rows < pts[0][0] or rows > pts[-1][0]:
            return None
        for (m0, r0), (m1, r1) in zip(pts, pts[1:]):
            if m0 <= rows <= m1:
                if m1 == m0:
                    return float(r0)
                f = math.log(rows / m0) / math.log(m1 / m0)
                return float(math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0))))
        return float(pts[0][1])  # a single-point table

    def __post_init__(self):
        if self.kind not in ("gpu", "cpu"):
            raise InvalidParameterError("hardware", f"kind must be 'gpu' or 'cpu', got {self.kind!r}")
        missing = [d for d in DTYPES if d not in self.peak_flops]
        if missing:
            raise InvalidParameterError("hardware", f"{self.name}: peak_flops lacks {', '.join(missing)}")
        if any(v <= 0 for v in self.peak_flops.values()) or self.memory_bandwidth <= 0 or self.memory_bytes <= 0:
            raise InvalidParameterError("hardware", f"{self.name}: peaks, bandwidth and memory must be positive")
        if min(self.step_overhead_s, self.layer_overhead_s, self.seq_overhead_s) < 0:
            raise InvalidParameterError("hardware", f"{self.name}: overheads must be >= 0")
        for dt, pts in self.linear_rates.items():
            ms = [p[0] for p in pts]
            if not pts or any(m < 1 for m in ms) or ms != sorted(ms) or any(p[1] <= 0 for p in pts):
                raise InvalidParameterError("hardware", f"{self.name}: linear_rates[{dt!r}] must be "
                                            "[[M >= 1, bytes/s > 0], ...] with M ascending")
        if min(self.probed_bandwidth, self.spot_bandwidth) < 0:
            raise InvalidParameterError("hardware", f"{self.name}: probed and spot bandwidths must be >= 0")
        if self.packed_gemm_flops < 0:
            raise InvalidParameterError("hardware", f"{self.name}: packed_gemm_flops must be >= 0")
        if any(v <= 0 for v in self.decode_attention_flops.values()):
            raise InvalidParameterError("hardware", f"{self.name}: decode_attention_flops must be positive")

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for matmuls whose inputs are `dtype`."""
        if dtype == FP8 and dtype not in self.peak_flops:
            raise InvalidParameterError("dtype", f"{self.name} has no FP8 tensor cores (fp8 weights need Hopper, "
                                                 "Ada or MI300): use int8 or bfloat16 weights")
        if dtype not in self.peak_flops:
            raise InvalidParameterError("dtype", f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        return float(self.peak_flops[dtype])

    def ridge_point(self, dtype: str) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound."""
        return self.flops(dtype) / self.memory_bandwidth

    def replace(self, **kw) -> "HardwareSpec":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
