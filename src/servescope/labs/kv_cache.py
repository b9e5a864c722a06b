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
    LabOptions, LabResult, LabSession, blocks_for, context_line, interleaved, lab_hardware, md_table, median,
    new_figure, random_prompt, run_to_completion, save_figure, warm_up, write_report,
)

PROMPT_LEN = 16
QUICK_ROUNDS = 3  # quick mode: interleaved repeats of both modes
MODES = (("with cache", {}), ("without cache", {"no_kv_cache": True}))


def lengths(quick: bool) -> tuple:
    """(prompt tokens, tokens generated with the cache, tokens generated without it). Quick: a longer
    prompt than the full run's, so that re-running it costs a tiny model more than a step's overhead,
    and enough cached tokens to cross a few block boundaries."""
    return (48, 40, 8) if quick else (PROMPT_LEN, 256, 96)


def per_token(recs: list) -> tuple:
    """(position of the token each step produced, measured s, predicted s), one per step."""
    pos = [max(r.context_lens) for r in recs]
    return pos, [r.wall_seconds for r in recs], [r.predicted_seconds for r in recs]


def linear_fit(x, y) -> tuple:
    """(intercept, slope) of a least-squares line."""
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(intercept), float(slope)


def measure(opts: LabOptions, session: LabSession) -> tuple:
    """(the engine with the cache, {mode: [per round, the StepRecords of the tokens after the prompt's
    prefill]}): one request with the same prompt in each mode, the modes in interleaved rounds."""
    prompt_len, n_cache, n_nocache = lengths(opts.quick)
    max_len = prompt_len + n_cache + 16
    rng = random.Random(opts.seed)
    engines = {}
    for mode, extra in MODES:
        engines[mode] = session.engine(max_num_seqs=4, max_model_len=max_len, num_kv_blocks=blocks_for(max_len) * 2,
                                       max_num_batched_tokens=max(1024, max_len), **extra)
        warm_up(engines[mode], rng, batch=1)
    prompt = random_prompt(random.Random(opts.seed + 1), prompt_len, engines["with cache"].model_config.vocab_size)
    n_out = {"with cache": n_cache, "without cache": n_nocache}

    def generate(mode, rnd):
        _, recs = run_to_completion(engines[mode], [prompt], n_out[mode], f"kv{rnd}-")
        return recs[1:]  # step 0 is the prompt's prefill

    return engines["with cache"], interleaved([m for m, _ in MODES], QUICK_ROUNDS if opts.quick else 1, generate)


def kv_held(engine, recs: list) -> dict:
    """What the block allocator held at each step of one with-cache request (the request's last step
    is left out: it finishes the request and frees its blocks)."""
    recs = recs[:-1]
    bs = engine.cache_config.block_size
    return {"context": [max(r.context_lens) for r in recs], "blocks_used": [r.kv_blocks_used for r in recs],
            "bytes_allocated": [r.kv_blocks_used * bs * engine.kv_bytes_per_token for r in recs]}


def _plot(engine, summary: dict, path) -> object:
    fig, (ax1, ax2) = new_figure(2)
    for mode, style in (("with cache", "tab:blue"), ("without cache", "tab:red")):
        d = summary[mode]
        pos, a, b = d["positions"], d["fit_intercept_s"], d["fit_slope_s_per_position"]
        ax1.plot(pos, [w * 1e3 for w in d["measured_s"]], ".", color=style, alpha=0.6, label=f"{mode}: measured")
        ax1.plot(pos, [(a + b * p) * 1e3 for p in pos], "-", color=style,
                 label=f"{mode}: fit {b * 1e6:.1f} µs/position")
        ax1.plot(pos, [p * 1e3 for p in d["predicted_s"]], "--", color=style, alpha=0.8,
                 label=f"{mode}: roofline prediction")
    ax1.set_xlabel("position of the generated token (context length)")
    ax1.set_ylabel("step time (ms)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("Time per output token vs position")
    ax1.legend(fontsize=7)
    ax1.grid(True, linewidth=0.3)

    # KV bytes: the formula (per token x context) and what the block allocator actually holds
    bpt, bs, held = engine.kv_bytes_per_token, engine.cache_config.block_size, summary["kv_held"]
    ctx = held["context"]
    ax2.plot(ctx, [c * bpt / 2**20 for c in ctx], "-", label="2·L·Hkv·D·bytes × context")
    ax2.step(ctx, [h / 2**20 for h in held["bytes_allocated"]], where="post", label=f"allocated ({bs}-token blocks)")
    xs = np.linspace(1, 32768, 50)
    ax2_in = ax2.inset_axes([0.55, 0.1, 0.4, 0.35])
    ax2_in.plot(xs, xs * bpt / 2**30, color="tab:purple")
    ax2_in.set_title("to 32k tokens (GiB)", fontsize=7)
    ax2_in.tick_params(labelsize=6)
    ax2.set_xlabel("context length (tokens)")
    ax2.set_ylabel("KV cache of one sequence (MiB)")
    ax2.set_title(f"KV bytes vs context ({bpt} B/token)")
    ax2.legend(fontsize=8, loc="upper left")
    ax2.grid(True, linewidth=0.3)
    return save_figure(fig, path)


def _shows(engine, summary: dict) -> str:
    cfg = engine.model_config
    w, wo = summary["with cache"], summary["without cache"]
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
    return (f"Without the cache the time per token grows by {wo['fit_slope_s_per_position'] * 1e6:.0f} µs per "
            f"position (the roofline says {wo['predicted_slope_s_per_position'] * 1e6:.0f}): each step recomputes "
            f"all previous positions, so generating n tokens costs O(n^2). With the cache " + with_cache_growth +
            f" Over positions {summary['common_range'][0]} to {summary['common_range'][1]} the cache makes the "
            f"median token x{summary['median_ratio_common_range']:.1f} cheaper "
            f"(x{summary['speedup_at_common_position']:.1f} at position {summary['common_position']} by the "
            "fitted lines). The memory it costs: "
            f"{kv_formula}; a sequence holds whole blocks, so allocated bytes step up every "
            f"{engine.cache_config.block_size} tokens.")


def run(opts: LabOptions, session: LabSession) -> LabResult:
    engine, runs = measure(opts, session)
    hw = lab_hardware(opts, engine)
    summary = {"kv_bytes_per_token": engine.kv_bytes_per_token, "block_size": engine.cache_config.block_size,
               "kv_held": kv_held(engine, runs["with cache"][0])}
    rows = []
    for mode, rounds in runs.items():
        recs = sum(rounds, [])
        pos, wall, pred = per_token(recs)
        a, b = linear_fit(pos, wall)
        pa, pb = linear_fit(pos, pred)
        summary[mode] = {"positions": pos, "measured_s": wall, "predicted_s": pred, "fit_intercept_s": a,
                         "fit_slope_s_per_position": b, "predicted_slope_s_per_position": pb,
                         "tokens_per_step": [r.num_tokens for r in recs],
                         "total_measured_s": sum(wall) / len(rounds)}
        rows.append([mode, len(rounds[0]), wall[0] * 1e3, wall[len(rounds[0]) - 1] * 1e3, b * 1e6, pb * 1e6,
                     sum(wall) / len(rounds)])
    w, wo = summary["with cache"], summary["without cache"]
    common = min(max(w["positions"]), max(wo["positions"]))
    at = lambda d, p: d["fit_intercept_s"] + d["fit_slope_s_per_position"] * p  # noqa: E731
    summary["speedup_at_common_position"] = at(wo, common) / at(w, common)
    summary["common_position"] = common
    # the same, without a fit: the median step over the positions both modes reached (a fit over the few
    # positions of a quick run is at the mercy of one slow step)
    lo = max(min(w["positions"]), min(wo["positions"]))
    in_range = lambda d: [t for p, t in zip(d["positions"], d["measured_s"]) if lo <= p <= common]  # noqa: E731
    summary["common_range"] = [lo, common]
    summary["median_ratio_common_range"] = median(in_range(wo)) / median(in_range(w))
    plot = _plot(engine, summary, opts.out / "kv_cache.png")
    prompt_len, n_cache, n_nocache = lengths(opts.quick)
    sections = [
        ("Setup", context_line(opts, engine, hw) + f"\n\nOne request: a {prompt_len}-token random prompt, greedy; "
         f"{n_cache} tokens with the cache, {n_nocache} without (the `no_kv_cache=True` engine re-runs the "
         "whole sequence every step). Each point is one step (one output token)"
         + (f"; the two modes ran in {len(runs['with cache'])} interleaved rounds." if opts.quick else ".")),
        ("Results", md_table(["mode", "tokens", "first ms", "last ms", "measured µs / position",
                              "predicted µs / position", "total s"], rows)),
        ("What it shows", _shows(engine, summary)),
    ]
    report = write_report(opts.out, "Lab: the KV cache", sections, [plot], summary)
    return LabResult("kv-cache", opts.out, report, [plot], summary)
