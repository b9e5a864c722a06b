"""Lab `validate`: the cost model's predicted step time against the engine's measured step time.

Points: decode steps at batch 1..32 (every sequence at the same short context) and single-prompt
prefill steps of 128..2048 tokens (one step each, chunked prefill off). Measured = median wall time
of like steps; predicted = what every StepRecord carries: the roofline on the probed spec plus the
host overhead the probe measured (per step + per layer, on a tiny model: measure/overhead.py), with
each linear op no faster than the rate the probe measured for the engine's linear kernel at that
many rows (measure/kernel_rates.py, on 1024 x 1024 matrices of no model). Nothing in that
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

import torch

from servescope.analysis.bandwidth import bandwidth_origin
from servescope.analysis.cost_model import step_cost
from servescope.measure.local_hardware import probe_local_cpu
from servescope.labs.validate_mixed import measure_mixed, mixed_section
from servescope.labs.common import (
    LabOptions, LabResult, LabSession, act_dtype_name, blocks_for, context_line, decode_only_records,
    interleaved, lab_hardware, md_table, median, new_figure, random_prompt, rel_error, run_to_completion,
    save_figure, seqs_of, warm_up, write_report,
)

DECODE_CONTEXT = 128
DECODE_STEPS = 6  # decode steps per batch size and round (the median is taken)
DECODE_ROUNDS = 2
PREFILL_RUNS = 3  # runs of each prompt length (1 of 2048), interleaved
REPEATS = 3  # whole repeats (probe + every point), medians per point
FIT_DECODE_BATCH = 1
FIT_PREFILL_LEN = 512
TOLERANCE = 0.25


def points(quick: bool) -> tuple:
    """(decode batch sizes, prefill lengths). Quick: one GEMV and one matmul batch, and prompts long
    enough that a tiny model's prefill is more than its host overhead (which is measured on decode)."""
    if quick:
        return [1, 4], [256, 512]
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
        parts.append(f"repeat {i + 1}: {r['memory_bandwidth'] / 1e9:.1f} GB/s ({r['bandwidth_origin']}), "
                     f"{r['peak_flops'] / 1e9:.0f} "
                     f"GFLOP/s; decode max |error| {100 * max(dec):.0f}% ({sum(e <= TOLERANCE for e in dec)}/"
                     f"{len(dec)} within 25%), prefill max {100 * max(pre):.0f}%")
    return "; ".join(parts)


def _rates_line(hw, dt: str) -> str:
    pts = hw.linear_rates.get(dt) or []
    if not pts:
        return "none measured"
    return ", ".join(f"M={m}: {r / 1e9:.1f} GB/s" for m, r in pts)


def _table_line(hw) -> str:
    tables = list(hw.kernel_tables.values())
    return "; ".join(f"{t['key']}: {t.get('source', '')}" for t in tables) or "no kernel table"


def error_summary(errors: list) -> dict:
    abs_e = [abs(x) for x in errors]
    if not abs_e:
        return {"max_abs": float("nan"), "mean_abs": float("nan"), "within_tolerance": 0, "count": 0}
    return {"max_abs": max(abs_e), "mean_abs": sum(abs_e) / len(abs_e),
            "within_tolerance": sum(1 for x in abs_e if x <= TOLERANCE), "count": len(abs_e)}


def measure_repeat(opts: LabOptions, session: LabSession, rep: int) -> tuple:
    """One whole measurement: (the spec its steps predicted with, the engine, [(phase, size, median wall,
    median prediction, seqs of a representative step)] for every decode then prefill point)."""
    batches, lens = points(opts.quick)
    max_len = max(lens) + 16
    if opts.hardware is None and not opts.quick:
        # probe again now, in the same minutes as the steps it predicts: on a shared VM the read
        # bandwidth and even the matmul rate move by tens of percent between minutes (VALIDATION.md)
        if opts.threads:
            torch.set_num_threads(opts.threads)  # the probe is keyed by the thread count it ran with
        probe_local_cpu(force=True)
    # a new engine per repeat (same weights): its step predictions use the probe just taken
    engine = session.engine(max_num_seqs=max(batches), enable_chunked_prefill=False,
                            max_num_batched_tokens=max(max_len, max(batches) * DECODE_CONTEXT),
                            max_model_len=max(max_len, DECODE_CONTEXT + DECODE_STEPS + 16),
                            num_kv_blocks=max(blocks_for(max_len), max(batches) * blocks_for(
                                DECODE_CONTEXT + DECODE_STEPS + 1, margin=1)) + 8)
    hw = engine.hardware or lab_hardware(opts, engine)  # the spec its StepRecords predicted with
    rng = random.Random(opts.seed + rep)
    warm_up(engine, rng)
    warm_up(engine, rng, prompt_len=min(lens[-1], 512), batch=1, max_tokens=1)
    vocab = engine.model_config.vocab_size

    def decode(b, rnd):
        return decode_only_records(engine, rng, b, DECODE_CONTEXT, DECODE_STEPS, f"v{rep}b{b}r{rnd}-")

    def prefill(n, rnd):
        if n >= 2048 and rnd:  # one run of the longest prompt (seconds each)
            return []
        _, rr = run_to_completion(engine, [random_prompt(rng, n, vocab)], 1, f"v{rep}n{n}r{rnd}-")
        return [r for r in rr if r.phase == "prefill"]

    # decode points in DECODE_ROUNDS interleaved rounds (1, 2, ..., 32, then again), prefill points in
    # PREFILL_RUNS: a slow or fast phase of a shared machine lasts seconds
    measured = []
    for b, runs in interleaved(batches, DECODE_ROUNDS, decode).items():
        dec = sum(runs, [])
        measured.append(("decode", b, median([r.wall_seconds for r in dec]),
                         median([r.predicted_seconds for r in dec]), seqs_of(dec[len(dec) // 2])))
    for n, runs in interleaved(lens, PREFILL_RUNS, prefill).items():
        recs = sum(runs, [])
        measured.append(("prefill", n, median([r.wall_seconds for r in recs]),
                         median([r.predicted_seconds for r in recs]), seqs_of(recs[0])))
    return hw, engine, measured


def combine_repeats(runs: list, dt: str) -> tuple:
    """(each point with the median over the repeats of its measured time and of its prediction, each
    repeat predicted with its own probe; the spec with the probes' median peaks; the per-repeat errors)."""
    measured = [(p[0], p[1], median([m[i][2] for _, m in runs]), median([m[i][3] for _, m in runs]), p[4])
                for i, p in enumerate(runs[0][1])]
    last = runs[-1][0]
    hw = last.replace(memory_bandwidth=median([h.memory_bandwidth for h, _ in runs]),
                      peak_flops={k: median([h.peak_flops[k] for h, _ in runs]) for k in last.peak_flops})
    per_repeat = [{"memory_bandwidth": h.memory_bandwidth, "peak_flops": h.flops(dt),
                   "bandwidth_origin": bandwidth_origin(h) or "the probe's own figure",
                   "points": [{"phase": p[0], "size": p[1], "measured_s": p[2], "predicted_s": p[3],
                               "error": rel_error(p[3], p[2])} for p in m]} for h, m in runs]
    return measured, hw, per_repeat


def calibrate(cfg, measured: list, hw, dt: str, wdt: str) -> dict:
    """The raw roofline (peaks only) and the two calibrations A and B fitted on some of the points
    (weights in wdt, activations and KV in dt)."""
    # the roofline alone: the probed peaks without the measured overheads and kernel rates
    peaks_only = hw.replace(step_overhead_s=0.0, layer_overhead_s=0.0, seq_overhead_s=0.0, linear_rates={},
                            decode_attention_flops={},
                            kernel_tables={})

    def predict_point(p, e, o, e_dec=None):
        eff = e_dec if (e_dec is not None and p[0] == "decode") else e
        return step_cost(cfg, p[4], peaks_only, wdt, dt, dt, efficiency={"compute": eff},
                         overhead_s=o).predicted_seconds

    decode = [p for p in measured if p[0] == "decode"]
    prefill = [p for p in measured if p[0] == "prefill"]
    fit_dec = next((p for p in decode if p[1] == FIT_DECODE_BATCH), decode[0])
    fit_big = max(decode, key=lambda p: p[1])
    fit_pre = next((p for p in prefill if p[1] == FIT_PREFILL_LEN), prefill[len(prefill) // 2])

    def fit_oe(e_dec):
        return fit_calibration(lambda kind, e, o: predict_point(fit_dec if kind == "decode" else fit_pre, e, o, e_dec),
                               fit_dec[2], fit_pre[2])

    overhead, eff = fit_oe(None)
    e_dec = fit_decode_efficiency(lambda ed: predict_point(fit_big, *fit_oe(ed)[::-1], ed), fit_big[2])
    overhead3, eff3 = fit_oe(e_dec)
    return {"peaks_only": peaks_only, "fit_dec": fit_dec, "fit_big": fit_big, "fit_pre": fit_pre,
            "overhead": overhead, "eff": eff, "overhead3": overhead3, "eff3": eff3, "e_dec": e_dec,
            "A": {"fit": [fit_dec, fit_pre], "predict": lambda p: predict_point(p, eff, overhead)},
            "B": {"fit": [fit_dec, fit_pre, fit_big], "predict": lambda p: predict_point(p, eff3, overhead3, e_dec)}}


def score(cfg, measured: list, cal: dict, dt: str, wdt: str) -> tuple:
    """(one row per point with every prediction and its error, the markdown cells, errors per phase)."""
    rows, table = [], []
    for p in measured:
        raw = step_cost(cfg, p[4], cal["peaks_only"], wdt, dt, dt).predicted_seconds
        probed = p[3]
        row = {"phase": p[0], "size": p[1], "measured_s": p[2], "raw_predicted_s": raw,
               "raw_error": rel_error(raw, p[2]), "predicted_s": probed, "error": rel_error(probed, p[2])}
        cells = [p[0], p[1], p[2] * 1e3, raw * 1e3, 100 * rel_error(raw, p[2]), probed * 1e3,
                 f"{100 * rel_error(probed, p[2]):+.1f}"]
        for name in ("A", "B"):
            t = cal[name]["predict"](p)
            fitted = any(p is f for f in cal[name]["fit"])
            row.update({f"calibrated_{name}_s": t, f"calibrated_{name}_error": rel_error(t, p[2]),
                        f"fitted_in_{name}": fitted})
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
    return rows, table, per_phase


def _plot(rows: list, cal: dict, path) -> object:
    fig, (ax1, ax2) = new_figure(2)
    for ax, phase, xlabel in ((ax1, "decode", "decode batch size"), (ax2, "prefill", "prompt tokens")):
        rs = [r for r in rows if r["phase"] == phase]
        x = [r["size"] for r in rs]
        ax.plot(x, [r["measured_s"] * 1e3 for r in rs], "o-", linewidth=2, label="measured (median)")
        ax.plot(x, [r["raw_predicted_s"] * 1e3 for r in rs], "s--", label="roofline only (probed peaks)")
        ax.plot(x, [r["predicted_s"] * 1e3 for r in rs], "D-",
                label="predicted: roofline, probed kernel rates, host overhead")
        ax.plot(x, [r["calibrated_A_s"] * 1e3 for r in rs], "^:",
                label=f"A: +{cal['overhead'] * 1e3:.1f} ms, eff {cal['eff']:.2f}")
        ax.plot(x, [r["calibrated_B_s"] * 1e3 for r in rs], "v-.",
                label=f"B: +{cal['overhead3'] * 1e3:.1f} ms, eff {cal['eff3']:.2f}, decode eff {cal['e_dec']:.2f}")
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
    return save_figure(fig, path)


def _fmt(s: dict) -> str:
    if not s["count"]:
        return "no held-out point"
    return (f"max {100 * s['max_abs']:.0f}%, mean {100 * s['mean_abs']:.0f}%, "
            f"{s['within_tolerance']}/{s['count']} within 25%")


def _sections(opts: LabOptions, engine, hw, cal: dict, table: list, per_phase: dict, per_repeat: list) -> list:
    cfg, dt = engine.model_config, act_dtype_name(opts)
    fit_dec, fit_big, fit_pre = cal["fit_dec"], cal["fit_big"], cal["fit_pre"]
    layers = cfg.num_hidden_layers
    phase_rows = [[ph, _fmt(v["predicted"]), _fmt(v["raw"]), _fmt(v["calibrated_A_held_out"]),
                   _fmt(v["calibrated_B_held_out"])] for ph, v in per_phase.items()]
    oh_total = hw.step_overhead_s + layers * hw.layer_overhead_s
    return [
        ("Setup", context_line(opts, engine, hw) + f"\n\nDecode: batch b of {DECODE_CONTEXT}-token random prompts, "
         f"median of {DECODE_STEPS} decode steps in each of {DECODE_ROUNDS} interleaved rounds. Prefill: one "
         f"prompt, one step, median of {PREFILL_RUNS} interleaved runs (1 for 2048). The whole measurement (probe, "
         f"then every point) ran {len(per_repeat)} times; each point's "
         "measured and predicted times below are the medians over those repeats (each repeat predicted with "
         "its own probe), the peaks shown are the probes' medians, and per-repeat errors are in "
         f"results.json ({_repeat_line(per_repeat)}). Regenerate with `servescope lab validate` "
         "(add `--out DIR`)."),
        ("Constants",
         f"**Predicted** (what each StepRecord carries): probed {hw.flops(dt) / 1e9:.0f} GFLOP/s {dt}, "
         f"{hw.memory_bandwidth / 1e9:.1f} GB/s, and the host overhead the probe measured on a tiny model "
         f"({hw.step_overhead_s * 1e3:.2f} ms per step + {hw.layer_overhead_s * 1e6:.0f} µs per layer = "
         f"{oh_total * 1e3:.2f} ms per step here, + {hw.seq_overhead_s * 1e6:.0f} µs per sequence), and the "
         f"linear ops no faster than the engine's linear "
         f"kernel measured by the probe at the same row count ({_rates_line(hw, dt)}); and where the probe "
         f"timed the engine's own kernels at this model's shapes ({_table_line(hw)}), the linear layers, "
         "attention and small ops at those times (measure/shape_kernels.py): nothing fitted to these points.\n\n"
         "**Roofline**: the same peaks alone (no overhead, no kernel rates). A and B start from it.\n\n"
         f"**A** (2 constants, fitted on decode batch {fit_dec[1]} and prefill {fit_pre[1]}): per-step overhead "
         f"o = {cal['overhead'] * 1e3:.2f} ms (= {cal['overhead'] / layers * 1e6:.0f} µs per layer over "
         f"{layers} layers), compute efficiency e = {cal['eff']:.3f}.\n\n"
         f"**B** (3 constants, fitted on decode batch {fit_dec[1]}, decode batch {fit_big[1]} and prefill "
         f"{fit_pre[1]}): o = {cal['overhead3'] * 1e3:.2f} ms, prefill compute efficiency e = {cal['eff3']:.3f} "
         f"and decode compute efficiency e_d = {cal['e_dec']:.3f}" + (": matmuls of a few rows (decode) use the "
         "cores worse than the probe's square ones" if cal["e_dec"] < 0.99 else "") + ".\n\nMemory efficiency "
         "is 1 in both. Every point not marked `fit` is a prediction."),
        ("Per point", md_table(["phase", "size", "measured ms", "roofline ms", "roofline err %", "predicted ms",
                                "predicted err %", "A ms", "A err %", "B ms", "B err %"], table)),
        ("Per phase", md_table(["phase", "predicted |error|", "roofline only |error|", "A |error| (held-out)",
                                "B |error| (held-out)"], phase_rows)),
    ]


def run(opts: LabOptions, session: LabSession) -> LabResult:
    runs = []  # per repeat: (hw, points)
    # one repeat at a model of its own (a real shape's points take seconds each), three on the default one
    for rep in range(1 if opts.quick or opts.model else REPEATS):
        hw, engine, measured = measure_repeat(opts, session, rep)
        runs.append((hw, measured))
    cfg, dt = engine.model_config, act_dtype_name(opts)
    wdt = engine.step_cost_predictor.predictor.dtypes[0]  # the weights' format as the engine predicts them
    measured, hw, per_repeat = combine_repeats(runs, dt)
    cal = calibrate(cfg, measured, hw, dt, wdt)
    rows, table, per_phase = score(cfg, measured, cal, dt, wdt)
    mixed = measure_mixed(session, opts.seed, opts.quick)
    plot = _plot(rows, cal, opts.out / "validation.png")
    fit_dec, fit_big, fit_pre = cal["fit_dec"], cal["fit_big"], cal["fit_pre"]
    summary = {"points": rows, "per_phase": per_phase,
               "calibration_A": {"overhead_s": cal["overhead"],
                                 "overhead_per_layer_s": cal["overhead"] / cfg.num_hidden_layers,
                                 "compute_efficiency": cal["eff"],
                                 "fit_points": [f"decode b={fit_dec[1]}", f"prefill {fit_pre[1]}"]},
               "calibration_B": {"overhead_s": cal["overhead3"],
                                 "overhead_per_layer_s": cal["overhead3"] / cfg.num_hidden_layers,
                                 "compute_efficiency": cal["eff3"], "decode_compute_efficiency": cal["e_dec"],
                                 "fit_points": [f"decode b={fit_dec[1]}", f"decode b={fit_big[1]}",
                                                f"prefill {fit_pre[1]}"]},
               "mixed": mixed, "hardware": {k: v for k, v in hw.to_dict().items() if k != "kernel_tables"},
               "kernel_tables": hw.kernel_tables, "decode_context": DECODE_CONTEXT, "repeats": per_repeat,
               "host_overhead": {"step_s": hw.step_overhead_s, "layer_s": hw.layer_overhead_s,
                                 "seq_s": hw.seq_overhead_s,
                                 "per_step_total_s": hw.step_overhead_s + cfg.num_hidden_layers * hw.layer_overhead_s}}
    sections = _sections(opts, engine, hw, cal, table, per_phase, per_repeat)
    sections.append(("Mixed continuous batching (issue 35)", mixed_section(mixed)))
    report = write_report(opts.out, "Cost model validation: predicted vs measured step time", sections, [plot], summary)
    return LabResult("validate", opts.out, report, [plot], summary)
