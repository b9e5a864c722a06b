"""The quantisation accuracy table of docs/BENCHMARKS.md (bench/accuracy.py): every weight mode x KV
cache dtype against the float32 model (float32 KV) on the texts shipped with the tests.

    python benchmarks/quant_accuracy.py [--threads 2] [--modes float32 int8 int4 ...] [--kv auto int8 fp8_e4m3]
        [--model PATH]  (default: the embedded model; benchmarks/dithered_reference.py writes another)
        [--saved DIR ...]  (checkpoints `servescope quantize` wrote from that model: a row each)
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope.bench.accuracy import accuracy_table, render_markdown  # noqa: E402

TEXTS = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "quant_texts.txt")
MODES = ["float32", "gguf", "int8", "int8-g32", "int8-g128-asym", "int4", "int4-g32-asym", "int4-g64", "int4-g128-asym"]
# the KV axis: auto (the model dtype, float32 here), then the quantised caches
KV_DTYPES = ["auto", "int8", "fp8_e4m3"]

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=MODES)
    ap.add_argument("--kv", nargs="+", default=KV_DTYPES, help="KV cache dtypes (the second axis)")
    ap.add_argument("--model", default=None, help="a model path (default: the embedded SmolLM2)")
    ap.add_argument("--saved", nargs="*", default=[], help="saved quantised checkpoints of --model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with open(TEXTS) as f:
        texts = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    print(render_markdown(accuracy_table(texts, args.modes, tuple(args.kv), model=args.model,
                                        saved=tuple(args.saved))))
