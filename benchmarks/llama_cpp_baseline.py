"""Our server against llama.cpp's own server, and llama-bench's single-stream figures.

Serving: `servescope bench serve` (the same load client, prompts and lengths for both) against
`servescope serve` and `llama-server -np SLOTS --cont-batching` on the same GGUF file (llama.cpp runs
its own Q4_1 weights; ours are dequantised to --dtype, or with --quantization gguf run those same
blocks), the same thread count, in interleaved rounds (ours, llama.cpp, ours, llama.cpp, ...) because
the machine's speed moves between minutes.
Single stream: `llama-bench -p 512 -n 128` (pp512, tg128).

    python benchmarks/llama_cpp_baseline.py --threads 2 --rounds 2 --json benchmarks/results/llama_cpp.json

The tools are found on PATH or in $LLAMA_CPP_BIN; docs/BENCHMARKS.md says how to build them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from servescope.bench import llama_cpp_tools as lct
from servescope.bench.envinfo import environment_info
from servescope.bench.serve_client import wait_healthy
from servescope.loader.source import resolve_model_path

KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms", "duration_s", "completed")


def bench_serve(base_url: str, args, out_json: str) -> dict:
    cmd = [sys.executable, "-m", "servescope.cli", "bench", "serve", "--base-url", base_url,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--max-concurrency", str(args.concurrency), "--request-rate", "inf",
           "--vocab-size", "32000", "--no-progress", "--json", out_json]
    subprocess.run(cmd, check=True, timeout=3600)
    with open(out_json) as f:
        d = json.load(f)
    return {k: d[k] for k in KEYS}


def our_server(args, port: int, log):
    cmd = [sys.executable, "-m", "servescope.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--threads", str(args.threads), "--max-num-seqs", str(max(args.concurrency, 8))]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 900, "servescope serve")  # may compile the kernels
    except RuntimeError:
        proc.kill()
        raise
    return proc


def run_rounds(args, gguf: str, tmp: str) -> dict:
    runs = {"servescope": [], "llama-server": []}
    server_cmd = lct.llama_server_command(lct.require_tool("llama-server"), gguf, args.threads, args.concurrency,
                                          args.ctx, port=args.port + 1)
    for r in range(args.rounds):
        with open(os.path.join(tmp, f"ours_{r}.log"), "wb") as log:
            proc = our_server(args, args.port, log)
            try:
                runs["servescope"].append(bench_serve(f"http://127.0.0.1:{args.port}", args,
                                                      os.path.join(tmp, f"ours_{r}.json")))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
        with lct.LlamaServer(server_cmd, log_path=os.path.join(tmp, f"llama_{r}.log")) as srv:
            runs["llama-server"].append(bench_serve(srv.base_url, args, os.path.join(tmp, f"llama_{r}.json")))
        print(f"round {r}: ours {runs['servescope'][-1]['output_throughput']:.1f} tok/s, llama-server "
              f"{runs['llama-server'][-1]['output_throughput']:.1f} tok/s", flush=True)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in KEYS} for name, rs in runs.items()}
    return {"runs": runs, "median": med, "llama_server_command": server_cmd,
            "output_throughput_ratio":
                med["servescope"]["output_throughput"] / med["llama-server"]["output_throughput"],
            "median_ttft_ratio": med["servescope"]["median_ttft_ms"] / med["llama-server"]["median_ttft_ms"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None,
                    help="our server's weights: e.g. gguf (the file's own Q4_1 blocks, llama.cpp's format), int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent streams = llama-server slots (-np)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096, help="llama-server's total context (split over the slots)")
    ap.add_argument("--port", type=int, default=8087)
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--skip-llama-bench", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gguf = resolve_model_path(args.model)
    doc = {"benchmark": "llama_cpp_baseline", "gguf": gguf, "args": vars(args), **environment_info()}
    if not args.skip_llama_bench:
        doc["llama_bench"] = lct.run_llama_bench(gguf, args.threads)
        print("llama-bench:", json.dumps(doc["llama_bench"]), flush=True)
    if not args.skip_serve:
        with tempfile.TemporaryDirectory() as tmp:
            doc["serve"] = run_rounds(args, gguf, tmp)
        print(json.dumps(doc["serve"]["median"], indent=2))
        print(f"output tok/s ratio (ours / llama-server): {doc['serve']['output_throughput_ratio']:.2f}; "
              f"median TTFT ratio: {doc['serve']['median_ttft_ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
