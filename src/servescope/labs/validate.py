"""Lab `validate`: the cost model's predicted step time against the engine's measured step time.

Points: decode steps at batch 1..32 (every sequence at the same short context) and single-prompt
prefill steps of 128..2048 tokens (one step each, chunked prefill off). Measured = median wall time
of like steps; predicted = what every StepRecord carries: the roofline on the probed spec plus the
host overhead the probe measured (per step + per layer, on a tiny model: engine/overhead.py), with
each linear op no faster than the rate the probe measured for the engine's linear kernel at that
many rows (model/kernel_probe.py, on 1024 x 1024 matrices of no model). Nothing in that
prediction is fitted to these steps.

For comparison the report also shows the raw roofline (FLOPs and bytes and the two peaks only), and two
calibrations with constants fitted on a few of the points -- decode batch 1 (memory-bound: fixes
the overhead) and prefill 512 (compute-bound: fixes the compute efficiency):
    t = step_cost(..., efficiency={"compute": e}, overhead_s=o)
and every other point is a prediction, not a fit. Memory efficiency stays 1: the probe measured
the bandwidth the engine can reach.
"""

from __future__ import annotations

import random

from servescope.labs.common import (
    LabOptions, LabResult, LabSession, act_dtype_name, blocks_for, context_line, lab_hardware, md_table, median,
    new_figure, random_prompt, rel_error, run_to_completion, save_figure, seqs_of, warm_up, write_report,
)

DECODE_CONTEXT = 128
DECODE_ROUNDS = 2
REPEATS = 3  # whole repeats (probe + every point), medians per point
FIT_DECODE_BATCH = 1
FIT_PREFILL_LEN = 512
TOLERANCE = 0.25


def points(quick: bool) -> tuple:
    """(decode batch sizes, prefill lengths)."""
    if quick:
        return [1, 2], [32, 64]
    return [1, 2, 4, 8, 16, 32], [128, 256, 512, 1024, 2048]


def fit_calibration(predict, t_decode: float, t_prefill: float) -> tuple:
    """Solve for (overhead o, compute efficiency e) so that predict(kind, e, o) matches both points:
    predict("decode", e, o) == t_decode and predict("prefill", e, o) == t_prefill.

    The prediction is o + (a sum of max(compute / e, memory) terms): increasing in 1/e and in o.
    For each e, o is whatever closes the decode point; then bisect e on the prefill point. If the
    decode step is faster than its roofline (o would be negative), o = 0. If even e = 1 predicts
    prefill too slow, e = 1."""
    def o_for(e):
        return max(t_decode - predict("decode", e, 0.0), 0.0)

    def gap(e):
        return predict("prefill", e, o_for(e)) - t_prefill  # decreasing in e

    lo, hi = 1e-3, 1.0
    if gap(hi) >= 0:
        return o_for(hi), hi
    if gap(lo) <= 0:
        return o_for(lo), lo
    for _ in range(60):
        mid = (lo + hi) / 2
        if gap(mid) > 0:
            lo = mid
        else:
            hi = mid
    e = (lo + hi) / 2
    return o_for(e), e


def fit_decode_efficiency(predict_big, t_big: float, lo: float = 1e-3, hi: float = 1.0) -> float:
    """The decode compute efficiency e_d with predict_big(e_d) == t_big (the largest decode batch),
    by bisection; predict_big falls as e_d grows. 1 when even e_d = 1 predicts too slow."""
    if predict_big(hi) >= t_big:
        return hi
    if predict_big(lo) <= t_big:
        return lo
    for _ in range(50):
        mid = (lo + hi) / 2
        if predict_big(mid) > t_big:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _repeat_line(per_repeat: list) -> str:
    parts = []
    for i, r in enumerate(per_repeat):
        dec = [abs(p["error"]) for p in r["points"] if p["phase"] == "decode"]
        pre = [abs(p["error"]) for p in r["points"] if p["phase"] == "prefill"]
        parts.append(f"repeat {i + 1}: probe {r['memory_bandwidth'] / 1e9:.1f} GB/s, {r['peak_flops'] / 1e9:.0f} "
                     f"GFLOP/s; decode max |error| {100 * max(dec):.0f}% ({sum(e <= TOLERANCE for e in dec)}/"
                     f"{len(dec)} within 25%), prefill max {100 * max(pre):.0f}%")
    return "; ".join(parts)


def _rates_line(hw, dt: str) -> str:
    pts = hw.linear_rates.get(dt) or []
    if not pts:
        return "none measured"
    return ", ".join(f"M={m}: {r / 1e9:.1f} GB/s" for m, r in pts)


def error_summary(errors: list) -> dict:
    abs_e = [abs(x) for x in errors]
    if not abs_e:
        return {"max_abs": float("nan"), "mean_abs": float("nan"), "within_tolerance": 0, "count": 0}
    return {"max_abs": max(abs_e), "mean_abs": sum(abs_e) / len(abs_e),
            "within_tolerance": sum(1 for x in abs_e if x <= TOLERANCE), "count": len(abs_e)}


def run(opts: LabOptions, session: LabSession) -> LabResult:
    from servescope.analysis.cost_model import step_cost

    batches, lens = points(opts.quick)
    reps = 1 if opts.quick else 3
    dec_steps = 3 if opts.quick else 6
    max_len = max(lens) + 16
    runs = []  # per repeat: (hw, [(phase, size, median wall, median prediction, seqs), ...])
    for rep in range(1 if opts.quick else REPEATS):
        if opts.hardware is None and not opts.quick:
            # probe again now, in the same minutes as the steps it predicts: on a shared VM the read
            # bandwidth and even the matmul rate move by tens of percent between minutes (VALIDATION.md)
            import torch

            from servescope.analysis.probe import probe_local_hardware

            if opts.threads:
                torch.set_num_threads(opts.threads)
            probe_local_hardware(force=True)
        # a new engine per repeat (same weights): its step predictions use the probe just taken
        engine = session.engine(max_num_seqs=max(batches), enable_chunked_prefill=False,
                                max_num_batched_tokens=max(max_len, max(batches) * DECODE_CONTEXT),
                                max_model_len=max(max_len, DECODE_CONTEXT + dec_steps + 16),
                                num_kv_blocks=max(blocks_for(max_len), max(batches) * blocks_for(
                                    DECODE_CONTEXT + dec_steps + 1, margin=1)) + 8)
        hw = lab_hardware(opts, engine)
        cfg = engine.model_config
        rng = random.Random(opts.seed + rep)
        warm_up(engine, rng)
        warm_up(engine, rng, prompt_len=min(lens[-1], 512), batch=1, max_tokens=1)
        vocab = cfg.vocab_size
        measured = []  # (phase, size, median wall, median prediction, seqs of a representative step)
        # decode points in DECODE_ROUNDS interleaved rounds (1, 2, ..., 32, then again): a slow or fast
        # phase of a shared machine lasts seconds, long enough to bias every step of one point
        dec_by_b = {b: [] for b in batches}
        for rnd in range(1 if opts.quick else DECODE_ROUNDS):
            for b in batches:
                _, recs = run_to_completion(engine, [random_prompt(rng, DECODE_CONTEXT, vocab) for _ in range(b)],
                                            dec_steps + 1, f"v{rep}b{b}r{rnd}-")
                dec_by_b[b] += [r for r in recs if r.phase == "decode" and r.num_decode_seqs == b]
        for b in batches:
            dec = dec_by_b[b]
            mid = dec[len(dec) // 2]
            measured.append(("decode", b, median([r.wall_seconds for r in dec]),
                             median([r.predicted_seconds for r in dec]), seqs_of(mid)))
        for n in lens:
            recs = []
            for _ in range(1 if n >= 2048 else reps):
                _, rr = run_to_completion(engine, [random_prompt(rng, n, vocab)], 1, f"v{rep}n{n}-")
                recs += [r for r in rr if r.phase == "prefill"]
            measured.append(("prefill", n, median([r.wall_seconds for r in recs]),
                             median([r.predicted_seconds for r in recs]), seqs_of(recs[0])))
        runs.append((hw, measured))
    dt = act_dtype_name(opts)
    # each point: the median over the repeats of its measured time and of its prediction (each repeat
    # predicted with its own probe); the per-repeat errors are kept in results.json
    measured = [(p[0], p[1], median([m[i][2] for _, m in runs]), median([m[i][3] for _, m in runs]), p[4])
                for i, p in enumerate(runs[0][1])]
    hw = runs[-1][0].replace(memory_bandwidth=median([h.memory_bandwidth for h, _ in runs]),
                             peak_flops={k: median([h.peak_flops[k] for h, _ in runs]) for k in hw.peak_flops})
    per_repeat = [{"memory_bandwidth": h.memory_bandwidth, "peak_flops": h.flops(dt),
                   "points": [{"phase": p[0], "size": p[1], "measured_s": p[2], "predicted_s": p[3],
                               "error": rel_error(p[3], p[2])} for p in m]} for h, m in runs]

    # the roofline alone: the probed peaks without the measured overheads and kernel rates
    peaks_only = hw.replace(step_overhead_s=0.0, layer_overhead_s=0.0, linear_rates={}, decode_attention_flops={})

    def predict_point(p, e, o, e_dec=None):
        eff = e_dec if (e_dec is not None and p[0] == "decode") else e
        return step_cost(cfg, p[4], peaks_only, dt, dt, dt, efficiency={"compute": eff}, overhead_s=o).predicted_seconds

    fit_dec = next(p for p in measured if p[0] == "decode" and p[1] == (FIT_DECODE_BATCH if not opts.quick else batches[0]))
    fit_big = next(p for p in measured if p[0] == "decode" and p[1] == max(batches))
    fit_pre_len = FIT_PREFILL_LEN if FIT_PREFILL_LEN in lens else lens[len(lens) // 2]
    fit_pre = next(p for p in measured if p[0] == "prefill" and p[1] == fit_pre_len)

    def fit_oe(e_dec):
        return fit_calibration(lambda kind, e, o: predict_point(fit_dec if kind == "decode" else fit_pre, e, o, e_dec),
                               fit_dec[2], fit_pre[2])

    overhead, eff = fit_oe(None)
    e_dec = fit_decode_efficiency(lambda ed: predict_point(fit_big, *fit_oe(ed)[::-1], ed), fit_big[2])
    overhead3, eff3 = fit_oe(e_dec)
    cal_a = {"name": "A", "fit": [fit_dec, fit_pre], "predict": lambda p: predict_point(p, eff, overhead)}
    cal_b = {"name": "B", "fit": [fit_dec, fit_pre, fit_big],
             "predict": lambda p: predict_point(p, eff3, overhead3, e_dec)}
    rows, table = [], []
    for p in measured:
        raw = step_cost(cfg, p[4], peaks_only, dt, dt, dt).predicted_seconds
        probed = p[3]
        row = {"phase": p[0], "size": p[1], "measured_s": p[2], "raw_predicted_s": raw,
               "raw_error": rel_error(raw, p[2]), "predicted_s": probed, "error": rel_error(probed, p[2])}
        cells = [p[0], p[1], p[2] * 1e3, raw * 1e3, 100 * rel_error(raw, p[2]), probed * 1e3,
                 f"{100 * rel_error(probed, p[2]):+.1f}"]
        for cal in (cal_a, cal_b):
            t = cal["predict"](p)
            fitted = any(p is f for f in cal["fit"])
            row.update({f"calibrated_{cal['name']}_s": t, f"calibrated_{cal['name']}_error": rel_error(t, p[2]),
                        f"fitted_in_{cal['name']}": fitted})
            cells += [t * 1e3, "fit" if fitted else f"{100 * rel_error(t, p[2]):+.1f}"]
        rows.append(row)
        table.append(cells)
    per_phase = {}
    for phase in ("decode", "prefill"):
        rs = [r for r in rows if r["phase"] == phase]
        per_phase[phase] = {"raw": error_summary([r["raw_error"] for r in rs]),
                            "predicted": error_summary([r["error"] for r in rs])}
        for c in ("A", "B"):
            held = [r[f"calibrated_{c}_error"] for r in rs if not r[f"fitted_in_{c}"]]
            per_phase[phase][f"calibrated_{c}_held_out"] = error_summary(held)

    fig, (ax1, ax2) = new_figure(2)
    for ax, phase, xlabel in ((ax1, "decode", "decode batch size"), (ax2, "prefill", "prompt tokens")):
        rs = [r for r in rows if r["phase"] == phase]
        x = [r["size"] for r in rs]
        ax.plot(x, [r["measured_s"] * 1e3 for r in rs], "o-", linewidth=2, label="measured (median)")
        ax.plot(x, [r["raw_predicted_s"] * 1e3 for r in rs], "s--", label="roofline only (probed peaks)")
        ax.plot(x, [r["predicted_s"] * 1e3 for r in rs], "D-", label="predicted: roofline, probed kernel rates, host overhead")
        ax.plot(x, [r["calibrated_A_s"] * 1e3 for r in rs], "^:", label=f"A: +{overhead * 1e3:.1f} ms, eff {eff:.2f}")
        ax.plot(x, [r["calibrated_B_s"] * 1e3 for r in rs], "v-.", label=f"B: +{overhead3 * 1e3:.1f} ms, eff {eff3:.2f}, "
                                                                          f"decode eff {e_dec:.2f}")
        fx = [r["size"] for r in rs if r["fitted_in_B"]]
        ax.plot(fx, [r["measured_s"] * 1e3 for r in rs if r["fitted_in_B"]], "k*", markersize=12,
                label="fit points (A: all but the largest batch)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{phase}: predicted vs measured")
        ax.grid(True, which="both", linewidth=0.3)
        ax.legend(fontsize=7)
    plot = save_figure(fig, opts.out / "validation.png")

    summary = {"points": rows, "per_phase": per_phase,
               "calibration_A": {"overhead_s": overhead, "overhead_per_layer_s": overhead / cfg.num_hidden_layers,
                                 "compute_efficiency": eff,
                                 "fit_points": [f"decode b={fit_dec[1]}", f"prefill {fit_pre[1]}"]},
               "calibration_B": {"overhead_s": overhead3, "overhead_per_layer_s": overhead3 / cfg.num_hidden_layers,
                                 "compute_efficiency": eff3, "decode_compute_efficiency": e_dec,
                                 "fit_points": [f"decode b={fit_dec[1]}", f"decode b={fit_big[1]}",
                                                f"prefill {fit_pre[1]}"]},
               "hardware": hw.to_dict(), "decode_context": DECODE_CONTEXT, "repeats": per_repeat,
               "host_overhead": {"step_s": hw.step_overhead_s, "layer_s": hw.layer_overhead_s,
                                 "per_step_total_s": hw.step_overhead_s + cfg.num_hidden_layers * hw.layer_overhead_s}}

    def fmt(s):
        if not s["count"]:
            return "no held-out point"
        return f"max {100 * s['max_abs']:.0f}%, mean {100 * s['mean_abs']:.0f}%, {s['within_tolerance']}/{s['count']} within 25%"

    phase_rows = [[ph, fmt(v["predicted"]), fmt(v["raw"]), fmt(v["calibrated_A_held_out"]),
                   fmt(v["calibrated_B_held_out"])] for ph, v in per_phase.items()]
    oh_total = hw.step_overhead_s + cfg.num_hidden_layers * hw.layer_overhead_s
    sections = [
        ("Setup", context_line(opts, engine, hw) + f"\n\nDecode: batch b of {DECODE_CONTEXT}-token random prompts, "
         f"median of {dec_steps} decode steps in each of {1 if opts.quick else DECODE_ROUNDS} interleaved rounds. Prefill: one prompt, one step, median of {reps} runs "
         f"(1 for 2048). The whole measurement (probe, then every point) ran {len(runs)} times; each point's "
         "measured and predicted times below are the medians over those repeats (each repeat predicted with "
         "its own probe), the peaks shown are the probes' medians, and per-repeat errors are in "
         f"results.json ({_repeat_line(per_repeat)}). Regenerate with `servescope lab validate` "
         "(add `--out DIR`)."),
        ("Constants",
         f"**Predicted** (what each StepRecord carries): probed {hw.flops(dt) / 1e9:.0f} GFLOP/s {dt}, "
         f"{hw.memory_bandwidth / 1e9:.1f} GB/s, and the host overhead the probe measured on a tiny model "
         f"({hw.step_overhead_s * 1e3:.2f} ms per step + {hw.layer_overhead_s * 1e6:.0f} µs per layer = "
         f"{oh_total * 1e3:.2f} ms per step here), and the linear ops no faster than the engine's linear "
         f"kernel measured by the probe at the same row count ({_rates_line(hw, dt)}): nothing fitted to "
         "these points.\n\n"
         "**Roofline**: the same peaks alone (no overhead, no kernel rates). A and B start from it.\n\n"
         f"**A** (2 constants, fitted on decode batch {fit_dec[1]} and prefill {fit_pre[1]}): per-step overhead "
         f"o = {overhead * 1e3:.2f} ms (= {overhead / cfg.num_hidden_layers * 1e6:.0f} µs per layer over "
         f"{cfg.num_hidden_layers} layers), compute efficiency e = {eff:.3f}.\n\n"
         f"**B** (3 constants, fitted on decode batch {fit_dec[1]}, decode batch {fit_big[1]} and prefill "
         f"{fit_pre[1]}): o = {overhead3 * 1e3:.2f} ms, prefill compute efficiency e = {eff3:.3f} and decode "
         f"compute efficiency e_d = {e_dec:.3f}" + (": matmuls of a few rows (decode) use the cores worse than "
         "the probe's square ones" if e_dec < 0.99 else "") + ".\n\nMemory efficiency is 1 in both. Every point not marked "
         "`fit` is a prediction."),
        ("Per point", md_table(["phase", "size", "measured ms", "roofline ms", "roofline err %", "predicted ms",
                                "predicted err %", "A ms", "A err %", "B ms", "B err %"], table)),
        ("Per phase", md_table(["phase", "predicted |error|", "roofline only |error|", "A |error| (held-out)",
                                "B |error| (held-out)"], phase_rows)),
    ]
    report = write_report(opts.out, "Cost model validation: predicted vs measured step time", sections, [plot], summary)
    return LabResult("validate", opts.out, report, [plot], summary)
