"""Lab `attention-scaling`: prefill's linear layers cost O(n) in the prompt length n, causal
attention O(n^2) (token p attends to p + 1 keys). TTFT(n) = a + b n + c n^2 fitted by least squares
exposes the quadratic term; the cost model's per-op times give attention's share of each step.
"""

from __future__ import annotations

import random

import numpy as np

from servescope.analysis.cost_model import step_cost
from servescope.labs.common import (
    LabOptions, LabResult, LabSession, act_dtype_name, blocks_for, context_line, interleaved, lab_hardware,
    md_table, median, new_figure, random_prompt, rel_error, run_to_completion, save_figure, warm_up, write_report,
)


QUICK_ROUNDS = 3  # quick mode: interleaved repeats of every length (medians)


def prompt_lengths(quick: bool) -> list:
    return [32, 64, 128, 192] if quick else [128, 512, 1024, 1536, 2048, 3072, 4096]


def quadratic_fit(n, t) -> tuple:
    """(a, b, c) of t = a + b n + c n^2 (numpy polyfit, highest power first, reversed)."""
    c, b, a = np.polyfit(np.asarray(n, float), np.asarray(t, float), 2)
    return float(a), float(b), float(c)


def quadratic_share(fit: tuple, n: float) -> float:
    """Fraction of the fitted time at length n that is the n^2 term."""
    a, b, c = fit
    total = a + b * n + c * n * n
    return c * n * n / total if total else float("nan")


def measure(opts: LabOptions, session: LabSession) -> tuple:
    """(engine, {n: (TTFT s, prefill step s, predicted s)}), each the median over the rounds."""
    lens = prompt_lengths(opts.quick)
    max_len = max(lens) + 16
    engine = session.engine(max_num_seqs=2, enable_chunked_prefill=False, max_model_len=max_len,
                            max_num_batched_tokens=max_len, num_kv_blocks=blocks_for(max_len) + 8)
    rng = random.Random(opts.seed)
    warm_up(engine, rng, prompt_len=64, batch=1)
    vocab = engine.model_config.vocab_size
    # measure in a shuffled order: a drift in machine load over the run then adds noise to the fit
    # instead of bending it (ascending order would turn "the machine got quieter" into curvature)
    order = list(lens)
    random.Random(opts.seed).shuffle(order)

    def prefill(n, rnd):
        outs, recs = run_to_completion(engine, [random_prompt(rng, n, vocab)], 1, f"a{n}r{rnd}-")
        pre = [r for r in recs if r.phase == "prefill"]
        return outs[0].metrics.ttft, sum(r.wall_seconds for r in pre), sum(r.predicted_seconds for r in pre)

    runs = interleaved(order, QUICK_ROUNDS if opts.quick else 1, prefill)
    return engine, {n: tuple(median([r[i] for r in runs[n]]) for i in range(3)) for n in lens}


def attention_cost(cfg, n: int, hw, dt: str) -> tuple:
    """(attention's share of the predicted prefill step of n tokens, attention FLOPs): the cost model's
    per-op split."""
    cost = step_cost(cfg, [(n, 0)], hw, dt, dt, dt, num_logits=1)
    return cost.op("attention").seconds / cost.predicted_seconds, cost.op("attention").flops


def run(opts: LabOptions, session: LabSession) -> LabResult:
    lens = prompt_lengths(opts.quick)
    engine, measured = measure(opts, session)
    hw = lab_hardware(opts, engine)
    dt = act_dtype_name(opts)
    cfg = engine.model_config
    ttft = [measured[n][0] for n in lens]
    step_s = [measured[n][1] for n in lens]
    pred = [measured[n][2] for n in lens]
    attn_share, attn_flops = zip(*(attention_cost(cfg, n, hw, dt) for n in lens))
    fit = quadratic_fit(lens, ttft)
    pfit = quadratic_fit(lens, pred)
    n_max = max(lens)

    fig, (ax1, ax2) = new_figure(2)
    xs = np.linspace(0, n_max, 100)
    a, b, c = fit
    ax1.plot(lens, ttft, "o", label="measured TTFT")
    ax1.plot(xs, a + b * xs + c * xs ** 2, "-",
             label=f"fit {a * 1e3:.0f} ms + {b * 1e6:.0f} µs·n + {c * 1e9:.2f} ns·n²")
    ax1.plot(xs, a + b * xs, ":", color="gray", label="fit without the n² term")
    ax1.plot(lens, pred, "s--", label="roofline prediction (prefill step)")
    ax1.set_xlabel("prompt length n (tokens)")
    ax1.set_ylabel("TTFT (s)")
    ax1.set_title("TTFT vs prompt length")
    ax1.legend(fontsize=7)
    ax1.grid(True, linewidth=0.3)
    ax2.plot(lens, [100 * s for s in attn_share], "s-", label="attention share of predicted step time")
    ax2.plot(lens, [100 * quadratic_share(fit, n) for n in lens], "o-", label="n² share of the measured fit")
    ax2.set_xlabel("prompt length n (tokens)")
    ax2.set_ylabel("% of prefill time")
    ax2.set_ylim(bottom=0)
    ax2.set_title("The quadratic part grows with n")
    ax2.legend(fontsize=8)
    ax2.grid(True, linewidth=0.3)
    plot = save_figure(fig, opts.out / "attention_scaling.png")

    c_attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim / hw.flops(dt)
    rows = [[n, t * 1e3, s * 1e3, p * 1e3, 100 * rel_error(p, s), 100 * sh, 100 * quadratic_share(fit, n)]
            for n, t, s, p, sh in zip(lens, ttft, step_s, pred, attn_share)]
    summary = {"prompt_lengths": lens, "ttft_s": ttft, "prefill_step_s": step_s, "predicted_s": pred,
               "fit_a_b_c": fit, "predicted_fit_a_b_c": pfit, "attention_share_predicted": list(attn_share),
               "attention_flops": list(attn_flops),
               "quadratic_share_at_max": quadratic_share(fit, n_max)}
    sections = [
        ("Setup", context_line(opts, engine, hw) + "\n\nOne random prompt per length, prefilled in one step "
         "(chunked prefill off), one output token; TTFT from the request's metrics (arrival to first token)"
         + (f"; medians of {QUICK_ROUNDS} interleaved rounds." if opts.quick else ".")),
        ("Results", md_table(["prompt", "TTFT ms", "prefill step ms", "predicted ms", "error %",
                              "attention % (model)", "n² % (fit)"], rows)),
        ("Fit", f"Measured: TTFT = {a * 1e3:.2f} ms + {b * 1e6:.2f} µs·n + {c * 1e9:.4f} ns·n².\n\n"
         f"Roofline prediction fitted the same way: {pfit[0] * 1e3:.2f} ms + {pfit[1] * 1e6:.2f} µs·n + "
         f"{pfit[2] * 1e9:.4f} ns·n². The model's attention FLOPs alone give "
         f"c = 2·L·H·D / peak = {c_attn * 1e9:.4f} ns "
         f"(causal: n(n+1)/2 keys x 4·H·D FLOPs per layer)."),
        ("What it shows",
         f"At n = {n_max} the n² term is {100 * quadratic_share(fit, n_max):.0f}% of the fitted TTFT and the cost "
         f"model gives attention {100 * attn_share[-1]:.0f}% of the step (vs {100 * attn_share[0]:.0f}% at n = "
         f"{lens[0]}): the linear layers dominate short prompts, attention's share grows with every doubling."),
    ]
    report = write_report(opts.out, "Lab: attention scaling (TTFT vs prompt length)", sections, [plot], summary)
    return LabResult("attention-scaling", opts.out, report, [plot], summary)
