"""`servescope checkpoint SHAPE --out DIR [--gguf f16,q4_0,q8_0,q4_k_m]`: a random-weight checkpoint of a
real model shape as a Hugging Face directory and, with llama.cpp's tools, as GGUF files of the same weights
(bench/shape_checkpoint.py), so that servescope and llama.cpp can be measured on one file."""

from __future__ import annotations

import argparse
import os

from servescope.cli.args import positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoint", help="write a random-weight checkpoint of a real model shape (HF, and "
                                          "GGUF with llama.cpp's tools) for benchmarks")
    p.add_argument("shape", help="a preset: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen3-4b or another "
                                 "of `servescope explain`'s, or a config.json file (the vocabulary becomes "
                                 "SmolLM2's)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the directory to write (must not exist, or be empty)")
    p.add_argument("--gguf", default=None, metavar="TYPES",
                   help="also GGUF files of the same weights, comma-separated: f16, q4_0, q8_0, q4_k_m "
                        "(llama.cpp's convert_hf_to_gguf.py, then llama-quantize), in DIR/gguf/")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="llama.cpp's source tree with build/bin/llama-quantize (default: $LLAMA_CPP_DIR)")
    p.add_argument("--layers", type=positive_int, default=None, help="fewer layers than the shape's (tests)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from servescope.bench.shape_checkpoint import write_shape_checkpoint  # lazy: torch, transformers
    from servescope.cli.output import console, fmt_bytes

    r = write_shape_checkpoint(args.shape, args.out, layers=args.layers, gguf=args.gguf,
                               llama_cpp=args.llama_cpp, seed=args.seed)
    c = console()
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in r.seconds.items())
    c.print(f"wrote {r.out}: {r.shape}, {r.parameters / 1e9:.2f}B parameters, {fmt_bytes(r.hf_bytes)} of "
            f"bfloat16 safetensors ({stages})")
    for t, path in r.ggufs.items():
        c.print(f"  {t}: {path} ({fmt_bytes(os.path.getsize(path))})")
    c.print(f"run it: servescope generate --model {r.out}")
    return 0
