"""Decode of a random DeepSeek-V2-Lite shape with fewer layers: the C++ decode plan (latent attention, DeepSeek's
router and shared experts in one call per step; issue 37) against the module path (the plan switched off: the
executor's layer paths the model alone). Both run the same kernels (latent_decode, the fused experts op, the
GEMVs): the difference is the host time of the Python layer loop.

DeepSeek-V2-Lite's layer shapes (hidden 2048, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, no query
LoRA, 64 experts of width 1408 top-6, two shared, a dense first layer of 10944) with `--layers` layers and a
32000-token vocabulary. Decode tok/s = batch / median decode step over `--iters` generations of a 16-token prompt
and `--new` tokens (bench/latency.py's runner).

    python benchmarks/deepseek_plan.py --threads 2 [--dtype bfloat16] [--layers 3] [--batches 1,4,16] \
        [--quantization int4] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope.cli.output import write_json  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from moe_float_plan import engine_decode_rates  # noqa: E402

CONFIG = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
          "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_attention_heads": 16,
          "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
          "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
          "num_experts_per_tok": 6, "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1,
          "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False, "vocab_size": 32000,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def decode_rates(path: str, mode: str, args) -> dict:
    """{batch: decode tok/s} of one engine, the plan on (mode "plan") or off ("modules")."""
    from servescope.engine.llm import LLM  # (torch)

    llm = LLM(model=f"random:{path}", dtype=args.dtype, quantization=args.quantization, num_threads=args.threads,
              max_num_seqs=max(args.batches), max_model_len=512, skip_tokenizer_init=True)
    ex = llm.engine.runner.executor
    assert ex.decode_plan is not None, "the plan should cover the model"
    if mode == "modules":
        ex.layer_paths = [ex.model]
    out = engine_decode_rates(llm, args, f"{args.dtype} {args.quantization or ''} {mode:8s}")
    llm.engine.shutdown()
    del llm
    gc.collect()  # (a real shape's engine is gone before the next mode's is built: two would not fit)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--modes", default="modules,plan")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    import torch  # (the engine half)

    torch.set_num_threads(args.threads)
    config = dict(CONFIG, num_hidden_layers=args.layers)
    result = {"config": config, "threads": args.threads, "dtype": args.dtype, "quantization": args.quantization,
              "rates": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        result["rates"] = {m: decode_rates(path, m, args) for m in args.modes.split(",")}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
