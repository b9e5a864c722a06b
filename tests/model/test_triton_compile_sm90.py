"""Every Triton kernel compiles for an H100/H200 (sm_90a) on this GPU-less machine, down to a cubin
with ptxas (bundled with the triton wheel), without register spills. The interpreter runs the
kernels' arithmetic in the other tests but never compiles them: a kernel that does not lower (a
type the compiler rejects, a layout it cannot build) would otherwise first fail on a lent GPU.
Runs in a child process: the interpreter flag of the other tests must not be set while compiling; the
process runs in the background while the tests before this one run (tests/background_jobs.py)."""

import json
import os
import sys
from pathlib import Path

import pytest

import background_jobs  # tests/, on sys.path (tests/conftest.py's folder)

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from servescope.kernels.triton import fused as triton_fused, gemv as triton_gemv
from servescope.kernels.triton import attention as tk, prefill as tp

target = GPUTarget("cuda", 90, 32)
FLOATS = {"eps", "scale_log2", "softcap_log2"}

def attrs(fn):
    # what a launch with 16-byte aligned tensors and strides, and widths N, K that are multiples of
    # 16 (every real model's), specialises on
    return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
            if not p.is_constexpr and (p.name.endswith("_ptr") or p.name.startswith("stride") or p.name in ("N", "K"))}

def sig(fn, dtype, ptrs):
    s = {}
    for p in fn.params:
        if p.is_constexpr:
            s[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            s[p.name] = {"slot_ptr": "*i64", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
                         "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                         "cos_ptr": "*fp32", "sin_ptr": "*fp32", "query_start_ptr": "*i32", **ptrs}.get(p.name, dtype)
        else:
            s[p.name] = "fp32" if p.name in FLOATS else "i32"
    return s

def prefill(group, d, native, **mods):
    block_q, block_n = tp.prefill_tiles(group, d, native)
    return dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=d, D_PAD=triton.next_power_of_2(d),
                BLOCK_SIZE=16, BLOCK_Q=block_q, BLOCK_N=block_n, PRECISION="tf32" if native else "ieee",
                NATIVE=native, **{"QUANT": False, "SOFTCAP": False, "SINKS": False, **mods})

CASES = [  # (kernel, pointer dtype, constexprs, warps[, {pointer: its own dtype}])
    (triton_gemv._gemv_kernel, "*bf16", dict(HAS_BIAS=False, BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024), 4),
    (triton_gemv._gemv_kernel, "*bf16", dict(HAS_BIAS=True, BLOCK_M=8, BLOCK_N=16, BLOCK_K=256), 4),
    (triton_gemv._gemv_kernel, "*fp32", dict(HAS_BIAS=False, BLOCK_M=2, BLOCK_N=8, BLOCK_K=256), 4),
    (triton_fused._rms_norm_kernel, "*bf16", dict(BLOCK=4096, ONE_PASS=True), 8),
    (triton_fused._add_rms_norm_kernel, "*bf16", dict(BLOCK=4096, ONE_PASS=True), 8),
    (triton_fused._rotary_kernel, "*bf16", dict(HALF=64, BLOCK_D=64, BLOCK_H=8), 4),
    (triton_fused._silu_mul_kernel, "*bf16", dict(BLOCK=1024), 4),
    (tk._store_kv_kernel, "*bf16", dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK=1024), 4),
    # Llama-3-8B's decode shapes with the wrapper's choices (BLOCK_N 64 at D 128, 4 warps)
    (tk._paged_decode_kernel, "*bf16", dict(NUM_HEADS=32, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128,
                                            BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=4, PRECISION="tf32"), 4),
    (tk._decode_reduce_kernel, "*bf16", dict(NUM_HEADS=32, HEAD_DIM=128, D_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4), 4),
    # Gemma-2-2B's soft-capped heads (8 / 4, head dim 256: BLOCK_N 32) and gpt-oss-20b's sinks (64 / 8, dim 64)
    (tk._paged_decode_kernel, "*bf16", dict(NUM_HEADS=8, GROUP=2, GROUP_PAD=16, HEAD_DIM=256, D_PAD=256,
                                            BLOCK_SIZE=16, BLOCK_N=32, NUM_SPLITS=1, PRECISION="tf32",
                                            SOFTCAP=True), 8),
    (tk._paged_decode_kernel, "*bf16", dict(NUM_HEADS=64, GROUP=8, GROUP_PAD=16, HEAD_DIM=64, D_PAD=64,
                                            BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=4, PRECISION="tf32",
                                            SINKS=True), 4),
    (tk._decode_reduce_kernel, "*bf16", dict(NUM_HEADS=64, HEAD_DIM=64, D_PAD=64, NUM_SPLITS=4, SPLITS_PAD=4,
                                             SINKS=True), 4),
    # the paged prefill with prefill_tiles' choices: Llama-3-8B (group 4, dim 128) in bf16 16-bit products, over
    # an int8 cache, and in float32; Gemma-2-2B's soft-capped dim-256 heads; gpt-oss-20b's window and sinks
    (tp._paged_prefill_kernel, "*bf16", prefill(4, 128, True), 4),
    (tp._paged_prefill_kernel, "*bf16", prefill(4, 128, True, QUANT=True), 4,
     {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8"}),
    (tp._paged_prefill_kernel, "*fp32", prefill(4, 128, False), 4),
    (tp._paged_prefill_kernel, "*bf16", prefill(2, 256, True, SOFTCAP=True), 4),
    (tp._paged_prefill_kernel, "*bf16", prefill(8, 64, True, SINKS=True), 4),
]
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ptxas = os.path.join(bindir, "ptxas-blackwell")
cuobjdump = os.path.join(bindir, "cuobjdump")
out = []
for fn, dt, consts, warps, *ptrs in CASES:
    src = ASTSource(fn=fn, signature=sig(fn, dt, *(ptrs or [{}])), constexprs=consts, attrs=attrs(fn))
    k = triton.compile(src, target=target, options={"num_warps": warps})
    loads = None
    if os.path.exists(cuobjdump):
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        loads = re.findall(r"\b(LDG\.E[.\w]*)", sass)
    spills = None
    if os.path.exists(ptxas):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True).stderr
        m = re.search(r"(\d+) bytes spill stores", info)
        spills = int(m.group(1)) if m else None
    out.append({"kernel": fn.__name__, "warps": warps, "consts": {k_: str(v) for k_, v in consts.items()},
                "cubin": "cubin" in k.asm, "spills": spills, "loads": loads})
print(json.dumps(out))
'''


def _has_nvidia_backend() -> bool:
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        return False
    return True


HAS_NVIDIA = _has_nvidia_backend()
if HAS_NVIDIA:
    background_jobs.register("sm90/compile", [background_jobs.Command(
        [sys.executable, "-c", CHILD], env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                                           "PYTHONPATH": str(ROOT / "src"), "TRITON_DEFAULT_FP_FUSION": "1"})],
        __name__)


def test_every_triton_kernel_compiles_for_sm90_without_spills():
    if not HAS_NVIDIA:
        pytest.skip("this triton has no NVIDIA backend")
    (proc,) = background_jobs.result("sm90/compile")
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 18
    for r in res:
        assert r["cubin"], r
        # None: no ptxas to ask (the cubin was still built). The paged decode kernel at head dim 128
        # with 4 warps uses all 255 registers and spills 84 bytes (2026-11-30, triton 3.9; 8 warps or
        # BLOCK_N 32 do not spill): it ran at 2.9 TB/s at batch 64 on the H200 like that, and
        # benchmarks/gpu.py times 4 against 8 warps; more than that is a regression
        limit = 84 if r["kernel"] == "_paged_decode_kernel" and r["warps"] == 4 else 0
        assert r["spills"] is None or r["spills"] <= limit, r
    # the batch-1 GEMV streams its weights with 128-bit loads (scalar 16-bit loads would cap it far
    # below the bandwidth: what it compiles to when the alignment is unknown)
    gemv_m1 = res[0]
    if gemv_m1["loads"] is not None:
        wide = [ld for ld in gemv_m1["loads"] if ld.endswith(".128")]
        assert len(wide) >= 4 and not any(ld.endswith("U16") for ld in gemv_m1["loads"]), gemv_m1["loads"]
