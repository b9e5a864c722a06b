"""A float32 stand-in for the weights the embedded SmolLM2 GGUF was quantised from, to judge the 4-bit
modes against something that is not already on a 4-bit grid.

The embedded model is the only real model here, and its projections are Q4_1: its dequantised float32
weights sit exactly on a 4-bit asymmetric grid per group of 32, so int4-g32-asym re-finds them (KL ~0.003)
and symmetric int4 quantises them a second time (KL ~0.35). Rounding to a grid moves each weight by at most
half a step, about uniformly; adding back uniform noise of half a step (the file's own per-group scale d:
U(-d/2, d/2), and likewise for the Q8_0 embedding) gives weights off any grid whose Q4_1 quantisation is
the file again, in distribution: a plausible float model before quantisation, not the original one.
It is written as a Hugging Face checkpoint (the loader's float32 state dict of the GGUF, the noise added,
its config and tokenizer beside it):

    python benchmarks/dithered_reference.py /tmp/smollm2-dithered [--seed 0]
    python benchmarks/quant_accuracy.py --model /tmp/smollm2-dithered --modes int8 int8-g32 int4 int4-g32-asym
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from servescope.quant.packed import dequantize  # noqa: E402
from servescope.loader.source import load_model_source, resolve_model_path  # noqa: E402
from servescope.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = resolve_model_path("smollm2-135m")
    src = load_model_source(path, keep_packed=True)  # packed: {hf name: (blocks, float16 scales, K)}
    sd = {n: t for n, t in src.state_dict.items() if n not in src.packed}  # the norms, as the file has them
    gen = torch.Generator().manual_seed(args.seed)
    for name, (qs, scales, k) in src.packed.items():
        w = dequantize(qs, scales, k)
        d = (scales[..., 0] if scales.dim() == 3 else scales).float().abs()  # the grid step of each group
        step = d.repeat_interleave(32, dim=1)[:, :k]
        sd[name] = w + (torch.rand(w.shape, generator=gen) - 0.5) * step
        print(f"{name}: {tuple(w.shape)}, noise of half a step (mean step {step.mean():.2e})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(src.config.to_hf_dict(), f, indent=2)
    save_file({n: t.contiguous() for n, t in sd.items()}, os.path.join(args.out, "model.safetensors"))
    load_tokenizer(path).hf.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
