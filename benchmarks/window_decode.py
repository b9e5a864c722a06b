"""Decode step time vs context for a sliding-window model and the same model with full attention.

A random-initialised Mistral-shaped model (hidden 1024, 8 layers, 16 heads, 4 KV heads, head dim 64, MLP 2816,
vocab 32000: ~100M parameters), once with a 512-token window on every layer and once without. For each
context (1k, 8k by default) one request is prefilled to that length, then decodes --decode-tokens tokens; the
median of its decode steps' wall time is the figure. Windowed: flat past the window (each layer reads 512
keys and the KV manager holds window / block + 1 blocks); full: grows with the context.

    python benchmarks/window_decode.py [--contexts 1024 8192] [--dtype float32] [--threads 2]
    python benchmarks/window_decode.py --shape llama-3.2-1b --dtype bfloat16   # a real shape, as Mistral
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from servescope import LLM, SamplingParams

CONFIG = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
          "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
          "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": False}


def decode_step_ms(model_dir: Path, context: int, decode_tokens: int, dtype: str) -> tuple:
    """(median decode step ms, blocks the request holds at the end, KV blocks in the cache)."""
    llm = LLM(model=f"random:{model_dir / 'config.json'}", dtype=dtype, max_model_len=context + decode_tokens + 16,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    engine = llm.engine
    prompt = torch.randint(3, 32000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True))
    times, held = [], 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        rec = engine.step_records[-1]
        if rec.phase == "decode":
            times.append(dt * 1e3)
        if engine.has_unfinished():
            held = engine.kv_manager.num_held_blocks("r")
    return statistics.median(times[2:]), held, engine.kv_manager.num_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=34)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default=None, metavar="PRESET",
                    help="take the model's dimensions from this preset (analysis/presets), as a Mistral model")
    args = ap.parse_args()
    config = CONFIG
    if args.shape:
        from servescope.analysis.presets import load_preset  # only with --shape

        hf = load_preset(args.shape).to_hf_dict()
        config = {**hf, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "rope_scaling": None,
                  "max_position_embeddings": max(CONFIG["max_position_embeddings"], max(args.contexts) + 64)}
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, extra in (("windowed", {"sliding_window": args.window}), ("full", {})):
            model_dir = Path(d) / name
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps({**config, **extra}))
            for ctx in args.contexts:
                ms, held, blocks = decode_step_ms(model_dir, ctx, args.decode_tokens, args.dtype)
                rows.append({"model": name, "context": ctx, "decode_step_ms": round(ms, 2), "held_blocks": held})
                print(json.dumps(rows[-1]), flush=True)
    for name in ("windowed", "full"):
        r = [x for x in rows if x["model"] == name]
        print(f"{name}: {r[-1]['context']} / {r[0]['context']} context decode step = "
              f"{r[-1]['decode_step_ms'] / r[0]['decode_step_ms']:.3f}x")


if __name__ == "__main__":
    main()
