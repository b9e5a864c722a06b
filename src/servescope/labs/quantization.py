"""Lab `quantization`: fewer bytes per weight and per cached token. A decode step reads every weight
once and each sequence's whole KV cache once, with little arithmetic on each byte (memory-bound), so
its time follows the bytes it moves; and a KV cache of B bytes per token holds budget / B tokens.

Two axes, each measured beside the cost model's prediction (the StepRecords' `predicted_seconds`):
- bits per weight: float32, bfloat16 (where the CPU has bfloat16 dot products), int8 (per channel),
  int4 (group 32) and, for a GGUF model, the file's own blocks: the median decode step at batch 1.
- bits per cached token: float32, int8 and fp8 e4m3 KV caches (per token and KV head scales) on the
  float32 weights: the tokens a fixed memory budget holds, and the median decode step at a long context
  where the KV reads are a visible share of the bytes.
"""

from __future__ import annotations

import random

from servescope.analysis.cpu_isa import local_fast_bf16
from servescope.config import EngineConfig
from servescope.measure.local_hardware import measured_engine
from servescope.labs.common import (
    LabOptions, LabResult, LabSession, blocks_for, context_line, interleaved, lab_hardware, md_table, median,
    new_figure, random_prompt, rel_error, run_to_completion, save_figure, warm_up, write_report,
)
from servescope.model.attention import kv_quant

QUICK_ROUNDS = 3
KV_BUDGET = 8 << 20  # bytes of KV cache for the capacity comparison
# nominal bits per weight of the projections (int8: per-channel float scales; int4: a float16 scale per
# 32; gguf: Q4_1's scale and offset per 32; the embedding keeps its own form)
NOMINAL_BITS = {"float32": 32, "bfloat16": 16, "int8": 8, "int4": 4.5, "gguf": 5.0}


def sizes(quick: bool) -> dict:
    """prompt tokens and decode steps for the weight axis, and the context for the KV axis."""
    return {"prompt": 32, "steps": 8, "kv_context": 256} if quick else {"prompt": 64, "steps": 24, "kv_context": 1024}


def weight_modes(opts: LabOptions) -> list:
    """The weight forms this machine and model run: bfloat16 only with fast bfloat16 matmuls, gguf only
    for a GGUF file (the embedded model is one)."""
    modes = ["float32"] + (["bfloat16"] if local_fast_bf16() else []) + ["int8", "int4"]
    if opts.model is None or str(opts.model).endswith(".gguf"):
        modes.append("gguf")
    return modes


def kv_dtypes() -> list:
    return ["float32", "int8"] + (["fp8_e4m3"] if kv_quant.FP8 is not None else [])


def _weight_engine(opts: LabOptions, session: LabSession, mode: str, max_len: int):
    """float32: the session's engine; the others load the weights again in their own form."""
    cache = dict(max_num_seqs=2, max_model_len=max_len, num_kv_blocks=blocks_for(max_len) * 2,
                 max_num_batched_tokens=max(1024, max_len))
    if mode == "float32":
        return session.engine(**cache)
    o = opts
    dtype = "bfloat16" if mode == "bfloat16" else o.dtype
    cfg = EngineConfig(model=o.model, dtype=dtype, quantization=None if mode == "bfloat16" else mode,
                       num_threads=o.threads, hardware=o.hardware, seed=o.seed, enable_prefix_caching=False,
                       skip_tokenizer_init=True, **cache)
    return measured_engine(cfg)


def _decode_steps(engine, prompt_len: int, steps: int, rng: random.Random, tag: str) -> list:
    """The decode StepRecords of one request (batch 1) after a prompt of prompt_len tokens."""
    prompt = random_prompt(rng, prompt_len, engine.model_config.vocab_size)
    _, recs = run_to_completion(engine, [prompt], steps + 1, tag)
    return [r for r in recs if r.phase == "decode"]


def _summarise(recs: list) -> dict:
    return {"measured_s": median([r.wall_seconds for r in recs]),
            "predicted_s": median([r.predicted_seconds for r in recs]),
            "bytes": median([r.bytes for r in recs])}


def measure_weights(opts: LabOptions, session: LabSession) -> dict:
    """{mode: {weight_mib, measured_s, predicted_s, bytes}} at batch 1, the modes in interleaved rounds."""
    sz = sizes(opts.quick)
    # the KV axis's context too: the first engine to load the weights sets the rotary table's length,
    # and the KV axis's engines share those weights (positions past the table are slow to extend)
    max_len = max(sz["prompt"] + sz["steps"], sz["kv_context"]) + 32
    rng = random.Random(opts.seed)
    engines = {m: _weight_engine(opts, session, m, max_len) for m in weight_modes(opts)}
    for e in engines.values():
        warm_up(e, rng, batch=1)
    runs = interleaved(list(engines), QUICK_ROUNDS if opts.quick else 3,
                       lambda m, rnd: _decode_steps(engines[m], sz["prompt"], sz["steps"], rng, f"w{m}{rnd}-"))
    return {m: {"weight_mib": engines[m].weight_bytes / 2**20, "bits": NOMINAL_BITS[m], **_summarise(sum(r, []))}
            for m, r in runs.items()}


def measure_kv(opts: LabOptions, session: LabSession) -> dict:
    """{kv dtype: {bytes_per_token, capacity_tokens (in KV_BUDGET), measured_s, predicted_s, bytes}}:
    decode at a long context on the float32 weights."""
    sz = sizes(opts.quick)
    ctx = sz["kv_context"]
    rng = random.Random(opts.seed + 1)
    engines, capacity = {}, {}
    for dt in kv_dtypes():
        capacity[dt] = session.engine(kv_cache_dtype=dt, kv_cache_memory_bytes=KV_BUDGET, max_model_len=64)
        engines[dt] = session.engine(kv_cache_dtype=dt, max_num_seqs=2, max_model_len=ctx + 32,
                                     num_kv_blocks=blocks_for(ctx + 32) * 2, max_num_batched_tokens=max(1024, ctx))
        warm_up(engines[dt], rng, batch=1)
    runs = interleaved(list(engines), QUICK_ROUNDS if opts.quick else 3,
                       lambda dt, rnd: _decode_steps(engines[dt], ctx, sz["steps"], rng, f"kv{dt}{rnd}-"))
    return {dt: {"bytes_per_token": engines[dt].kv_bytes_per_token,
                 "bits_per_value": 8 * engines[dt].kv_bytes_per_token
                 / (2 * engines[dt].model_config.num_hidden_layers * engines[dt].model_config.kv_size),
                 "capacity_tokens": capacity[dt].cache_config.num_blocks * capacity[dt].cache_config.block_size,
                 **_summarise(sum(r, []))} for dt, r in runs.items()}


def _plot(weights: dict, kv: dict, path) -> object:
    fig, (ax1, ax2) = new_figure(2, size=(5.5, 4.2))
    for ax, data, xkey, title in ((ax1, weights, "bits", "decode step (batch 1) vs bits per weight"),
                                  (ax2, kv, "bits_per_value",
                                   "decode step at a long context vs bits per cached value")):
        xs = [d[xkey] for d in data.values()]
        ax.plot(xs, [d["measured_s"] * 1e3 for d in data.values()], "o", label="measured (median)")
        ax.plot(xs, [d["predicted_s"] * 1e3 for d in data.values()], "x", markersize=9, label="cost model")
        for name, d in data.items():
            ax.annotate(name, (d[xkey], d["measured_s"] * 1e3), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel(xkey.replace("_", " "))
        ax.set_ylabel("step time (ms)")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=9)
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=7)
    cap = ax2.twinx()
    cap.bar([d["bits_per_value"] for d in kv.values()], [d["capacity_tokens"] / 1e3 for d in kv.values()], width=1.2,
            alpha=0.25, color="tab:green")
    cap.set_ylabel(f"KV capacity in {KV_BUDGET >> 20} MiB (k tokens, bars)")
    return save_figure(fig, path)


def _shows(weights: dict, kv: dict) -> str:
    f32w, f32k, i8k = weights["float32"], kv["float32"], kv["int8"]
    lines = ["Weights: each decode step reads the whole model, so the step follows the weight bytes: "
             + ", ".join(f"{m} {d['weight_mib']:.1f} MiB -> {d['measured_s'] * 1e3:.2f} ms "
                         f"(x{f32w['measured_s'] / d['measured_s']:.2f} float32's speed)" for m, d in weights.items())
             + ". Where a form is slower than its bytes say, its kernel is compute-bound (unpacking and "
               "widening each weight costs more than reading it) rather than memory-bound."]
    lines.append(f"KV cache: {f32k['bytes_per_token']} bytes per token in float32 against {i8k['bytes_per_token']} "
                 f"in int8 (the values plus a 4-byte scale per row of head_dim): {KV_BUDGET >> 20} MiB hold "
                 f"{f32k['capacity_tokens']} against {i8k['capacity_tokens']} tokens "
                 f"(x{i8k['capacity_tokens'] / f32k['capacity_tokens']:.2f}). At the long context the cost model "
                 f"predicts the int8 step at x{f32k['predicted_s'] / i8k['predicted_s']:.2f} the float32 one's speed "
                 f"(fewer KV bytes); measured x{f32k['measured_s'] / i8k['measured_s']:.2f}: "
                 "the kernel dequantises each tile in registers, which pays only where the step is "
                 "memory-bound on the cache's reads.")
    def errs(rows: dict) -> str:
        return ", ".join(f"{m} {100 * (d['predicted_s'] / d['measured_s'] - 1):+.0f}%" for m, d in rows.items())

    lines.append("The cost model counts the bytes as stored: the KV cache's scales included, and the packed weights' "
                 f"blocks and scales (analysis/packed_weights.py). Predicted / measured - 1: weights {errs(weights)}; "
                 f"KV cache {errs(kv)} (one cause of a common excess: the probe's bandwidth is cached from one minute, "
                 "and a shared machine's moves from minute to minute).")
    return "\n\n".join(lines)


def run(opts: LabOptions, session: LabSession) -> LabResult:
    weights = measure_weights(opts, session)
    kv = measure_kv(opts, session)
    engine = session.engine()
    hw = lab_hardware(opts, engine)
    plot = _plot(weights, kv, opts.out / "quantization.png")
    wrows = [[m, d["bits"], d["weight_mib"], d["measured_s"] * 1e3, d["predicted_s"] * 1e3,
              rel_error(d["predicted_s"], d["measured_s"]), weights["float32"]["measured_s"] / d["measured_s"]]
             for m, d in weights.items()]
    krows = [[dt, d["bytes_per_token"], d["bits_per_value"], d["capacity_tokens"], d["measured_s"] * 1e3,
              d["predicted_s"] * 1e3, rel_error(d["predicted_s"], d["measured_s"])] for dt, d in kv.items()]
    sz = sizes(opts.quick)
    sections = [
        ("Setup", context_line(opts, engine, hw) + f"\n\nWeights: one request, a {sz['prompt']}-token prompt, "
         f"{sz['steps']} decode steps per round; KV: one request decoding after a {sz['kv_context']}-token prompt; "
         f"the forms in {QUICK_ROUNDS if opts.quick else 3} interleaved rounds, medians of the decode steps."),
        ("Bits per weight", md_table(["weights", "nominal bits", "MiB", "measured ms", "predicted ms",
                                      "prediction error", "speed vs float32"], wrows)),
        ("Bits per cached token", md_table(["KV cache", "bytes / token", "bits / value",
                                            f"tokens in {KV_BUDGET >> 20} MiB",
                                            "measured ms", "predicted ms", "prediction error"], krows)),
        ("What it shows", _shows(weights, kv)),
    ]
    summary = {"weights": weights, "kv": kv, "kv_budget_bytes": KV_BUDGET}
    report = write_report(opts.out, "Lab: quantization (bits per weight and per cached token)", sections,
                          [plot], summary)
    return LabResult("quantization", opts.out, report, [plot], summary)
