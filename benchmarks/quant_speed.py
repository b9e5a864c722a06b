"""Packed-weight speed against float32 and against llama.cpp on the same files, one command:

    LLAMA_CPP_BIN=<llama.cpp build>/bin python benchmarks/quant_speed.py [--threads 2] [--rounds 3]

1. Decode batch 1 (1/TPOT of 128 new tokens after a 16-token prompt, like llama-bench's tg128) and
   prefill of a 512-token prompt (like pp512) for each engine, all loaded in one process and run in
   interleaved rounds (every engine, then llama-bench on every file, per round; medians reported),
   because this shared machine's speed moves between minutes:
     fp32        the embedded Q4_1 GGUF dequantised to float32
     int8        per-channel int8 (Int8Linear, its own float-widening GEMV)
     int8-g32    its float32 weights re-quantised to 8 bits, group 32 (Q8_0's form)
     int4        ... to 4 bits, group 32, symmetric (Q4_0's form)
     gguf-q4_1   the embedded file's own Q4_1 blocks;  gguf-q4_0 / gguf-q8_0: a Q4_0 / Q8_0 file
                 made with gguf-py from the same dequantised weights (benchmarks/gguf_requant.py;
                 written under --gguf-dir when missing), run from their blocks
     bf16, int4-bf16, int8-g32-bf16, gguf-q4_0-bf16: the same with bfloat16 activations (dtype bfloat16,
                 what `--dtype auto` picks on a CPU with bfloat16 dot products)
   and llama-bench (-p 512 -n 128, the same threads) on the Q4_1, Q4_0 and Q8_0 files.
2. torch's own packed CPU ops (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) against ours on the
   model's projection shapes, at 1 row (decode) and 512 rows (prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from gguf_requant import requantize  # noqa: E402

from servescope import LLM, SamplingParams  # noqa: E402
from servescope.bench import llama_cpp_tools as lct  # noqa: E402
from servescope.bench.envinfo import environment_info  # noqa: E402
from servescope.kernels.cpu import ops as cpu_ops  # noqa: E402
from servescope.model.linears import packed as ql  # noqa: E402
from servescope.quant.scheme import QuantScheme  # noqa: E402
from servescope.loader.source import resolve_model_path  # noqa: E402

# engine -> (--quantization, file kind, the llama.cpp file it is compared with); the engines run float32
# activations (LLM's default dtype), the "-bf16" ones bfloat16 (what the CLI's --dtype auto picks on a CPU
# with bfloat16 dot products): the same packed weights, the prefill GEMM in bfloat16
ENGINES = {"fp32": (None, "q4_1", None), "int8": ("int8", "q4_1", "q8_0"), "int8-g32": ("int8-g32", "q4_1", "q8_0"),
           "int4": ("int4", "q4_1", "q4_0"),
           "gguf-q4_1": ("gguf", "q4_1", "q4_1"), "gguf-q4_0": ("gguf", "q4_0", "q4_0"),
           "gguf-q8_0": ("gguf", "q8_0", "q8_0"),
           "bf16": (None, "q4_1", None), "int4-bf16": ("int4", "q4_1", "q4_0"),
           "int8-g32-bf16": ("int8-g32", "q4_1", "q8_0"), "gguf-q4_0-bf16": ("gguf", "q4_0", "q4_0")}


def engine_dtype(name: str) -> str:
    return "bfloat16" if name == "bf16" or name.endswith("-bf16") else "float32"
# SmolLM2-135M's projections (N, K): qkv, o, gate_up, down; the head runs once per token
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def gguf_files(gguf_dir: str) -> dict:
    src = resolve_model_path(None)
    files = {"q4_1": src}
    for kind in ("q4_0", "q8_0"):
        path = os.path.join(gguf_dir, f"SmolLM2-135M-Instruct.{kind.upper()}.gguf")
        if not os.path.exists(path):
            print(f"writing {path} (gguf-py, from the dequantised {os.path.basename(src)})", flush=True)
            requantize(src, path, kind)
        files[kind] = path
    return files


def decode_tps(llm, new=128):
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    return 1.0 / llm.generate([[(i * 37) % 40000 + 100 for i in range(16)]], sp)[0].metrics.tpot


def prefill_tps(llm, n=512):
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([[(i * 53) % 40000 + 100 for i in range(n)]], sp)
    return n / (time.perf_counter() - t0)


def run_rounds(args, llms, files):
    res = {name: {"decode": [], "prefill": []} for name in list(llms) + [f"llama-{k}" for k in args.llama]}
    for r in range(args.rounds):
        for name, llm in llms.items():
            res[name]["decode"].append(decode_tps(llm))
            res[name]["prefill"].append(prefill_tps(llm))
            print(f"round {r} {name}: decode {res[name]['decode'][-1]:.1f} tok/s, prefill512 "
                  f"{res[name]['prefill'][-1]:.1f} tok/s", flush=True)
        for kind in args.llama:
            b = lct.run_llama_bench(files[kind], args.threads, reps=1)
            res[f"llama-{kind}"]["decode"].append(b["tg128"]["tokens_per_s"])
            res[f"llama-{kind}"]["prefill"].append(b["pp512"]["tokens_per_s"])
            print(f"round {r} llama-bench {kind}: tg128 {b['tg128']['tokens_per_s']:.1f}, pp512 "
                  f"{b['pp512']['tokens_per_s']:.1f}", flush=True)
    return {name: {k: statistics.median(v) for k, v in d.items()} | {"runs": d}
            for name, d in res.items() if d["decode"]}


def print_table(med, llms, rounds):
    base = med["fp32"]["decode"] if "fp32" in med else None  # (bfloat16 engines too: against float32)
    print(f"\n| engine | weight MiB | decode b1 tok/s | vs fp32 | vs llama-bench tg128 | prefill 512 tok/s | "
          f"vs llama-bench pp512 |  (medians of {rounds} interleaved rounds)")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, m in med.items():
        ref = ENGINES.get(name, (None, None, None))[2]
        lm = med.get(f"llama-{ref}") if ref else None
        mib = f"{llms[name].engine.weight_bytes / 2**20:.1f}" if name in llms else "-"
        vs32 = f"{m['decode'] / base:.2f}x" if base and name in llms else "-"
        vtg = f"{m['decode'] / lm['decode']:.2f}x ({ref})" if lm else "-"
        vpp = f"{m['prefill'] / lm['prefill']:.2f}x ({ref})" if lm else "-"
        print(f"| {name} | {mib} | {m['decode']:.1f} | {vs32} | {vtg} | {m['prefill']:.1f} | {vpp} |")


def _time(fn, reps, clock=time.perf_counter):
    """Median seconds of fn() over reps calls after one warm-up call, on `clock`."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return statistics.median(ts)


def torch_int4_op(w: torch.Tensor, x: torch.Tensor):
    """torch's int4 CPU op on w (group 32): the weight packed with its own layout, or None if this torch
    lacks it."""
    n, k = w.shape
    wg = w.view(n, k // 32, 32)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    zeros = lo + 8 * scale  # tinygemm's form: w = (q - 8) * scale + zero
    sz = torch.stack([scale, zeros], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    except (AttributeError, RuntimeError) as e:
        print(f"torch int4 op unavailable: {str(e).splitlines()[0][:120]}")
        return None
    return lambda: torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)


def torch_ops_table(reps: int):
    """Microseconds per call summed over the four projections, ours against torch's packed ops."""
    mod = cpu_ops.load()
    rows = []
    for m in (1, 512):
        t = {"ours int4 (g32)": 0.0, "torch int4 (g32)": 0.0, "ours int8-g32": 0.0, "torch int8 (per channel)": 0.0}
        for n, k in SHAPES:
            w, x = torch.randn(n, k), torch.randn(m, k)
            q4 = ql.QuantLinear.from_linear(_linear(w), QuantScheme(4, 32))
            q8 = ql.QuantLinear.from_linear(_linear(w), QuantScheme(8, 32))
            t["ours int4 (g32)"] += _time(lambda: q4(x), reps)
            t["ours int8-g32"] += _time(lambda: q8(x), reps)
            op4 = torch_int4_op(w, x)
            t["torch int4 (g32)"] += _time(op4, reps) if op4 else float("nan")
            w8 = torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
            s8 = w.abs().amax(1) / 127
            t["torch int8 (per channel)"] += _time(lambda: torch._weight_int8pack_mm(x, w8, s8), reps)
        rows.append((m, t))
    print("\n| rows | " + " | ".join(rows[0][1]) + " |  (us per call, the 4 projections of a layer summed; "
          f"ours: {'C++ kernels' if mod else 'eager'})")
    print("| ---: |" + " ---: |" * len(rows[0][1]))
    for m, t in rows:
        print(f"| {m} | " + " | ".join(f"{v * 1e6:.0f}" for v in t.values()) + " |")
    return [{"rows": m, **{k: v * 1e6 for k, v in t.items()}} for m, t in rows]


def _linear(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return lin


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--llama", nargs="*", default=["q4_1", "q4_0", "q8_0"], help="llama-bench on these files")
    ap.add_argument("--gguf-dir", default="/tmp/servescope_gguf", help="where the Q4_0 / Q8_0 files are made")
    ap.add_argument("--skip-torch-ops", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(args.gguf_dir, exist_ok=True)
    files = gguf_files(args.gguf_dir)
    torch.set_num_threads(args.threads)
    kw = dict(num_kv_blocks=64, max_model_len=1024, enable_prefix_caching=False, num_threads=args.threads)
    llms = {name: LLM(model=files[ENGINES[name][1]], quantization=ENGINES[name][0], dtype=engine_dtype(name), **kw)
            for name in args.engines}
    for llm in llms.values():  # warm up
        decode_tps(llm, 4)
    doc = {"benchmark": "quant_speed", "args": vars(args), "files": files, **environment_info()}
    doc["median"] = run_rounds(args, llms, files)
    print_table(doc["median"], llms, args.rounds)
    if not args.skip_torch_ops:
        doc["torch_ops"] = torch_ops_table(reps=20)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
