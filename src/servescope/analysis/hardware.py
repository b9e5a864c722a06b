"""Hardware specs from vendor datasheets (the HardwareSpec fields and their conventions: spec.py),
looked up by name; "local-cpu" is the local probe's cached measurement (probe.py)."""

from __future__ import annotations

from servescope.analysis.probe import cached_local_hardware
from servescope.analysis.spec import DTYPE_BYTES, DTYPES, FP8, LOCAL_CPU, HardwareSpec
from servescope.errors import InvalidParameterError

__all__ = ["DTYPES", "DTYPE_BYTES", "LOCAL_CPU", "HardwareSpec", "HARDWARE_SPECS", "canonical_hardware_name",
           "get_hardware", "list_hardware"]

_T = 1e12  # TFLOP/s or TB/s
_G = 1e9  # GB/s or GB


def _nv(fp32, bf16_sparse, int8_sparse, bw, mem_gb, name, source, notes="", fp8=False):
    """An NVIDIA spec from datasheet numbers: FP16 = BF16 tensor; the sparse figures are halved. fp8: the part
    has FP8 tensor cores at its INT8 rate (what the Hopper, L4 and L40S datasheets print for both)."""
    return HardwareSpec(
        name=name,
        kind="gpu",
        peak_flops={"float32": fp32 * _T, "bfloat16": bf16_sparse / 2 * _T,
                    "float16": bf16_sparse / 2 * _T, "int8": int8_sparse / 2 * _T,
                    **({FP8: int8_sparse / 2 * _T} if fp8 else {})},
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
        "3,958 TOPS INT8 with sparsity, 3,958 TF FP8 with sparsity, 3.35 TB/s, 80 GB", fp8=True),
    _nv(51, 1513, 3026, 2.0 * _T, 80, "H100-PCIe",
        "NVIDIA H100 datasheet (PCIe): 51 TF FP32, 1,513 TF BF16 with sparsity (756.5 dense), "
        "3,026 TOPS INT8 with sparsity, 3,026 TF FP8 with sparsity, 2 TB/s, 80 GB", fp8=True),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: same compute as H100 SXM, 141GB HBM3e 4.8 TB/s.
    _nv(67, 1979, 3958, 4.8 * _T, 141, "H200",
        "NVIDIA H200 datasheet (SXM): 67 TF FP32, 1,979 TF BF16 with sparsity (989.5 dense), "
        "3,958 TOPS INT8 with sparsity, 4.8 TB/s, 141 GB",
        "nvidia-smi reports ~140 GiB (143,771 MiB). Measured with PyTorch on one H200 (this project's "
        "device notes): 8192^3 bf16 mm ~788 TFLOP/s (0.8 of peak), device copy ~4.3 TB/s read+write "
        "(0.9 of peak): efficiency={'compute': 0.8, 'memory': 0.9} is a fair calibration", fp8=True),
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TF, BF16/FP16 242* TF, INT8 485* TOPS, 24GB GDDR6 300 GB/s.
    _nv(30.3, 242, 485, 300 * _G, 24, "L4",
        "NVIDIA L4 datasheet: 30.3 TF FP32, 242 TF BF16 with sparsity (121 dense), 485 TOPS INT8 with sparsity, "
        "485 TF FP8 with sparsity, 300 GB/s, 24 GB GDDR6", fp8=True),
    # NVIDIA L40S datasheet: FP32 91.6 TF, BF16/FP16 362.05 | 733* TF, INT8 733 | 1,466* TOPS, 48GB GDDR6 864 GB/s.
    _nv(91.6, 724.1, 1466, 864 * _G, 48, "L40S",
        "NVIDIA L40S datasheet: 91.6 TF FP32, 362.05 TF BF16 dense, 733 TOPS INT8 dense, 733 TF FP8 dense, 864 GB/s, "
        "48 GB GDDR6", fp8=True),
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
        peak_flops={"float32": 163.4 * _T, "bfloat16": 1307.4 * _T, "float16": 1307.4 * _T, "int8": 2614.9 * _T,
                    FP8: 2614.9 * _T},
        memory_bandwidth=5.3 * _T, memory_bytes=int(192 * _G),
        notes="float32 is the FP32 matrix-core peak; FP32 vector is 81.7 TF",
        source="AMD Instinct MI300X data sheet: 163.4 TF FP32 matrix, 1,307.4 TF BF16 dense, "
               "2,614.9 TOPS INT8 dense, 2,614.9 TF FP8 dense, 5.3 TB/s, 192 GB HBM3",
    ),
]

HARDWARE_SPECS: dict[str, HardwareSpec] = {s.name: s for s in _SPECS}

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
    """Names of the datasheet specs, plus 'local-cpu' (measured once by measure/local_hardware.py's
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
    a cached probe this raises and points to servescope.measure.local_hardware, which measures.
    """
    canonical = canonical_hardware_name(name)
    if canonical != LOCAL_CPU:
        return HARDWARE_SPECS[canonical]
    spec = cached_local_hardware()
    if spec is None:
        raise InvalidParameterError(
            "hardware", "local-cpu has not been probed on this machine yet: run `servescope hardware probe` "
                        "(servescope.measure.local_hardware.probe_local_cpu measures it)")
    return spec
