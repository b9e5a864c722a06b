"""Decode step time vs batch size: the memory-bandwidth bottleneck, measured and predicted.

Decode reads every weight once per step whatever the batch, so the step time stays nearly flat as the
batch grows (tokens/s grows with it) until the matmuls become compute-bound. For each batch size
this runs `bench latency`'s runner (one engine, loaded once) and records the median decode step
time, the cost model's prediction for the same steps, tokens/s and achieved GB/s.

    python benchmarks/decode_batch_sweep.py --json benchmarks/results/decode_batch_sweep.json \
        --plot docs/img/decode_batch_sweep.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)

    import torch

    from servescope.bench.envinfo import environment_info
    from servescope.bench.latency import run_engine_latency
    from servescope.engine.llm import LLM
    from servescope.measure.local_hardware import hardware_for_device

    if a.threads:
        torch.set_num_threads(a.threads)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    llm = LLM(model=a.model, dtype=a.dtype, max_num_seqs=max(sizes), num_threads=a.threads)
    hw = hardware_for_device(llm.engine.device, None)
    rows = []
    for b in sizes:
        r = run_engine_latency(llm, b, a.input_len, a.output_len, iters=a.iters, hardware=hw, dtype=a.dtype)
        d = r["phases"]["decode"]
        rows.append({"batch_size": b, "median_step_seconds": d["median_step_seconds"],
                     "median_predicted_step_seconds": d["median_predicted_step_seconds"],
                     "decode_tokens_per_s": r["decode_tokens_per_s"], "ttft_s": r["ttft_s"],
                     "achieved_bytes_per_s": d["achieved_bytes_per_s"],
                     "pct_of_bandwidth": d["pct_of_bandwidth"], "bound": d["bound"]})
        print(f"batch {b:3d}: decode step {d['median_step_seconds'] * 1e3:7.1f} ms "
              f"(predicted {d['median_predicted_step_seconds'] * 1e3:6.1f} ms), "
              f"{r['decode_tokens_per_s']:7.1f} tok/s, {d['achieved_bytes_per_s'] / 1e9:5.1f} GB/s", flush=True)
    data = {"benchmark": "decode_batch_sweep", **environment_info(),
            "shape": {"input_len": a.input_len, "output_len": a.output_len, "iters": a.iters, "dtype": a.dtype,
                      "model": a.model or "smollm2-135m"},
            "hardware": {"name": hw.name, "memory_bandwidth": hw.memory_bandwidth,
                         "peak_flops": hw.flops(a.dtype)},
            "rows": rows}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(data, indent=2) + "\n")
    if a.plot:
        plot(data, a.plot)
    return 0


def plot(data: dict, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = data["rows"]
    bs = [r["batch_size"] for r in rows]
    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(bs, [r["median_step_seconds"] * 1e3 for r in rows], "o-", label="measured")
    ax1.plot(bs, [r["median_predicted_step_seconds"] * 1e3 for r in rows], "s--", label="cost model")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch size (sequences decoding)")
    ax1.set_ylabel("decode step time (ms)")
    ax1.set_title("decode step time vs batch")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot(bs, [r["decode_tokens_per_s"] for r in rows], "o-")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("decode tokens/s")
    ax2.set_title("decode throughput vs batch")
    ax2.grid(alpha=0.3)
    m = data["machine"]
    fig.suptitle(f"{data['shape']['model']} {data['shape']['dtype']}, {m['cpu']} ({m['torch_threads']} threads), "
                 f"{data['date_utc'][:10]}", fontsize=9)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
