"""Peak memory of loading a Hugging Face checkpoint, against its bytes on disk and the built model's.

    python benchmarks/load_memory.py --model DIR [--dtype bfloat16] [--json out.json]
    python benchmarks/load_memory.py --shape olmoe-1b-7b --layers 4 --out /tmp/olmoe4   # writes DIR first

Each load runs in a fresh process (`--child`), which samples its own RssAnon every 2 ms while
`servescope.engine.weights.build_weights` reads and builds the weights: anonymous memory is what the
process itself holds; the safetensors files are mapped (file pages: the page cache's, given back under
pressure), so they are not in it. Printed: the checkpoint's bytes, the built model's parameter bytes, the
peak anonymous memory above the process's start, and their ratio to the model's bytes (1.0 is the floor: the
model itself). A tree's own package is what runs (PYTHONPATH=<tree>/src), so an A/B against a base
checkout is two runs of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time


def _anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def child(model: str, dtype: str) -> dict:
    import torch

    from servescope.config import EngineConfig
    from servescope.engine.weights import build_weights

    base = _anon_kib()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _anon_kib())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    config = EngineConfig(model=model, dtype=dtype, skip_tokenizer_init=True)
    _, built, _, _ = build_weights(config, torch.device("cpu"), getattr(torch, dtype), count_devices=False)
    seconds = time.perf_counter() - t0
    done.set()
    t.join()
    peak[0] = max(peak[0], _anon_kib())
    model_bytes = sum(p.numel() * p.element_size() for p in built.parameters())
    return {"load_s": seconds, "peak_anon_bytes": (peak[0] - base) * 1024, "model_bytes": model_bytes}


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Hugging Face checkpoint directory")
    ap.add_argument("--shape", help="write a random checkpoint of this preset first (with --out, --layers)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.dtype)))
        return 0
    path = args.model
    if args.shape:
        from servescope.bench.shape_checkpoint import write_shape_checkpoint

        if not args.out:
            ap.error("--shape needs --out")
        if not os.path.isdir(args.out):
            write_shape_checkpoint(args.shape, args.out, layers=args.layers)
        path = args.out
    if not path or not os.path.isdir(path):
        ap.error("--model DIR (an HF directory) or --shape with --out")
    proc = subprocess.run([sys.executable, __file__, "--child", "--model", path, "--dtype", args.dtype],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        print(f"load failed (rc {proc.returncode}{': killed, out of memory?' if proc.returncode < 0 else ''})")
        return 1
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r.update(model=path, dtype=args.dtype, checkpoint_bytes=checkpoint_bytes(path))
    r["peak_over_model"] = r["peak_anon_bytes"] / r["model_bytes"]
    gib = 1 << 30
    print(f"{path} as {args.dtype}: checkpoint {r['checkpoint_bytes'] / gib:.2f} GiB, model "
          f"{r['model_bytes'] / gib:.2f} GiB, peak anonymous memory {r['peak_anon_bytes'] / gib:.2f} GiB "
          f"({r['peak_over_model']:.2f}x the model), load {r['load_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
