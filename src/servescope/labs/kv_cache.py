"""Lab `kv-cache`: with the cache, each new token computes one position and reads the cached K/V
(step time nearly flat in the position); without it (EngineConfig no_kv_cache=True, the recompute
baseline) every step reruns the whole sequence, so the time per token grows linearly with the
position and the total time quadratically. The price of the cache is memory:
2 * layers * kv_heads * head_dim * bytes per token, allocated in blocks.
"""

from __future__ import annotations

import random

import numpy as np

from servescope.labs.common import (
    LabOptions, LabResult, LabSession, blocks_for, context_line, lab_hardware, md_table, new_figure,
    random_prompt, run_to_completion, save_figure, warm_up, write_report,
)

PROMPT_LEN = 16


def lengths(quick: bool) -> tuple:
    """(tokens generated with the cache, tokens generated without it)."""
    return (12, 8) if quick else (256, 96)


def per_token(recs: list) -> tuple:
    """(position of the token each step produced, measured s, predicted s), one per step."""
    pos = [max(r.context_lens) for r in recs]
    return pos, [r.wall_seconds for r in recs], [r.predicted_seconds for r in recs]


def linear_fit(x, y) -> tuple:
    """(intercept, slope) of a least-squares line."""
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(intercept), float(slope)


def run(opts: LabOptions, session: LabSession) -> LabResult:
    n_cache, n_nocache = lengths(opts.quick)
    max_len = PROMPT_LEN + n_cache + 16
    rng = random.Random(opts.seed)
    results = {}
    engines = {}
    for mode, n_out, extra in (("with cache", n_cache, {}), ("without cache", n_nocache, {"no_kv_cache": True})):
        engine = session.engine(max_num_seqs=4, max_model_len=max_len, num_kv_blocks=blocks_for(max_len) * 2,
                                max_num_batched_tokens=max(1024, max_len), **extra)
        warm_up(engine, rng, batch=1)
        prompt = random_prompt(random.Random(opts.seed + 1), PROMPT_LEN, engine.model_config.vocab_size)
        _, recs = run_to_completion(engine, [prompt], n_out, "kv")
        results[mode] = {"records": recs[1:], "prefill": recs[0]}  # step 0 is the prompt's prefill
        engines[mode] = engine
    engine = engines["with cache"]
    hw = lab_hardware(opts, engine)
    cfg = engine.model_config

    fig, (ax1, ax2) = new_figure(2)
    summary = {"kv_bytes_per_token": engine.kv_bytes_per_token, "block_size": engine.cache_config.block_size}
    rows = []
    for mode, style in (("with cache", "tab:blue"), ("without cache", "tab:red")):
        pos, wall, pred = per_token(results[mode]["records"])
        a, b = linear_fit(pos, wall)
        pa, pb = linear_fit(pos, pred)
        ax1.plot(pos, [w * 1e3 for w in wall], ".", color=style, alpha=0.6, label=f"{mode}: measured")
        ax1.plot(pos, [(a + b * p) * 1e3 for p in pos], "-", color=style, label=f"{mode}: fit {b * 1e6:.1f} µs/position")
        ax1.plot(pos, [p * 1e3 for p in pred], "--", color=style, alpha=0.8, label=f"{mode}: roofline prediction")
        summary[mode] = {"positions": pos, "measured_s": wall, "predicted_s": pred, "fit_intercept_s": a,
                         "fit_slope_s_per_position": b, "predicted_slope_s_per_position": pb,
                         "total_measured_s": sum(wall)}
        rows.append([mode, len(pos), wall[0] * 1e3, wall[-1] * 1e3, b * 1e6, pb * 1e6, sum(wall)])
    common = min(max(summary["with cache"]["positions"]), max(summary["without cache"]["positions"]))
    ax1.set_xlabel("position of the generated token (context length)")
    ax1.set_ylabel("step time (ms)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("Time per output token vs position")
    ax1.legend(fontsize=7)
    ax1.grid(True, linewidth=0.3)

    # KV bytes: the formula (per token x context) and what the block allocator actually holds
    recs = results["with cache"]["records"][:-1]  # the last step finishes the request and frees its blocks
    ctx = [max(r.context_lens) for r in recs]
    held = [r.kv_blocks_used * engine.cache_config.block_size * engine.kv_bytes_per_token for r in recs]
    ax2.plot(ctx, [c * engine.kv_bytes_per_token / 2**20 for c in ctx], "-", label="2·L·Hkv·D·bytes × context")
    ax2.step(ctx, [h / 2**20 for h in held], where="post", label=f"allocated ({engine.cache_config.block_size}-token blocks)")
    xs = np.linspace(1, 32768, 50)
    ax2_in = ax2.inset_axes([0.55, 0.1, 0.4, 0.35])
    ax2_in.plot(xs, xs * engine.kv_bytes_per_token / 2**30, color="tab:purple")
    ax2_in.set_title("to 32k tokens (GiB)", fontsize=7)
    ax2_in.tick_params(labelsize=6)
    ax2.set_xlabel("context length (tokens)")
    ax2.set_ylabel("KV cache of one sequence (MiB)")
    ax2.set_title(f"KV bytes vs context ({engine.kv_bytes_per_token} B/token)")
    ax2.legend(fontsize=8, loc="upper left")
    ax2.grid(True, linewidth=0.3)
    plot = save_figure(fig, opts.out / "kv_cache.png")

    w, wo = summary["with cache"], summary["without cache"]
    at = lambda d, p: d["fit_intercept_s"] + d["fit_slope_s_per_position"] * p  # noqa: E731
    ratio = at(wo, common) / at(w, common)
    summary["speedup_at_common_position"] = ratio
    summary["common_position"] = common
    per_elem = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    kv_formula = (f"2 x {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x {cfg.head_dim} "
                  f"head dim x {engine.kv_bytes_per_token // per_elem} "
                  f"bytes = {engine.kv_bytes_per_token} bytes per token")
    slope_us = w["fit_slope_s_per_position"] * 1e6
    # one cached K/V row more per layer is a fraction of a µs: a fitted slope at or below zero is the
    # machine's step-to-step noise, not a step getting cheaper
    with_cache_growth = (f"it grows by only {slope_us:.1f} µs per position (reading one more cached K/V row per layer)."
                         if slope_us > 0 else
                         f"it does not grow measurably (fitted slope {slope_us:.1f} µs per position, within the "
                         "step-to-step noise of this machine; one more cached K/V row per layer is well under 1 µs).")
    sections = [
        ("Setup", context_line(opts, engine, hw) + f"\n\nOne request: a {PROMPT_LEN}-token random prompt, greedy; "
         f"{n_cache} tokens with the cache, {n_nocache} without (the `no_kv_cache=True` engine re-runs the "
         "whole sequence every step). Each point is one step (one output token)."),
        ("Results", md_table(["mode", "tokens", "first ms", "last ms", "measured µs / position",
                              "predicted µs / position", "total s"], rows)),
        ("What it shows",
         f"Without the cache the time per token grows by {wo['fit_slope_s_per_position'] * 1e6:.0f} µs per "
         f"position (the roofline says {wo['predicted_slope_s_per_position'] * 1e6:.0f}): each step recomputes "
         f"all previous positions, so generating n tokens costs O(n^2). With the cache " + with_cache_growth +
         f" At position {common} the cache makes a token x{ratio:.1f} cheaper. The memory it costs: "
         f"{kv_formula}; a sequence holds whole blocks, so allocated bytes step up every "
         f"{engine.cache_config.block_size} tokens."),
    ]
    report = write_report(opts.out, "Lab: the KV cache", sections, [plot], summary)
    return LabResult("kv-cache", opts.out, report, [plot], summary)
