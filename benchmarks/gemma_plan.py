"""Decode of a random Gemma-2-2B shape (or Gemma-3-1B's) with fewer layers: the C++ decode plan (Gemma's sandwich
norms, GELU-tanh MLP, soft-capped attention and local rotary tables in one call per step; issues 36 and 37)
against the module path. Both run the same kernels (the GEMVs, the paged decode, the norms): the difference is
the host time of the Python layer loop.

One engine; each round runs every batch once with the plan and once on the modules (the executor's layer paths:
the model alone), alternating which goes first, so that a shared machine's drift falls on both alike. Decode
tok/s = batch / the median decode step over all rounds of a 16-token prompt and `--new` tokens.

Gemma-2-2B: hidden 2304, 8 heads of 256, 4 KV heads, MLP 9216, query scalar 256, soft-caps 50 / 30, windows of
4096 on every other layer. Gemma-3-1B (--family gemma3): hidden 1152, 4 heads of 256, 1 KV head, MLP 6912, q/k
norms, five local layers (rotary base 10000, window 512) to one global (base 1000000). `--layers` layers of the
real width and a 32000-token vocabulary (the real 256000 would make the head most of the step).

    python benchmarks/gemma_plan.py --threads 2 [--family gemma2] [--dtype bfloat16] [--layers 4] \
        [--batches 1,4,16] [--quantization int8] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope.cli.output import write_json  # noqa: E402

COMMON = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "head_dim": 256,
          "query_pre_attn_scalar": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "vocab_size": 32000,
          "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
CONFIGS = {
    "gemma2": {**COMMON, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
               "intermediate_size": 9216, "num_attention_heads": 8, "num_key_value_heads": 4,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rope_theta": 10000.0,
               "sliding_window": 4096},
    "gemma3": {**COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
               "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1, "rope_theta": 1000000.0,
               "rope_local_base_freq": 10000.0, "sliding_window": 512, "sliding_window_pattern": 6},
}


def alternating_rates(llm, args) -> dict:
    """{mode: {batch: decode tok/s}}: args.rounds rounds, each every batch with the plan and on the modules."""
    from servescope.config import SamplingParams  # (plain data)

    engine = llm.engine
    ex = engine.runner.executor
    paths = {"plan": list(ex.layer_paths), "modules": [ex.model]}
    sp = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    steps = {m: {b: [] for b in args.batches} for m in paths}
    for r in range(args.rounds + 1):  # round 0 warms both paths up and is not counted
        order = list(paths) if r % 2 else list(paths)[::-1]
        for b in args.batches:
            for mode in order:
                ex.layer_paths = paths[mode]
                prompts = [[(7 * i + 13 * j + 101 * r) % (vocab - 3) + 3 for i in range(16)] for j in range(b)]
                first = len(engine.step_records)
                llm.generate(prompts, sp, use_tqdm=False)
                if r:
                    steps[mode][b] += [s.wall_seconds for s in list(engine.step_records)[first:]
                                       if s.phase == "decode" and s.num_decode_seqs == b]
    ex.layer_paths = paths["plan"]
    out = {m: {b: b / statistics.median(v) for b, v in per.items()} for m, per in steps.items()}
    for b in args.batches:
        print(f"batch {b:2d}: plan {out['plan'][b]:8.1f} tok/s, modules {out['modules'][b]:8.1f} tok/s, "
              f"plan / modules {out['plan'][b] / out['modules'][b]:.3f} ({len(steps['plan'][b])} steps each)",
              flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--family", default="gemma2", choices=sorted(CONFIGS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    import torch  # (the engine half)

    from servescope.engine.llm import LLM  # (torch)

    torch.set_num_threads(args.threads)
    config = dict(CONFIGS[args.family], num_hidden_layers=args.layers)
    result = {"config": config, "threads": args.threads, "dtype": args.dtype, "quantization": args.quantization}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        llm = LLM(model=f"random:{path}", dtype=args.dtype, quantization=args.quantization, num_threads=args.threads,
                  max_num_seqs=max(args.batches), max_model_len=512, skip_tokenizer_init=True)
        assert llm.engine.runner.executor.decode_plan is not None, "the plan should cover the model"
        assert llm.engine.runner.executor.decode_plan.max_rows >= max(args.batches), "the plan should serve them"
        result["rates"] = alternating_rates(llm, args)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
