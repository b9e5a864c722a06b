"""servescope against llama.cpp at a real model shape, on the same GGUF files (issue 35).

The files come from `servescope checkpoint SHAPE --out DIR --gguf f16,q4_0,q8_0,q4_k_m` (random weights of
the shape, converted by llama.cpp's own convert_hf_to_gguf.py and llama-quantize). For each GGUF type:
  - llama-bench -p 512 -n 128 -r 3 (pp512, tg128), `threads` threads;
  - servescope on the same file with its own blocks (--quantization gguf): decode batch 1 (a 16-token
    prompt, 128 new tokens; decode tok/s over the decode steps) and prefill of a fresh 512-token prompt
    (512 / time to first token), through bench/latency.py's runner, median of `iters`.
Then serving on one type (--serve-type): `servescope bench serve` (the same load client, prompts and
lengths for both; random prompts, ignore_eos) against `servescope serve --quantization gguf` and
`llama-server -np N --cont-batching -c N * 512`, N = each of --streams, output tok/s and median TTFT.

    python benchmarks/real_shape_vs_llama_cpp.py --checkpoint /tmp/ck/llama-3.2-1b --shape llama-3.2-1b \
        --llama-cpp /work/llama.cpp --threads 2 [--types Q4_0,Q8_0] [--streams 8,32] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope.bench import llama_cpp_tools as lct  # noqa: E402
from servescope.bench.envinfo import environment_info  # noqa: E402
from servescope.cli.output import write_json  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from llama_cpp_baseline import bench_serve  # noqa: E402


def gguf_path(args, gtype: str) -> str:
    path = os.path.join(args.checkpoint, "gguf", f"{args.shape}-{gtype}.gguf")
    if not os.path.isfile(path):
        sys.exit(f"{path} not found: write it with `servescope checkpoint {args.shape} --out "
                 f"{args.checkpoint} --gguf {gtype.lower()}`")
    return path


def ours_single_stream(gguf: str, args) -> dict:
    """Decode batch 1 and prefill 512 of servescope on the file's own blocks; with --rounds R > 1, then
    R rounds of llama-bench tg128 and our decode in turn (paired_decode)."""
    import torch  # (here: the serving half runs without torch in this process)

    from servescope.bench.latency import run_engine_latency  # (likewise)
    from servescope.engine.llm import LLM  # (likewise)

    torch.set_num_threads(args.threads)
    llm = LLM(model=gguf, quantization="gguf", num_threads=args.threads, max_num_seqs=4, max_model_len=1024)
    dec = run_engine_latency(llm, 1, 16, 128, iters=args.iters, measure_bandwidth=False)
    pre = run_engine_latency(llm, 1, 512, 1, iters=args.iters, measure_bandwidth=False)
    ttfts = [r["ttft_s"] for r in pre["iterations"]]
    out = {"decode_b1_tokens_per_s": dec["decode_tokens_per_s"],
           "prefill512_tokens_per_s": 512 / statistics.median(ttfts), "prefill512_ttft_s": ttfts,
           "weight_bytes": llm.engine.weight_bytes}
    if args.rounds > 1:
        out["paired_decode"] = paired_decode(
            gguf, args, functools.partial(run_engine_latency, llm, 1, 16, 128, iters=1, measure_bandwidth=False))
    del llm
    gc.collect()
    return out


def paired_decode(gguf: str, args, ours) -> dict:
    """llama-bench tg128 (one repetition) and ours() (our decode run, the model loaded) in turn, --rounds
    times: this kind of VM's read bandwidth moves by up to 1.7x within minutes, and batch-1 decode follows
    it, so a ratio of two runs minutes apart says more about the minute than the engines. Each round's
    ratio is of two runs seconds apart; the median of those is the figure."""
    rounds = []
    for _ in range(args.rounds):
        tg = lct.run_llama_bench(gguf, args.threads, prompt=0, reps=1)["tg128"]["tokens_per_s"]
        dec = ours()["decode_tokens_per_s"]
        rounds.append({"tg128": tg, "servescope": dec, "ratio": dec / tg})
    return {"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds)}


def serve_pair(args, gguf: str, streams: int, tmp: str) -> dict:
    """One round of bench serve against our server, then llama-server, at `streams` concurrent streams."""
    ns = argparse.Namespace(concurrency=streams, num_prompts=args.prompts_per_stream * streams, input_len=256,
                            output_len=128)  # (what llama_cpp_baseline.bench_serve reads)
    res = {}
    with open(os.path.join(tmp, f"ours_{streams}.log"), "wb") as log:
        proc = our_server(args, gguf, streams, log)
        try:
            res["servescope"] = bench_serve(f"http://127.0.0.1:{args.port}", ns,
                                            os.path.join(tmp, f"ours_{streams}.json"))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    server_cmd = lct.llama_server_command(args.llama_server, gguf, args.threads, streams, streams * 512,
                                          port=args.port + 1)
    with lct.LlamaServer(server_cmd, log_path=os.path.join(tmp, f"llama_{streams}.log")) as srv:
        res["llama-server"] = bench_serve(srv.base_url, ns, os.path.join(tmp, f"llama_{streams}.json"))
    res["llama_server_command"] = server_cmd
    res["output_throughput_ratio"] = (res["servescope"]["output_throughput"]
                                      / res["llama-server"]["output_throughput"])
    res["median_ttft_ratio"] = res["servescope"]["median_ttft_ms"] / res["llama-server"]["median_ttft_ms"]
    return res


def our_server(args, gguf: str, streams: int, log):
    """`servescope serve` on the file's own blocks, `streams` sequences at a time, once healthy."""
    import subprocess  # (stdlib; only the serving half starts processes)

    from servescope.bench.serve_client import wait_healthy  # (httpx: only the serving half)

    cmd = [sys.executable, "-m", "servescope.cli", "serve", "--model", gguf, "--quantization", "gguf",
           "--port", str(args.port), "--threads", str(args.threads), "--max-num-seqs", str(streams),
           "--max-model-len", "1024"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{args.port}", proc, 900, "servescope serve")
    except RuntimeError:
        proc.kill()
        raise
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="the directory `servescope checkpoint` wrote")
    ap.add_argument("--shape", required=True, help="the shape it was written from (the GGUF files' prefix)")
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"),
                    help="llama.cpp's tree with build/bin")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_0,Q8_0")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: also decode b1 paired with llama-bench tg128 in turn this many times")
    ap.add_argument("--serve-type", default="Q4_0")
    ap.add_argument("--streams", default="8,32")
    ap.add_argument("--prompts-per-stream", type=int, default=2)
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not args.llama_cpp:
        sys.exit("--llama-cpp DIR (or $LLAMA_CPP_DIR) is required")
    bin_dir = os.path.join(args.llama_cpp, "build", "bin")
    os.environ[lct.ENV] = bin_dir
    args.llama_server = lct.require_tool("llama-server")
    doc = {"benchmark": "real_shape_vs_llama_cpp", "shape": args.shape, "args": vars(args),
           **environment_info(), "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "single": {}, "serve": {}}
    if not args.skip_single:
        for gtype in args.types.split(","):
            gguf = gguf_path(args, gtype)
            lb = lct.run_llama_bench(gguf, args.threads)
            ours = ours_single_stream(gguf, args)
            tg, pp = lb["tg128"]["tokens_per_s"], lb["pp512"]["tokens_per_s"]
            dec, pre = ours["decode_b1_tokens_per_s"], ours["prefill512_tokens_per_s"]
            doc["single"][gtype] = {"llama_bench": lb, "servescope": ours, "decode_ratio": dec / tg,
                                    "prefill_ratio": pre / pp}
            print(f"{gtype}: tg128 {tg:.1f}, ours decode b1 {dec:.1f} tok/s ({dec / tg:.2f}x); "
                  f"pp512 {pp:.1f}, ours prefill 512 {pre:.1f} ({pre / pp:.2f}x)", flush=True)
            if "paired_decode" in ours:
                paired = ours["paired_decode"]
                print(f"{gtype}: decode b1 in turn with tg128, {len(paired['rounds'])} rounds: " + ", ".join(
                      f"{r['servescope']:.1f}/{r['tg128']:.1f}" for r in paired["rounds"])
                      + f"; median ratio {paired['median_ratio']:.2f}x", flush=True)
    if not args.skip_serve:
        gguf = gguf_path(args, args.serve_type)
        with tempfile.TemporaryDirectory() as tmp:
            for streams in [int(s) for s in args.streams.split(",")]:
                r = serve_pair(args, gguf, streams, tmp)
                doc["serve"][streams] = r
                ours, llama = r["servescope"], r["llama-server"]
                print(f"{streams} streams ({args.serve_type}): ours {ours['output_throughput']:.1f} tok/s, "
                      f"TTFT {ours['median_ttft_ms'] / 1e3:.1f} s; llama-server "
                      f"{llama['output_throughput']:.1f} tok/s, TTFT {llama['median_ttft_ms'] / 1e3:.1f} s; "
                      f"ratio {r['output_throughput_ratio']:.2f}, TTFT ratio {r['median_ttft_ratio']:.2f}",
                      flush=True)
    doc["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
