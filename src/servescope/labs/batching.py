"""Lab `batching`: decode reads every weight once per step whatever the batch, so step time stays
flat while the step is memory-bound, and tokens/s grows with the batch; past the critical batch
(where FLOPs / peak overtakes bytes / bandwidth) the step turns compute-bound and its time rises.

Measured: the median decode step time at each batch size (all sequences decoding, short context).
Predicted: the engine's per-step prediction (the roofline on the probed peaks, the probe's measured
kernel rates and host overhead), and the same plus one constant fitted at batch 1 only: the residual
that prediction still misses.
"""

from __future__ import annotations


from servescope.analysis.cost_model import critical_batch_size
from servescope.labs.common import (
    decode_sweep, LabOptions, LabResult, LabSession, act_dtype_name, context_line, lab_hardware,
    md_table, median, new_figure, rel_error, save_figure, write_report,
)

PROMPT_LEN = 32
DECODE_STEPS = 8
QUICK_ROUNDS = 3  # quick mode: interleaved repeats of every batch size


def batch_sizes(quick: bool) -> list:
    return [1, 2, 4] if quick else [1, 2, 4, 8, 16, 32, 64]


def overhead_fit(measured: list, predicted: list) -> float:
    """The constant per-step overhead that makes the prediction match the first point (batch 1),
    never negative."""
    return max(measured[0] - predicted[0], 0.0)


def measure(opts: LabOptions, session: LabSession) -> tuple:
    """(engine, {batch: [the decode StepRecords where all `batch` sequences decode]})."""
    return decode_sweep(session, batch_sizes(opts.quick), QUICK_ROUNDS if opts.quick else 1, opts.seed,
                        PROMPT_LEN, DECODE_STEPS, 1024)


def run(opts: LabOptions, session: LabSession) -> LabResult:
    engine, by_b = measure(opts, session)
    sizes = list(by_b)
    hw = lab_hardware(opts, engine)
    cfg = engine.model_config
    rows, meas, pred = [], [], []
    for b, dec in by_b.items():
        m, p = median([r.wall_seconds for r in dec]), median([r.predicted_seconds for r in dec])
        meas.append(m)
        pred.append(p)
        bound = dec[len(dec) // 2].bound if dec else "-"
        rows.append([b, len(dec), m, p, bound])
    overhead = overhead_fit(meas, pred)
    crit = critical_batch_size(cfg, hw, act_dtype_name(opts), PROMPT_LEN + DECODE_STEPS // 2)
    table = []
    for (b, n, m, p, bound) in rows:
        table.append([b, n, m * 1e3, p * 1e3, (p + overhead) * 1e3, 100 * rel_error(p + overhead, m),
                      b / m, b / (p + overhead), bound])

    fig, (ax1, ax2) = new_figure(2)
    ax1.plot(sizes, [m * 1e3 for m in meas], "o-", label="measured (median step)")
    ax1.plot(sizes, [p * 1e3 for p in pred], "s--", label="cost model (probed peaks, kernel rates, host overhead)")
    ax1.plot(sizes, [(p + overhead) * 1e3 for p in pred], "^:",
             label=f"cost model + {overhead * 1e3:.1f} ms residual (fit at b=1)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("decode batch size (sequences)")
        if crit and crit != float("inf"):
            ax.axvline(crit, color="gray", linestyle=":", label=f"critical batch {crit:.1f}")
        ax.grid(True, linewidth=0.3)
    ax1.set_ylabel("decode step time (ms)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("Decode step time vs batch")
    ax1.legend(fontsize=8)
    ax2.plot(sizes, [b / m for b, m in zip(sizes, meas)], "o-", label="measured")
    ax2.plot(sizes, [b / (p + overhead) for b, p in zip(sizes, pred)], "^:", label="cost model + residual")
    ax2.set_ylabel("decode tokens / s")
    ax2.set_title("Throughput vs batch")
    ax2.legend(fontsize=8)
    plot = save_figure(fig, opts.out / "batching.png")

    flat = meas[min(2, len(meas) - 1)] / meas[0]
    summary = {"batch_sizes": sizes, "measured_step_s": meas, "predicted_step_s": pred,
               "fitted_overhead_s": overhead, "critical_batch_size": crit,
               "tokens_per_s": [b / m for b, m in zip(sizes, meas)],
               "step_time_ratio_b4_vs_b1": flat, "step_time_ratio_max_vs_b1": meas[-1] / meas[0],
               "bounds": [r[4] for r in rows]}
    sections = [
        ("Setup", context_line(opts, engine, hw) + f"\n\nEach batch: {PROMPT_LEN}-token random prompts, greedy, "
         f"{DECODE_STEPS + 1} output tokens; the median of the steps where all sequences decode"
         + (f", over {QUICK_ROUNDS} interleaved rounds." if opts.quick else ".")),
        ("Results", md_table(["batch", "steps", "measured ms", "predicted ms", "predicted+residual ms",
                              "error %", "measured tok/s", "predicted tok/s", "bound (model)"], table)),
        ("What it shows",
         f"From batch 1 to {sizes[min(2, len(sizes) - 1)]} the step time changes by x{flat:.2f} while tokens/s "
         f"grows almost in proportion to the batch: decode reads all {engine.weight_bytes / 2**20:.0f} MiB of "
         f"weights every step, and more sequences share that read. The cost model puts the crossover to "
         f"compute-bound at batch {crit:.1f} on this machine (ridge {hw.ridge_point(act_dtype_name(opts)):.1f} "
         f"FLOP/B); past it the step time rises with the batch (x{meas[-1] / meas[0]:.2f} at batch {sizes[-1]}). "
         f"The prediction is the cost model every StepRecord carries: the roofline on the probed peaks, "
         f"each linear op and decode attention no faster than the engine's kernels measured by the probe, "
         "plus the host overhead the probe measured "
         f"({(hw.step_overhead_s + cfg.num_hidden_layers * hw.layer_overhead_s) * 1e3:.1f} ms "
         f"per step: Python scheduling, sampling and the dispatch of every op of all {cfg.num_hidden_layers} "
         f"layers). The residual fitted at batch 1 ({overhead * 1e3:.2f} ms) is what it still misses there."),
    ]
    report = write_report(opts.out, "Lab: batching (the memory-bandwidth bottleneck)", sections, [plot], summary)
    return LabResult("batching", opts.out, report, [plot], summary)
