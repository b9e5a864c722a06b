"""`servescope quantize`: quantise a model once (plain rounding, imatrix or GPTQ) and save it packed; later
runs load the directory as it is (`--model DIR`, no --quantization)."""

from __future__ import annotations

import argparse

from servescope.cli.args import nonneg_float, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("quantize",
                       help="quantise a model's weights (GPTQ, imatrix or plain rounding) and save them packed")
    p.add_argument("--model", default=None, help="HF directory, .gguf file or 'smollm2-135m' (default)")
    p.add_argument("--quantization", required=True, metavar="MODE",
                   help="int4 (group 32, symmetric) or int<4|8>-<g32|g64|g128|ch>[-sym|-asym], e.g. int4-g32-asym")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (must not exist, or be empty)")
    p.add_argument("--method", default="gptq", choices=["gptq", "imatrix", "rtn"],
                   help="gptq (default): each column's rounding error spread over the columns after it, "
                        "weighted by the calibration activations, the group scales searched by each input's "
                        "importance; imatrix: rounding with scales searched by each input's mean squared "
                        "activation (llama.cpp's imatrix); rtn: plain rounding, what --quantization does at load")
    p.add_argument("--calibration", default="self", metavar="self|FILE",
                   help="calibration text of gptq / imatrix: self (default: the model's own samples) or a UTF-8 "
                        "text file")
    p.add_argument("--calibration-samples", type=positive_int, default=64, metavar="N")
    p.add_argument("--calibration-tokens", type=positive_int, default=128, metavar="T", help="tokens per sample")
    p.add_argument("--damp", type=nonneg_float, default=None,
                   help="GPTQ's damping, a fraction of the Hessian's mean diagonal (default 0.3, quant/gptq.DAMP)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None)


def run(args: argparse.Namespace) -> int:
    import torch  # lazy: torch and the engine are seconds of `servescope --help`

    from servescope.cli.output import console, fmt_bytes
    from servescope.engine.calibrate import quantize_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    r = quantize_checkpoint(args.model, args.quantization, args.out, method=args.method,
                            calibration=args.calibration, samples=args.calibration_samples,
                            tokens=args.calibration_tokens, seed=args.seed, damp=args.damp)
    c = console()
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in r.seconds.items())
    c.print(f"wrote {r.out}: {r.mode} ({r.method}), {fmt_bytes(r.file_bytes)} of tensors ({stages})")
    if r.method != "rtn":
        c.print(f"calibration: {r.calibration_tokens} tokens; layer output error on them, {r.method} / plain rounding: "
                f"{r.mean_error_ratio:.2f} (mean over {len(r.errors)} projections)")
        if r.expert_errors:
            ratios = [e / p for _, e, p in r.expert_errors if p > 0]
            c.print(f"routed experts (importance-weighted rounding): weighted error, {r.method} / plain rounding: "
                    f"{sum(ratios) / max(len(ratios), 1):.2f} (mean over {len(r.expert_errors)} expert projections "
                    "that calibration tokens reached)")
    c.print(f"run it: servescope generate --model {r.out}")
    return 0
