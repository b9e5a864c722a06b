"""A mixture-of-experts model of a real shape against llama.cpp on one GGUF file (issue 37).

The file comes from `servescope checkpoint olmoe-1b-7b --out DIR --gguf q4_0` (random weights of the shape,
converted by llama.cpp's own convert_hf_to_gguf.py and quantised by llama-quantize). Measured:
  - llama-bench -m FILE -p 0 -n 128 -t THREADS -r 3 (tg128);
  - servescope on the same file with its own blocks (--quantization gguf: each routed expert a packed
    QuantLinear, model/moe.py's PackedExperts): decode at batch 1, 4 and 16 (a 16-token prompt, `--new`
    new tokens each; decode tok/s = batch / median decode step), through bench/latency.py's runner;
  - the bytes a batch-1 decode step reads, by the engine's own count: every weight it runs (attention,
    routers, norms, the shared layers, the head, one embedding row) plus the experts the step's routing
    chose, each at its packed bytes (only chosen experts are visited: tests/model/test_moe_layers.py's
    NaN test), against the floor's "active-expert bytes plus attention" (k experts per sparse layer plus
    the same non-expert weights), and that count over the median decode step against the read
    bandwidth sampled in the same run (analysis/probe.measure_read_bandwidth).

  - with --reference-experts, the experts through grouped_experts' torch ops (PackedExperts.fused = False:
    the path before the fused C++ op), for an A/B in one tree;
  - with --kernel-table, the cost model's error on each batch's decode steps and on a 512-token prefill,
    the engine predicting with its kernels timed at this model's shapes (measure/local_hardware.
    with_kernel_table: measured once per CPU and shape, cached), and which bandwidth priced them: the
    probe's cached figure or a spot check's (analysis/bandwidth.py). Beside it the same steps priced as the
    cache holds them (`..._as_cached`: the probe's cached bandwidth, the table's times as timed, no spot
    check), to show what the spot check changed on the very same steps.

    python benchmarks/moe_real_shape.py --gguf DIR/gguf/olmoe-1b-7b-Q4_0.gguf --llama-cpp /work/llama.cpp \
        --threads 2 [--batches 1,4,16] [--reference-experts] [--kernel-table] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope.bench.envinfo import environment_info  # noqa: E402
from servescope.cli.output import write_json  # noqa: E402


def llama_bench_tg(tool: str, gguf: str, threads: int, new: int) -> dict:
    """llama-bench -p 0 -n NEW -r 3: the generation rate's mean and spread (its JSON output)."""
    import json  # (stdlib)

    cmd = [tool, "-m", gguf, "-p", "0", "-n", str(new), "-t", str(threads), "-r", "3", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    row = json.loads(r.stdout)[0]
    return {"command": " ".join(cmd), "tokens_per_s": row["avg_ts"], "stddev": row["stddev_ts"],
            "samples_ts": row.get("samples_ts")}


def step_bytes(llm, active_per_layer: list) -> dict:
    """The bytes a decode step reads by the engine's count, and the floor's ideal, for one routing."""
    from servescope.model.moe import moe_blocks  # (torch: after the engine is built)

    model = llm.engine.runner.executor.model
    blocks = moe_blocks(model)
    one = blocks[0][1].experts.expert_bytes()
    every_expert = sum(b.experts.num_experts for _, b in blocks) * one
    emb = model.model.embed_tokens
    table = sum(t.numel() * t.element_size() for t in emb.buffers()) + sum(
        t.numel() * t.element_size() for t in emb.parameters())
    shared = llm.engine.weight_bytes - every_expert - table + table // emb.num_embeddings  # + one row
    k = llm.engine.model_config.moe.experts.top_k
    return {"non_expert_bytes": shared, "expert_bytes": one,
            "read_bytes": shared + one * sum(active_per_layer), "floor_bytes": shared + one * k * len(blocks)}


def as_cached_predictor(engine):
    """The engine's step predictor on the spec as the cache holds it: the probe's cached bandwidth and rates
    (no spot check) and the kernel tables' times as they were timed (no bandwidth to re-price them from)."""
    import dataclasses  # (stdlib)

    from servescope.analysis.probe import cached_local_hardware  # (torch)

    pred = engine.step_cost_predictor.predictor
    cached = cached_local_hardware(spot_check=lambda: None)
    if cached is None:
        return None
    tables = {k: {**t, "bandwidth": 0.0} for k, t in pred.hw.kernel_tables.items()}
    return dataclasses.replace(pred, hw=cached.replace(kernel_tables=tables))


def error_as_cached(predictor, steps: list):
    """Median (predicted - measured) / measured of `steps` (decode-only or one prefill sequence) re-priced."""
    errs = []
    for s in steps:
        if s.num_prefill_seqs:
            seqs = [(s.num_prefill_tokens, s.context_lens[0] - s.num_prefill_tokens)]
        else:
            seqs = [(1, c - 1) for c in s.context_lens]
        active = s.moe_experts_active
        t = predictor.predict(seqs, len(seqs), sum(active) / len(active) if active else None).seconds
        errs.append((t - s.wall_seconds) / s.wall_seconds)
    return statistics.median(errs) if errs else None


def ours(gguf: str, args) -> dict:
    import torch  # (the engine half)

    from servescope.bench.latency import run_engine_latency  # (torch)
    from servescope.engine.llm import LLM  # (torch)

    from servescope.model.moe import PackedExperts  # (torch)

    torch.set_num_threads(args.threads)
    PackedExperts.fused = not args.reference_experts
    t0 = time.perf_counter()
    llm = LLM(model=gguf, quantization="gguf", num_threads=args.threads, max_num_seqs=max(args.batches),
              max_model_len=1024)
    cached_pred = None
    out = {"load_seconds": time.perf_counter() - t0, "weight_bytes": llm.engine.weight_bytes, "batches": {},
           "experts": "grouped_experts (torch ops)" if args.reference_experts else "fused op where it applies"}
    if args.kernel_table:
        from servescope.measure.local_hardware import with_kernel_table  # (torch)

        t0 = time.perf_counter()
        from servescope.analysis.bandwidth import bandwidth_origin  # (after the engine's imports)

        with_kernel_table(llm.engine)
        out["kernel_table_seconds"] = time.perf_counter() - t0
        hw = llm.engine.hardware
        out["bandwidth"] = {"priced_at": hw.memory_bandwidth, "probed": hw.probed_bandwidth, "spot": hw.spot_bandwidth,
                            "origin": bandwidth_origin(hw) or "the probe's own figure (no spot check)",
                            "kernel_tables": {k: t.get("bandwidth") for k, t in hw.kernel_tables.items()}}
        print(f"bandwidth: {out['bandwidth']['origin']}; kernel table timed at "
              + ", ".join(f"{(b or 0) / 1e9:.1f} GB/s" for b in out["bandwidth"]["kernel_tables"].values()), flush=True)
        cached_pred = as_cached_predictor(llm.engine)
        pre = run_engine_latency(llm, 1, 512, 1, iters=args.iters, measure_bandwidth=False)
        steps = [s for s in pre["_steps"] if s.phase == "prefill"]
        out["prefill_512_prediction_error"] = statistics.median(
            s.prediction_error for s in steps if s.prediction_error is not None)
        if cached_pred is not None:
            out["prefill_512_prediction_error_as_cached"] = error_as_cached(cached_pred, steps)
        print(f"prefill 512: prediction error {100 * out['prefill_512_prediction_error']:+.1f}%"
              + (f" (as cached {100 * out['prefill_512_prediction_error_as_cached']:+.1f}%)"
                 if cached_pred is not None else ""), flush=True)
    for b in args.batches:
        res = run_engine_latency(llm, b, 16, args.new, iters=args.iters, measure_bandwidth=True)
        dec = [s for s in res["_steps"] if s.phase == "decode" and s.num_decode_seqs == b]
        step = statistics.median(s.wall_seconds for s in dec)
        layers = range(len(dec[0].moe_experts_active))
        active = [statistics.mean(s.moe_experts_active[i] for s in dec) for i in layers]
        row = {"decode_tokens_per_s": b / step, "ms_per_token": 1e3 * step / b, "median_step_s": step,
               "experts_read_per_layer": statistics.mean(active), "decode_steps": len(dec),
               "session_bandwidth": res.get("session_bandwidth", {}).get("median")}
        errs = [s.prediction_error for s in dec if s.prediction_error is not None]
        if args.kernel_table and errs:
            row["decode_prediction_error"] = statistics.median(errs)
            if cached_pred is not None:
                row["decode_prediction_error_as_cached"] = error_as_cached(cached_pred, dec)
        row.update(step_bytes(llm, active))
        row["read_bytes_per_s"] = row["read_bytes"] / step
        if row["session_bandwidth"]:
            row["pct_of_read_bandwidth"] = 100 * row["read_bytes_per_s"] / row["session_bandwidth"]
        out["batches"][b] = row
        print(f"batch {b}: {row['decode_tokens_per_s']:.2f} tok/s ({row['ms_per_token']:.1f} ms/token), "
              f"{row['experts_read_per_layer']:.1f} experts/layer, "
              f"{row['read_bytes'] / 2**20:.0f} MiB read/step "
              f"({row['read_bytes'] / row['floor_bytes']:.3f}x the floor's), "
              f"{row['read_bytes_per_s'] / 1e9:.1f} GB/s of {(row['session_bandwidth'] or 0) / 1e9:.1f}"
              + (f", prediction error {100 * row['decode_prediction_error']:+.1f}%"
                 if "decode_prediction_error" in row else "")
              + (f" (as cached {100 * row['decode_prediction_error_as_cached']:+.1f}%)"
                 if "decode_prediction_error_as_cached" in row else ""), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--new", type=int, default=128, help="new tokens per servescope request")
    ap.add_argument("--llama-new", type=int, default=128, help="llama-bench -n")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--reference-experts", action="store_true", help="the experts through torch ops (A/B)")
    ap.add_argument("--kernel-table", action="store_true", help="predict with the kernels timed at this shape")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    doc = {"benchmark": "moe_real_shape", "gguf": args.gguf, "args": vars(args), **environment_info(),
           "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    if not args.skip_llama:
        tool = os.path.join(args.llama_cpp, "build", "bin", "llama-bench")
        doc["llama_bench"] = llama_bench_tg(tool, args.gguf, args.threads, args.llama_new)
        print(f"llama-bench tg{args.llama_new}: {doc['llama_bench']['tokens_per_s']:.2f} "
              f"+- {doc['llama_bench']['stddev']:.2f} tok/s", flush=True)
    doc["servescope"] = ours(args.gguf, args)
    if "llama_bench" in doc:
        b1 = doc["servescope"]["batches"][1]["decode_tokens_per_s"] if 1 in args.batches else None
        doc["decode_b1_ratio"] = b1 / doc["llama_bench"]["tokens_per_s"] if b1 else None
        print(f"batch-1 decode vs llama-bench: {doc['decode_b1_ratio']:.2f}x", flush=True)
    doc["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
