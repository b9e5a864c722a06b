"""Decode of a mid-size random Qwen3-MoE or gpt-oss in float32 / bfloat16 (and --quantization int8 / int4): the fused
float / int8 / packed expert op and the C++ decode plan over it, against the paths before them (issue 37).

Three ways per dtype, each a fresh engine on the same random config (random weights, `random:` source):
  - reference: the experts through grouped_experts' torch ops (Experts.fused = PackedExperts.fused = False), so
    the decode plan refuses the model: what an HF MoE checkpoint ran before the dense fused op;
  - fused: the fused op (csrc/moe_dense.cpp) in the module path, the plan switched off (the executor's layer
    paths: the model alone);
  - plan: the fused op inside the C++ decode plan (the default).
Decode tok/s = batch / median decode step over `--iters` generations of a 16-token prompt and `--new` tokens
(bench/latency.py's runner).

    python benchmarks/moe_float_plan.py --threads 2 [--dtypes float32,bfloat16] [--batches 1,4,16] \
        [--quantization int8] [--model random:olmoe-1b-7b] [--modes reference,plan] [--family gpt_oss] \
        [--json out.json]

--family gpt_oss: the built-in shape as gpt-oss (sinks, q/k/v/o biases, every other layer windowed, the biased
top-k-then-softmax router, biased clamped-SwiGLU experts: ClampedExperts float, PackedClampedExperts packed).

--expert-rows instead times one expert matrix of the config ([2I, H], eight of them in turn) through the
decode GEMV and F.linear at 1-64 rows: where model/moe_fused.py's EXPERT_GEMV_ROWS come from.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope.cli.output import write_json  # noqa: E402

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 8,
          "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts": 32,
          "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
          "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
# the same width, experts and heads as gpt-oss (its router: top 4 of 32), alternating windows of 128
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 8,
           "hidden_size": 1024, "intermediate_size": 512, "num_local_experts": 32, "num_experts_per_tok": 4,
           "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000,
           "max_position_embeddings": 4096, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 4, "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2}


def decode_rates(path: str, dtype: str, mode: str, args) -> dict:
    """{batch: decode tok/s} of one engine built for `mode` (reference | fused | plan)."""
    from servescope.engine.llm import LLM  # (torch)
    from servescope.model.moe import Experts, PackedExperts  # (torch)

    Experts.fused = PackedExperts.fused = mode != "reference"
    model = path if path.startswith("random:") or os.path.isdir(path) else f"random:{path}"
    llm = LLM(model=model, dtype=dtype, quantization=args.quantization, num_threads=args.threads,
              max_num_seqs=max(args.batches), max_model_len=512, skip_tokenizer_init=True)
    ex = llm.engine.runner.executor
    assert (ex.decode_plan is not None) == (mode != "reference"), "the plan should cover the model"
    if mode == "fused":
        ex.layer_paths = [ex.model]
    out = engine_decode_rates(llm, args, f"{dtype} {args.quantization or ''} {mode:9s}")
    llm.engine.shutdown()
    del llm
    gc.collect()  # (a real shape's engine is gone before the next mode's is built: two would not fit)
    return out


def engine_decode_rates(llm, args, label: str) -> dict:
    """{batch: decode tok/s} of `llm` at each of args.batches: batch / the median decode step of args.iters
    generations of a 16-token prompt and args.new tokens; one line printed per batch."""
    from servescope.bench.latency import run_engine_latency  # (torch)

    out = {}
    for b in args.batches:
        res = run_engine_latency(llm, b, 16, args.new, iters=args.iters, measure_bandwidth=False)
        steps = [s.wall_seconds for s in res["_steps"] if s.phase == "decode" and s.num_decode_seqs == b]
        out[b] = b / statistics.median(steps)
        print(f"{label} batch {b:2d}: {out[b]:8.1f} tok/s ({len(steps)} steps)", flush=True)
    return out


def expert_rows(args) -> dict:
    """{dtype: {rows: [GEMV ms, F.linear ms]}} per expert matrix, medians of 15."""
    import time  # (stdlib)

    import torch  # (the engine half)
    import torch.nn.functional as F  # (torch)

    from servescope.kernels.cpu import linear as cpu_linear  # (torch)

    cpu_linear.load()

    def median_ms(fn, ws) -> float:
        fn(ws[0])
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            for w in ws:
                fn(w)
            times.append((time.perf_counter() - t0) / len(ws))
        return 1e3 * statistics.median(times)

    out = {}
    for dtype in args.dtypes.split(","):
        dt = getattr(torch, dtype)
        ws = [torch.randn(2 * CONFIG["moe_intermediate_size"], CONFIG["hidden_size"]).to(dt) for _ in range(8)]
        out[dtype] = {}
        for m in (1, 2, 3, 4, 8, 16, 32, 64):
            x = torch.randn(m, CONFIG["hidden_size"]).to(dt)
            row = [median_ms(lambda w: cpu_linear.gemv(x, w).to(dt), ws), median_ms(lambda w: F.linear(x, w), ws)]
            out[dtype][m] = row
            print(f"{dtype} rows {m:2d}: GEMV {row[0]:.3f} ms, F.linear {row[1]:.3f} ms", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--modes", default="reference,fused,plan")
    p.add_argument("--json", default=None)
    p.add_argument("--model", default=None, help="a checkpoint directory or random:PRESET of a real shape (e.g. "
                                                 "random:olmoe-1b-7b) in place of the built-in mid-size Qwen3-MoE")
    p.add_argument("--family", choices=["qwen3_moe", "gpt_oss"], default="qwen3_moe",
                   help="the built-in shape's family")
    p.add_argument("--expert-rows", action="store_true", help="time one expert matrix: GEMV against F.linear")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    import torch  # (the engine half)

    torch.set_num_threads(args.threads)
    if args.expert_rows:
        result = {"threads": args.threads, "expert_rows": expert_rows(args)}
        if args.json:
            write_json(args.json, result)
        return 0
    config = GPT_OSS if args.family == "gpt_oss" else CONFIG
    result = {"config": config, "threads": args.threads, "quantization": args.quantization, "rates": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or os.path.join(tmp, "config.json")
        if not args.model:
            with open(path, "w") as f:
                json.dump(config, f)
        else:
            result["config"] = args.model
        for dtype in args.dtypes.split(","):
            result["rates"][dtype] = {m: decode_rates(path, dtype, m, args) for m in args.modes.split(",")}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
