"""Lab `prefill-vs-decode`: prefill pushes many tokens through each weight it reads (high arithmetic
intensity: compute-bound), decode pushes one token per sequence (low intensity: memory-bound).

Measured: prefill steps of one prompt at several lengths, decode steps at several batch sizes. For
each step, the cost model's FLOPs and bytes divided by the measured wall time give the achieved
FLOP/s and GB/s; FLOPs / bytes is the step's arithmetic intensity. Placed on the local roofline,
prefill sits to the right of the ridge, under the compute roof; decode to the left, under the
bandwidth slope (until its batch passes the critical batch size).
"""

from __future__ import annotations

import random

from servescope.analysis.roofline import attainable_flops
from servescope.labs.common import (
    LabOptions, LabResult, LabSession, act_dtype_name, blocks_for, context_line, lab_hardware, md_table, median,
    interleaved, new_figure, plot_roofline_legend, random_prompt, run_to_completion, save_figure, warm_up,
    write_report,
)

DECODE_CONTEXT = 32
DECODE_STEPS = 6  # decode steps per batch size and round (the median is taken)
QUICK_ROUNDS = 3  # quick mode: interleaved repeats of every point


def sizes(quick: bool) -> tuple:
    """(prefill prompt lengths, decode batch sizes). Quick: one prefill on each side of the ridge of a
    tiny model's roofline, and two batches."""
    if quick:
        return [16, 128], [1, 4]
    return [64, 128, 256, 512, 1024], [1, 4, 16, 64]


def step_point(recs: list) -> dict:
    """Median wall time, FLOPs, bytes and the achieved rates of a group of like steps."""
    wall = median([r.wall_seconds for r in recs])
    flops = median([r.flops for r in recs])
    nbytes = median([r.bytes for r in recs])
    pred = median([r.predicted_seconds for r in recs])
    return {"steps": len(recs), "wall_s": wall, "predicted_s": pred, "flops": flops, "bytes": nbytes,
            "intensity": flops / nbytes, "flops_per_s": flops / wall, "bytes_per_s": nbytes / wall,
            "bound": recs[len(recs) // 2].bound, "tokens": recs[0].num_tokens}


def measure(opts: LabOptions, session: LabSession) -> tuple:
    """(engine, points): the prefill points (one prompt per step) then the decode points (a batch of
    DECODE_CONTEXT-token prompts, every sequence decoding), each a step_point dict."""
    lens, batches = sizes(opts.quick)
    max_b, max_len = max(batches), max(lens)
    tokens = max(max_len, max_b * DECODE_CONTEXT)
    engine = session.engine(max_num_seqs=max_b, max_num_batched_tokens=max(tokens, 1024),
                            enable_chunked_prefill=False, max_model_len=max_len + 16,
                            num_kv_blocks=max(blocks_for(max_len + 16),
                                              max_b * blocks_for(DECODE_CONTEXT + DECODE_STEPS + 1, margin=1)) + 8)
    rng = random.Random(opts.seed)
    warm_up(engine, rng)
    vocab = engine.model_config.vocab_size
    # full mode: two runs of a prompt below 512 tokens, one above; quick: QUICK_ROUNDS of each
    runs = (lambda n: QUICK_ROUNDS) if opts.quick else (lambda n: 1 if n >= 512 else 2)

    def prefill(n, rnd):
        if rnd >= runs(n):
            return []
        _, rr = run_to_completion(engine, [random_prompt(rng, n, vocab)], 1, f"p{n}-")
        return [r for r in rr if r.phase == "prefill"]

    def decode(b, rnd):
        prompts = [random_prompt(rng, DECODE_CONTEXT, vocab) for _ in range(b)]
        _, rr = run_to_completion(engine, prompts, DECODE_STEPS + 1, f"d{b}r{rnd}-")
        return [r for r in rr if r.phase == "decode" and r.num_decode_seqs == b]

    rounds = QUICK_ROUNDS if opts.quick else 1
    pre = interleaved(lens, max(runs(n) for n in lens), prefill)
    dec = interleaved(batches, rounds, decode)
    points = [{"phase": "prefill", "label": f"prefill {n}", "size": n, **step_point(sum(pre[n], []))} for n in lens]
    points += [{"phase": "decode", "label": f"decode b={b}", "size": b, **step_point(sum(dec[b], []))}
               for b in batches]
    return engine, points


def _plot_rates(points: list, hw, dt: str, path) -> object:
    fig, (ax1, ax2) = new_figure(2)
    for phase, marker in (("prefill", "o-"), ("decode", "s-")):
        pts = [p for p in points if p["phase"] == phase]
        x = [p["tokens"] for p in pts]
        ax1.plot(x, [p["flops_per_s"] / 1e9 for p in pts], marker, label=phase)
        ax2.plot(x, [p["bytes_per_s"] / 1e9 for p in pts], marker, label=phase)
    ax1.axhline(hw.flops(dt) / 1e9, color="black", linestyle="--", label="probed matmul peak")
    ax2.axhline(hw.memory_bandwidth / 1e9, color="black", linestyle="--", label="probed read bandwidth")
    for ax, what in ((ax1, "achieved GFLOP/s"), (ax2, "achieved GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the step")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=8)
    ax1.set_title("Compute: prefill approaches the peak")
    ax2.set_title("Bandwidth: decode approaches the peak")
    return save_figure(fig, path)


def run(opts: LabOptions, session: LabSession) -> LabResult:
    engine, points = measure(opts, session)
    hw = lab_hardware(opts, engine)
    dt = act_dtype_name(opts)
    roof = plot_roofline_legend(hw, [(p["label"], p["intensity"], p["flops_per_s"]) for p in points],
                                opts.out / "roofline.png", dt, f"Achieved FLOP/s of engine steps on {hw.name} ({dt})")
    rates = _plot_rates(points, hw, dt, opts.out / "achieved.png")

    rows = [[p["label"], p["tokens"], p["wall_s"] * 1e3, p["predicted_s"] * 1e3, p["intensity"],
             p["flops_per_s"] / 1e9, p["bytes_per_s"] / 1e9,
             100 * p["flops_per_s"] / attainable_flops(hw, p["intensity"], dt), p["bound"]] for p in points]
    best_pf = max((p for p in points if p["phase"] == "prefill"), key=lambda p: p["flops_per_s"])
    best_dec = max((p for p in points if p["phase"] == "decode"), key=lambda p: p["bytes_per_s"])
    pf_ai = [p["intensity"] for p in points if p["phase"] == "prefill"]
    dec1 = next(p for p in points if p["phase"] == "decode")
    summary = {"points": points, "ridge_point": hw.ridge_point(dt), "peak_flops": hw.flops(dt),
               "memory_bandwidth": hw.memory_bandwidth}
    sections = [
        ("Setup", context_line(opts, engine, hw) + f"\n\nPrefill: random prompts, one step each "
         f"(no chunking). Decode: batches of {DECODE_CONTEXT}-token prompts, median of {DECODE_STEPS} decode steps"
         + (f" in each of {QUICK_ROUNDS} interleaved rounds (prefills too). " if opts.quick else ". ") +
         "FLOPs and bytes are the cost model's counts for each step; rates = count / measured wall time."),
        ("Results", md_table(["step", "tokens", "measured ms", "predicted ms", "FLOP/B", "GFLOP/s", "GB/s",
                              "% of roofline", "bound (model)"], rows)),
        ("What it shows",
         f"The ridge point of this machine is {hw.ridge_point(dt):.1f} FLOP/B. Prefill steps have an intensity "
         f"of {min(pf_ai):.0f} to {max(pf_ai):.0f} FLOP/B (growing with the prompt) and reach up to "
         f"{best_pf['flops_per_s'] / 1e9:.0f} GFLOP/s "
         f"({100 * best_pf['flops_per_s'] / hw.flops(dt):.0f}% of the probed matmul peak): compute-bound. "
         f"Decode at batch {dec1['size']} does {dec1['intensity']:.2f} FLOP per byte (every weight read for one "
         f"token per sequence) and is limited by "
         f"bandwidth: the best decode step moved {best_dec['bytes_per_s'] / 1e9:.1f} GB/s "
         f"({100 * best_dec['bytes_per_s'] / hw.memory_bandwidth:.0f}% of the probed read bandwidth). "
         "Batching decode moves its point to the right, towards the ridge. The gap below the roof is the "
         "engine's per-step overhead (Python, per-op dispatch) and small unfused ops."),
    ]
    report = write_report(opts.out, "Lab: prefill vs decode on the roofline", sections, [roof, rates], summary)
    return LabResult("prefill-vs-decode", opts.out, report, [roof, rates], summary)
