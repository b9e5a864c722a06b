"""Hardware specs: peak dense FLOP/s per dtype, memory bandwidth and capacity, from vendor datasheets.

Conventions (every spec follows them, so that predictions are comparable):
- `peak_flops[dtype]` is the dense matmul peak (no 2:4 sparsity). NVIDIA datasheets print the
  with-sparsity figure with an asterisk; the dense figure is half of it. "float32" is plain FP32
  (CUDA cores), not TF32: PyTorch leaves TF32 matmul off by default.
- `memory_bandwidth` is bytes/s from the vendor's decimal GB/s or TB/s (1 GB/s = 1e9 B/s).
- `memory_bytes` is the capacity in the unit the vendor prints. NVIDIA and AMD print "GB" and we take
  it as 1e9 bytes; the physical HBM is larger (an "80GB" part shows ~80 GiB in nvidia-smi), so plans
  made against these numbers are slightly conservative.
- `step_overhead_s` / `layer_overhead_s`: fixed time the runtime spends per step and per layer
  outside the roofline (kernel launches, Python). Zero for datasheet specs; an engine may calibrate
  them (see `HardwareSpec.replace`) and the cost model adds them to every step.
- `linear_rates`: {weight dtype: [[rows M, weight bytes per second], ...]}, how fast the engine's own
  linear-layer kernels get through their weights at M rows (measured by the local probe, empty for
  datasheet specs). A matmul of few rows is neither at the bandwidth nor at the peak: the cost model
  takes the slower of the roofline and this measured rate (`kernel_seconds` of an op).
- `decode_attention_flops`: {activation dtype: FLOP/s} of the engine's paged decode-attention
  kernel with its data in cache (measured by the local probe): one query per sequence against its
  cached keys does a few FLOPs per byte and reaches a fraction of the matmul peak.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from servescope.errors import InvalidParameterError

DTYPES = ("float32", "bfloat16", "float16", "int8")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}

_T = 1e12  # TFLOP/s or TB/s
_G = 1e9  # GB/s or GB


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
    linear_rates: dict = field(default_factory=dict)  # weight dtype -> [[M, weight bytes/s], ...], M ascending
    decode_attention_flops: dict = field(default_factory=dict)  # activation dtype -> FLOP/s of decode attention

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
        if self.step_overhead_s < 0 or self.layer_overhead_s < 0:
            raise InvalidParameterError("hardware", f"{self.name}: overheads must be >= 0")
        for dt, pts in self.linear_rates.items():
            ms = [p[0] for p in pts]
            if not pts or any(m < 1 for m in ms) or ms != sorted(ms) or any(p[1] <= 0 for p in pts):
                raise InvalidParameterError("hardware", f"{self.name}: linear_rates[{dt!r}] must be "
                                            "[[M >= 1, bytes/s > 0], ...] with M ascending")
        if any(v <= 0 for v in self.decode_attention_flops.values()):
            raise InvalidParameterError("hardware", f"{self.name}: decode_attention_flops must be positive")

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for matmuls whose inputs are `dtype`."""
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


def _nv(fp32, bf16_sparse, int8_sparse, bw, mem_gb, name, source, notes=""):
    """An NVIDIA spec from datasheet numbers: FP16 = BF16 tensor; the sparse figures are halved."""
    return HardwareSpec(
        name=name,
        kind="gpu",
        peak_flops={"float32": fp32 * _T, "bfloat16": bf16_sparse / 2 * _T,
                    "float16": bf16_sparse / 2 * _T, "int8": int8_sparse / 2 * _T},
        memory_bandwidth=bw,
        memory_bytes=int(mem_gb * _G),
        notes=notes,
        source=source,
    )


_SPECS = [
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), SXM column:
    # FP32 19.5 TF, BF16/FP16 tensor 312 | 624* TF, INT8 624 | 1248* TOPS, 40GB HBM2 1,555 GB/s, 80GB HBM2e 2,039 GB/s.
    _nv(19.5, 624, 1248, 1555 * _G, 40, "A100-40GB",
        "NVIDIA A100 datasheet (SXM4 40GB): 19.5 TF FP32, 312 TF BF16 dense, 624 TOPS INT8 dense, 1,555 GB/s, 40 GB",
        "TF32 tensor matmul: 156 TF dense if enabled"),
    _nv(19.5, 624, 1248, 2039 * _G, 80, "A100-80GB",
        "NVIDIA A100 datasheet (SXM4 80GB): 19.5 TF FP32, 312 TF BF16 dense, 624 TOPS INT8 dense, 2,039 GB/s, 80 GB",
        "TF32 tensor matmul: 156 TF dense if enabled"),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP32 67 TF, BF16 1,979* TF, INT8 3,958* TOPS,
    # 80GB HBM3 3.35 TB/s; H100 PCIe column: FP32 51 TF, BF16 1,513* TF, INT8 3,026* TOPS, 80GB HBM2e 2 TB/s.
    _nv(67, 1979, 3958, 3.35 * _T, 80, "H100-SXM",
        "NVIDIA H100 datasheet (SXM5): 67 TF FP32, 1,979 TF BF16 with sparsity (989.5 dense), "
        "3,958 TOPS INT8 with sparsity, 3.35 TB/s, 80 GB"),
    _nv(51, 1513, 3026, 2.0 * _T, 80, "H100-PCIe",
        "NVIDIA H100 datasheet (PCIe): 51 TF FP32, 1,513 TF BF16 with sparsity (756.5 dense), "
        "3,026 TOPS INT8 with sparsity, 2 TB/s, 80 GB"),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: same compute as H100 SXM, 141GB HBM3e 4.8 TB/s.
    _nv(67, 1979, 3958, 4.8 * _T, 141, "H200",
        "NVIDIA H200 datasheet (SXM): 67 TF FP32, 1,979 TF BF16 with sparsity (989.5 dense), "
        "3,958 TOPS INT8 with sparsity, 4.8 TB/s, 141 GB",
        "nvidia-smi reports ~140 GiB (143,771 MiB). Measured with PyTorch on one H200 (this project's "
        "device notes): 8192^3 bf16 mm ~788 TFLOP/s (0.8 of peak), device copy ~4.3 TB/s read+write "
        "(0.9 of peak): efficiency={'compute': 0.8, 'memory': 0.9} is a fair calibration"),
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TF, BF16/FP16 242* TF, INT8 485* TOPS, 24GB GDDR6 300 GB/s.
    _nv(30.3, 242, 485, 300 * _G, 24, "L4",
        "NVIDIA L4 datasheet: 30.3 TF FP32, 242 TF BF16 with sparsity (121 dense), 485 TOPS INT8 with sparsity, "
        "300 GB/s, 24 GB GDDR6"),
    # NVIDIA L40S datasheet: FP32 91.6 TF, BF16/FP16 362.05 | 733* TF, INT8 733 | 1,466* TOPS, 48GB GDDR6 864 GB/s.
    _nv(91.6, 724.1, 1466, 864 * _G, 48, "L40S",
        "NVIDIA L40S datasheet: 91.6 TF FP32, 362.05 TF BF16 dense, 733 TOPS INT8 dense, 864 GB/s, 48 GB GDDR6"),
    # NVIDIA Ada Lovelace architecture whitepaper (v2.1), appendix table, GeForce RTX 4090: FP32 82.6 TF;
    # FP16/BF16 tensor with FP32 accumulate 165.2 | 330.4* TF (PyTorch accumulates in FP32);
    # INT8 tensor 660.6 | 1321.2* TOPS; 24GB GDDR6X, 1,008 GB/s.
    _nv(82.6, 330.4, 1321.2, 1008 * _G, 24, "RTX-4090",
        "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: 82.6 TF FP32, 165.2 TF FP16/BF16 (FP32 accumulate) "
        "dense, 660.6 TOPS INT8 dense, 1,008 GB/s, 24 GB GDDR6X",
        "FP16 with FP16 accumulate: 330.3 TF dense"),
    # AMD Instinct MI300X data sheet: FP32 matrix 163.4 TF (vector 81.7), FP16/BF16 1,307.4 TF dense (2,614.9
    # with sparsity), INT8 2,614.9 TOPS dense, 192 GB HBM3, 5.3 TB/s.
    HardwareSpec(
        name="MI300X", kind="gpu",
        peak_flops={"float32": 163.4 * _T, "bfloat16": 1307.4 * _T, "float16": 1307.4 * _T, "int8": 2614.9 * _T},
        memory_bandwidth=5.3 * _T, memory_bytes=int(192 * _G),
        notes="float32 is the FP32 matrix-core peak; FP32 vector is 81.7 TF",
        source="AMD Instinct MI300X data sheet: 163.4 TF FP32 matrix, 1,307.4 TF BF16 dense, "
               "2,614.9 TOPS INT8 dense, 5.3 TB/s, 192 GB HBM3",
    ),
]

HARDWARE_SPECS: dict[str, HardwareSpec] = {s.name: s for s in _SPECS}
LOCAL_CPU = "local-cpu"

_ALIASES = {
    "a100": "A100-80GB", "a100-80g": "A100-80GB", "a100-sxm": "A100-80GB", "a100-40g": "A100-40GB",
    "a100-80gb-sxm": "A100-80GB", "a100-40gb-sxm": "A100-40GB",
    "h100": "H100-SXM", "h100-sxm5": "H100-SXM", "h100-80gb": "H100-SXM", "h100-pcie-80gb": "H100-PCIe",
    "h200": "H200", "h200-sxm": "H200", "h200-141gb": "H200",
    "l40s": "L40S", "l4": "L4",
    "4090": "RTX-4090", "rtx4090": "RTX-4090", "geforce-rtx-4090": "RTX-4090",
    "mi300x": "MI300X", "mi300": "MI300X",
    "cpu": LOCAL_CPU, "local": LOCAL_CPU,
}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def list_hardware() -> list[str]:
    """Names of the datasheet specs, plus 'local-cpu' (measured once by engine/local_hardware.py's
    probe, then read from its cache)."""
    return list(HARDWARE_SPECS) + [LOCAL_CPU]


def canonical_hardware_name(name: str) -> str:
    """The canonical name of a spec, case-insensitively, with aliases ("h100" -> "H100-SXM",
    "cpu" -> "local-cpu"); InvalidParameterError for an unknown one."""
    key = _norm(name)
    by_norm = {_norm(n): n for n in HARDWARE_SPECS}
    canonical = by_norm.get(key) or _ALIASES.get(key) or (LOCAL_CPU if key == LOCAL_CPU else None)
    if canonical is None:
        raise InvalidParameterError(
            "hardware", f"unknown hardware {name!r}; known: {', '.join(list_hardware())}"
        )
    return canonical


def get_hardware(name: str) -> HardwareSpec:
    """Look a spec up by name, case-insensitively, with aliases ("h100" -> H100-SXM).

    "local-cpu" is the cached result of the full local probe (reading it imports torch for the
    thread count). analysis/ cannot measure it: the probe needs the engine's measurers, so without
    a cached probe this raises and points to servescope.engine.local_hardware, which measures.
    """
    canonical = canonical_hardware_name(name)
    if canonical != LOCAL_CPU:
        return HARDWARE_SPECS[canonical]
    # lazy: probe.py imports this module for HardwareSpec (a true cycle at module level)
    from servescope.analysis.probe import cached_local_hardware

    spec = cached_local_hardware()
    if spec is None:
        raise InvalidParameterError(
            "hardware", "local-cpu has not been probed on this machine yet: run `servescope hardware probe` "
                        "(servescope.engine.local_hardware.probe_local_cpu measures it)")
    return spec
